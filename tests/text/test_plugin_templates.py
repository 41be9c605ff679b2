"""The chat templates the plugins ship render exactly as transformers renders them, and their tool calls
round-trip through the family's dialect."""

from __future__ import annotations

import json

import pytest
from conversations import CONVERSATIONS, TIME_TOOL, WEATHER_TOOL

from dgpp.text.chat_template import ChatTemplate, prepare_messages
from dgpp.text.tools import tool_specs
from dgpp_deepseek import dialect as deepseek
from dgpp_flint import dialect as flint
from dgpp_glm import dialect as glm
from dgpp_mimo import dialect as mimo
from dgpp_qwen import dialect as qwen

# family -> (template text, dialect, tokenizer fixture whose specials the template is rendered with)
FAMILIES = {
    "qwen": (qwen.chat_template(), qwen.dialect_for({}), "qwen35"),
    "glm": (glm.chat_template(), glm.dialect_for({}), "tiny"),
    "mimo": (mimo.chat_template(), mimo.dialect_for({}), "tiny"),
    "flint": (flint.chat_template(), flint.dialect_for({}), "tiny"),
    "deepseek_v4": (
        deepseek.chat_template({"model_type": "deepseek_v4"}),
        deepseek.dialect_for({"model_type": "deepseek_v4"}),
        "deepseek_v4",
    ),
    "deepseek_v41": (
        deepseek.chat_template({"model_type": "deepseek_v41"}),
        deepseek.dialect_for({"model_type": "deepseek_v41"}),
        "deepseek_v4",
    ),
}
_hf: dict = {}


def hf_tokenizer(request, which):
    from transformers import AutoTokenizer

    from dgpp.testing import tokenizers as fixtures

    if which not in _hf:
        path = {
            "tiny": lambda: request.getfixturevalue("tiny_dir"),
            "qwen35": fixtures.qwen35_tokenizer_dir,
            "deepseek_v4": fixtures.deepseek_v4_tokenizer_dir,
        }[which]()
        request.getfixturevalue(
            "tiny_tokenizer" if which == "tiny" else which
        )  # skips when the registry is down
        _hf[which] = AutoTokenizer.from_pretrained(str(path))
    return _hf[which]


@pytest.mark.parametrize("family", sorted(FAMILIES))
@pytest.mark.parametrize("name", sorted(CONVERSATIONS))
@pytest.mark.parametrize("thinking", [None, True, False])
def test_plugin_template_matches_transformers(request, family, name, thinking):
    source, dialect, which = FAMILIES[family]
    hf = hf_tokenizer(request, which)
    ct = ChatTemplate(source, hf.special_tokens_map, effort=dialect.effort)
    switch = "thinking" if family.startswith("deepseek") else "enable_thinking"
    kwargs = {} if thinking is None else {switch: thinking}
    messages, tools = CONVERSATIONS[name]
    ours = ct.render(messages, tools, chat_template_kwargs=kwargs or None)
    theirs = hf.apply_chat_template(
        prepare_messages(messages),
        tools=tools,
        chat_template=source,
        tokenize=False,
        add_generation_prompt=True,
        **kwargs,
    )
    assert ours == theirs
    if family == "mimo":  # MiMo's model opens <think> itself; thinking off (its default) closes an empty one
        assert ours.endswith("<|im_start|>assistant\n<think></think>") == (thinking is not True)
        assert ours.endswith("<|im_start|>assistant\n") == (thinking is True)
    elif family != "glm":  # GLM's generation prompt lets the model open <think> itself
        assert ours.rstrip().endswith("<think>") == (thinking is not False)


@pytest.mark.parametrize("family", sorted(FAMILIES))
def test_rendered_tool_calls_parse_back(family):
    source, dialect, _ = FAMILIES[family]
    ct = ChatTemplate(source, {"bos_token": "<s>"})
    messages, tools = CONVERSATIONS["tools_pending_result"]
    calls = [("get_weather", {"city": "Paris", "days": 4}), ("get_time", {})]
    history = [
        messages[0],
        {
            "role": "assistant",
            "content": None,
            "tool_calls": [
                {"id": f"c{i}", "type": "function", "function": {"name": n, "arguments": json.dumps(a)}}
                for i, (n, a) in enumerate(calls)
            ],
        },
    ]
    before = ct.render(history[:1], tools, add_generation_prompt=True)
    full = ct.render(history, tools, add_generation_prompt=False)
    # the assistant turn as the model would have written it: what follows the generation prompt's role header
    header = {
        "qwen": "<|im_start|>assistant\n",
        "mimo": "<|im_start|>assistant\n",
        "flint": "<|im_start|>assistant\n",
        "glm": "<|assistant|>",
        "deepseek_v4": "<｜Assistant｜>",
        "deepseek_v41": "<｜Assistant｜>",
    }[family]
    turn = full[full.rindex(header) + len(header) :]
    parsed = dialect.parse(turn.split("</think>")[-1], tool_specs([WEATHER_TOOL, TIME_TOOL]))
    assert [(c.name, json.loads(c.arguments)) for c in parsed.tool_calls] == calls
    assert before.startswith(full[: len(before) - 20])


@pytest.mark.parametrize("family", ["qwen", "glm", "deepseek_v41"])
def test_effort_reaches_the_template(family):
    source, dialect, _ = FAMILIES[family]
    ct = ChatTemplate(source, {"bos_token": "<s>"}, effort=dialect.effort)
    user = [{"role": "user", "content": "hi"}]
    high = ct.render(user, reasoning_effort="high")
    expected = {"qwen": "xhigh", "glm": "high", "deepseek_v41": "75"}[family]
    assert f"Reasoning effort: {expected}" in high
    off = ct.render(user, reasoning_effort="none")
    assert "Reasoning effort" not in off and not off.rstrip().endswith("<think>")
