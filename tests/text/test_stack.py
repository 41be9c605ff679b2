"""TextStack: a checkpoint directory + family -> render, constrain, parse; /v1/models info."""

from __future__ import annotations

import json
import shutil

from conversations import WEATHER_TOOL

from dgpp.plugins import build_manager
from dgpp.text import TextStack


def test_qwen_family_stack_from_a_checkpoint_without_template(tiny_dir, tmp_path):
    for name in ("tokenizer.json", "generation_config.json"):
        shutil.copyfile(tiny_dir / name, tmp_path / name)
    cfg = json.loads((tiny_dir / "tokenizer_config.json").read_text())
    cfg.pop("chat_template")  # the plugin's fallback template must be used
    (tmp_path / "tokenizer_config.json").write_text(json.dumps(cfg))
    stack = TextStack.from_checkpoint(
        tmp_path, "qwen", {"model_type": "qwen3_5", "vocab_size": 512}, build_manager()
    )
    prompt = stack.render(
        [{"role": "user", "content": "weather in Paris?"}], [WEATHER_TOOL], reasoning_effort="high"
    )
    assert "Reasoning effort: xhigh" in prompt.text and prompt.token_ids == stack.tokenizer.encode(
        prompt.text
    )
    assert (
        "<tools>"
        not in stack.render([{"role": "user", "content": "x"}], [WEATHER_TOOL], tool_choice="none").text
    )
    assert stack.matcher(prompt, tools=[WEATHER_TOOL], tool_choice="auto") is None
    matcher = stack.matcher(prompt, tools=[WEATHER_TOOL], tool_choice="required")
    out = stack.choice_output(prompt, tools=[WEATHER_TOOL], request_tag=1)
    text = "ok</think>\n\n" + stack.dialect.format_calls([("get_weather", {"city": "Paris"})])
    for tid in stack.tokenizer.encode(text):
        assert matcher.accept(tid)
        out.push(tid)
    out.finish()
    assert out.finish_reason("stop") == "tool_calls" and out.message()["reasoning_content"] == "ok"
    info = stack.model_info()
    assert info["reasoning"]["effort_mapping"]["none"] == {"enable_thinking": False}
    assert info["tools"] == {"available": True, "constrained": True}
