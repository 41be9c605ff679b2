"""End to end: ``dgpp serve`` on a tiny MiMo-V2-Flash checkpoint (window 8, far shorter than the prompts) through the
openai SDK. Chunked prefill under a token budget, concurrent requests, and a prefix-cache hit (the sliding layers'
rings restored from a state snapshot, the full layers' pages shared) all return exactly the runner's greedy
tokens. A checkpoint without a chat template is served with MiMo's own, and its tool calls come back parsed."""

from __future__ import annotations

import json

import pytest
from served_greedy import WEATHER_QUESTION, WEATHER_TOOL, check_family_serves, served

from dgpp.text.chat_template import ChatTemplate
from dgpp.text.tokenizer import Tokenizer
from dgpp_mimo import dialect as mimo_dialect
from dgpp_mimo.testing import build_tiny_mimo

pytestmark = pytest.mark.e2e
WINDOW = 8


def test_served_greedy_equals_the_runner_cold_hit_and_concurrent(tmp_path) -> None:
    ckpt = build_tiny_mimo(tmp_path / "ckpt", seed=21, vocab_size=512, sliding_window=WINDOW)
    check_family_serves(ckpt, tmp_path, min_prompt_tokens=4 * WINDOW)  # the window slides inside the prompt


@pytest.fixture(scope="module")
def own_template(tmp_path_factory):
    """A checkpoint whose tokenizer ships no chat template: the server renders with the MiMo plugin's."""
    root = tmp_path_factory.mktemp("mimo_template")
    ckpt = build_tiny_mimo(
        root / "ckpt", seed=22, vocab_size=512, sliding_window=WINDOW, max_position_embeddings=2048
    )
    with served(ckpt, root, chat_template=False) as (_, sdk):
        yield ckpt, sdk


def test_mimo_template_and_tool_calls_through_the_server(own_template) -> None:
    """The prompt is MiMo's (its token count is the plugin template's rendering), and a required call is written in
    MiMo's layout, parsed back into an OpenAI tool call, streamed as the same call."""
    ckpt, sdk = own_template
    tok = Tokenizer.from_dir(ckpt)
    assert tok.chat_template is None
    prompt = ChatTemplate(mimo_dialect.chat_template(), tok.special_tokens_map).render(
        WEATHER_QUESTION, [WEATHER_TOOL]
    )
    assert "<tools>" in prompt and prompt.endswith("<|im_start|>assistant\n<think></think>")

    def ask(**extra):
        return sdk.chat.completions.create(
            model=str(ckpt),
            messages=WEATHER_QUESTION,
            tools=[WEATHER_TOOL],
            max_tokens=200,
            temperature=0,
            tool_choice="required",
            parallel_tool_calls=False,
            **extra,
        )

    forced = ask()
    assert forced.usage.prompt_tokens == len(tok.encode(prompt))
    choice = forced.choices[0]
    assert choice.finish_reason == "tool_calls" and choice.message.content is None
    call = choice.message.tool_calls[0]
    args = json.loads(call.function.arguments)
    assert (
        call.function.name == "get_weather" and args["city"] in ("Paris", "Rome") and 1 <= args["days"] <= 3
    )
    deltas = [
        c.choices[0].delta.tool_calls for c in ask(stream=True) if c.choices and c.choices[0].delta.tool_calls
    ]
    assert (
        deltas[0][0].function.name == "get_weather"
        and deltas[1][0].function.arguments == call.function.arguments
    )
