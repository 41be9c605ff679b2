"""Chat logprobs describe visible content only: the tokens of a successful tool call are left out,
while a block that turns out not to be a call keeps its tokens' logprobs, in order."""

from __future__ import annotations

import pytest

from dgpp.sample.params import SamplingParams
from dgpp.sample.sampler import SampleResult
from dgpp.sched.request import RetireReason, SeqEvent
from dgpp.serve.output_processor import OutputProcessor
from dgpp.testing.tokenizers import build_tiny_tokenizer
from dgpp.text.tokenizer import Tokenizer
from dgpp_qwen.dialect import QwenXmlDialect

TOOL = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]},
    },
}


@pytest.fixture(scope="module")
def tokenizer(tmp_path_factory) -> Tokenizer:
    return Tokenizer.from_dir(build_tiny_tokenizer(tmp_path_factory.mktemp("tok")))


def _serve(tokenizer: Tokenizer, text: str, retire: RetireReason, stream: bool) -> OutputProcessor:
    """Feed ``text``'s tokens (one event each when ``stream``, else one event) and retire the choice."""
    params = SamplingParams(temperature=0.0, logprobs=True)
    eos = frozenset(tokenizer.eos_token_ids)
    choice = OutputProcessor(0, tokenizer, params, eos, dialect=QwenXmlDialect(), tools=[TOOL])
    ids = tokenizer.encode(text)
    samples = [SampleResult(t, logprob=-0.5 - k) for k, t in enumerate(ids)]
    groups = [[k] for k in range(len(ids))] if stream else [list(range(len(ids)))]
    for g in groups:
        choice.feed(SeqEvent(tokens=[ids[k] for k in g], samples=[samples[k] for k in g]))
    choice.feed(SeqEvent(tokens=[], samples=[], retired=retire))
    return choice


@pytest.mark.parametrize("stream", [True, False])
def test_successful_call_tokens_have_no_logprobs(tokenizer, stream) -> None:
    call = QwenXmlDialect().format_calls([("get_weather", {"city": "Paris"})])
    choice = _serve(tokenizer, "Let me check." + call, RetireReason.EOS, stream)
    assert choice.tool_calls and choice.content == "Let me check."
    assert "".join(e["token"] for e in choice.logprobs) == "Let me check."


@pytest.mark.parametrize("stream", [True, False])
def test_a_block_that_is_not_a_call_keeps_its_logprobs_in_order(tokenizer, stream) -> None:
    text = "Try <tool_call>\n<function=unknown_tool>\n</function>\n</tool_call> then."
    choice = _serve(tokenizer, text, RetireReason.EOS, stream)
    assert not choice.tool_calls and choice.content == text
    assert "".join(e["token"] for e in choice.logprobs) == text
    ids = tokenizer.encode(text)
    assert [e["logprob"] for e in choice.logprobs] == [-0.5 - k for k in range(len(ids))]


def test_a_call_cut_off_by_length_flushes_as_content_with_its_logprobs(tokenizer) -> None:
    text = "Checking <tool_call>\n<function=get_weather>\n<parameter=ci"
    choice = _serve(tokenizer, text, RetireReason.LENGTH, stream=True)
    assert not choice.tool_calls and choice.content == text
    assert "".join(e["token"] for e in choice.logprobs) == text
