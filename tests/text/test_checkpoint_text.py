"""A checkpoint without a template takes its family plugin's: render -> constrain -> parse, end to end."""

from __future__ import annotations

import json
import shutil

from conversations import WEATHER_TOOL

from dgpp.plugins import build_manager
from dgpp.sample.params import SamplingParams
from dgpp.sample.sampler import SampleResult
from dgpp.sched.request import RetireReason, SeqEvent
from dgpp.serve.output_processor import OutputProcessor, prompt_opens_thinking
from dgpp.text import ChatTemplate, GrammarContext, Tokenizer, build_matcher


def test_qwen_checkpoint_without_template_uses_the_plugin(tiny_dir, tmp_path):
    for name in ("tokenizer.json", "generation_config.json"):
        shutil.copyfile(tiny_dir / name, tmp_path / name)
    cfg = json.loads((tiny_dir / "tokenizer_config.json").read_text())
    cfg.pop("chat_template")
    (tmp_path / "tokenizer_config.json").write_text(json.dumps(cfg))
    pm, hf_config = build_manager(), {"model_type": "qwen3_5", "vocab_size": 512}
    tokenizer = Tokenizer.from_dir(tmp_path)
    dialect = pm.hook.dgpp_tool_dialect(family="qwen", hf_config=hf_config)
    template = ChatTemplate.for_checkpoint(tokenizer, "qwen", hf_config, pm, effort=dialect.effort)
    prompt = template.render(
        [{"role": "user", "content": "weather in Paris?"}], [WEATHER_TOOL], reasoning_effort="high"
    )
    assert "Reasoning effort: xhigh" in prompt and "<tools>" in prompt
    assert template.effort_mapping()["none"] == {"enable_thinking": False}
    opens = prompt_opens_thinking(prompt, dialect.think_start)
    matcher = build_matcher(
        GrammarContext(tokenizer, 512),
        tools=[WEATHER_TOOL],
        tool_choice="required",
        dialect=dialect,
        prompt_opens_thinking=opens,
    )
    eos = frozenset(tokenizer.eos_token_ids)
    out = OutputProcessor(
        0,
        tokenizer,
        SamplingParams(),
        eos,
        prompt=prompt,
        dialect=dialect,
        tools=[WEATHER_TOOL],
        request_tag="r1/0",
    )
    text = "ok</think>\n\n" + dialect.format_calls([("get_weather", {"city": "Paris"})])
    for tid in tokenizer.encode(text):
        assert matcher.accept(tid)
        out.feed(SeqEvent(tokens=[tid], samples=[SampleResult(tid)]))
    out.feed(SeqEvent(tokens=[], samples=[], retired=RetireReason.EOS))
    assert out.finish_reason == "tool_calls" and out.message()["reasoning_content"] == "ok"
