"""Chat templates render exactly what transformers' apply_chat_template renders; errors name the field."""

from __future__ import annotations

import pytest
from conversations import CONVERSATIONS

from dgpp.text.chat_template import ChatTemplate, prepare_messages
from dgpp.text.effort import EffortMapping
from dgpp.text.errors import TemplateError


def hf_render(tok_dir, template, messages, tools, **kwargs):
    """transformers' rendering of the same (normalized) conversation."""
    from transformers import AutoTokenizer

    hf = _hf_cache.get(str(tok_dir))
    if hf is None:
        hf = _hf_cache[str(tok_dir)] = AutoTokenizer.from_pretrained(str(tok_dir))
    return hf.apply_chat_template(
        messages, tools=tools, chat_template=template, tokenize=False, add_generation_prompt=True, **kwargs
    )


_hf_cache: dict = {}


def assert_same_as_hf(ct: ChatTemplate, tok_dir, name: str, **kwargs):
    messages, tools = CONVERSATIONS[name]
    source = ct.source(bool(tools))
    ours = ct.render(messages, tools, chat_template_kwargs=kwargs or None)
    dict_args = "arguments|items" in source.replace(" ", "") or "arguments|tojson" in source.replace(" ", "")
    theirs = hf_render(
        tok_dir, source, prepare_messages(messages, arguments_as_dict=dict_args), tools, **kwargs
    )
    assert ours == theirs
    return ours


@pytest.mark.parametrize("name", sorted(CONVERSATIONS))
def test_deepseek_v3_template_matches_transformers(deepseek_v3, name):
    from dgpp.testing.tokenizers import deepseek_v3_tokenizer_dir

    ct = ChatTemplate.for_checkpoint(deepseek_v3)
    out = assert_same_as_hf(ct, deepseek_v3_tokenizer_dir(), name)
    assert out.startswith("<｜begin▁of▁sentence｜>")


@pytest.mark.parametrize("name", sorted(CONVERSATIONS))
@pytest.mark.parametrize("thinking", [None, True, False])
def test_tiny_template_matches_transformers(tiny_tokenizer, tiny_dir, name, thinking):
    ct = ChatTemplate.for_checkpoint(tiny_tokenizer)
    kwargs = {} if thinking is None else {"enable_thinking": thinking}
    out = assert_same_as_hf(ct, tiny_dir, name, **kwargs)
    assert out.endswith("<think>\n\n</think>\n\n" if thinking is False else "<think>\n")


def test_developer_role_and_parts_are_normalized():
    msgs = prepare_messages(CONVERSATIONS["multi_turn"][0])
    assert msgs[0]["role"] == "system" and msgs[-1]["content"] == "Another\none?"
    think = prepare_messages(CONVERSATIONS["thinking_history"][0])
    assert think[-1] == {"role": "assistant", "content": "10", "reasoning_content": "5*2=10"}
    calls = prepare_messages(CONVERSATIONS["tools"][0])[2]
    assert calls["content"] == "" and calls["tool_calls"][0]["function"]["arguments"] == {
        "city": "Paris",
        "days": 2,
    }


def test_template_failure_is_a_messages_error(tiny_tokenizer):
    ct = ChatTemplate("{{ raise_exception('only user turns') }}", tiny_tokenizer.special_tokens_map)
    with pytest.raises(TemplateError, match="only user turns") as err:
        ct.render([{"role": "user", "content": "x"}])
    assert err.value.param == "messages"
    with pytest.raises(TemplateError, match="empty prompt"):
        ChatTemplate("{% if false %}x{% endif %}").render([{"role": "user", "content": "x"}])
    with pytest.raises(TemplateError, match="does not compile"):
        ChatTemplate("{% for %}")


def test_unknown_template_kwarg_is_named(tiny_tokenizer):
    ct = ChatTemplate.for_checkpoint(tiny_tokenizer)
    with pytest.raises(TemplateError) as err:
        ct.render([{"role": "user", "content": "x"}], chat_template_kwargs={"enable_thinkin": False})
    assert err.value.param == "chat_template_kwargs.enable_thinkin"


def test_sandbox_blocks_internals(tiny_tokenizer):
    ct = ChatTemplate("{{ messages.__class__.__mro__ }}{% set ns = namespace(_x=1) %}")
    with pytest.raises(TemplateError):
        ct.render([{"role": "user", "content": "x"}])


def test_hf_helpers_behave_like_transformers():
    src = "{{ {'b': 'é<>'} | tojson }}|{{ strftime_now('%Y') | length }}|{% for x in [1,2,3] %}{% if x == 2 %}{% break %}{% endif %}{{ x }}{% endfor %}{% generation %}g{% endgeneration %}"
    assert ChatTemplate(src).render([{"role": "user", "content": "x"}]) == '{"b": "é<>"}|4|1g'


def test_named_templates_pick_tool_use():
    ct = ChatTemplate(
        [
            {"name": "default", "template": "plain"},
            {"name": "tool_use", "template": "tools:{{ tools|length }}"},
        ]
    )
    assert ct.render([{"role": "user", "content": "x"}]) == "plain"
    assert ct.render([{"role": "user", "content": "x"}], CONVERSATIONS["tools"][1]) == "tools:2"


def test_reasoning_effort_mapping(tiny_tokenizer):
    qwen_like = EffortMapping(
        {
            "minimal": "low",
            "low": "low",
            "medium": "medium",
            "high": "xhigh",
            "xhigh": "xhigh",
            "max": "xhigh",
        }
    )
    src = "{{ enable_thinking }}/{{ reasoning_effort | default('-') }}"
    ct = ChatTemplate(src, effort=qwen_like)
    user = [{"role": "user", "content": "x"}]
    assert ct.render(user, reasoning_effort="none") == "False/-"
    assert ct.render(user, reasoning_effort="high") == "True/xhigh"
    assert ct.render(user, reasoning_effort="minimal") == "True/low"
    # the request's own switch wins over the effort's (the original engine's API check sends both)
    assert (
        ct.render(user, reasoning_effort="low", chat_template_kwargs={"enable_thinking": False}) == "False/-"
    )
    assert (
        ct.render(user, reasoning_effort="none", chat_template_kwargs={"enable_thinking": True}) == "True/-"
    )
    with pytest.raises(TemplateError):
        ChatTemplate("{{ messages[0].content }}").render(user, reasoning_effort="none")
    assert ChatTemplate("{{ messages[0].content }}").render(user, reasoning_effort="high") == "x"
    assert ct.effort_mapping()["medium"] == {"enable_thinking": True, "reasoning_effort": "medium"}


@pytest.mark.parametrize(
    "bad,where",
    [
        ({"role": "user"}, "messages[0].content"),
        ({"role": "user", "content": None}, "messages[0].content"),
        ({"role": "tool", "content": "x"}, "messages[0].tool_call_id"),
        ({"role": "wizard", "content": "x"}, "messages[0].role"),
    ],
)
def test_invalid_messages_are_named(bad, where):
    with pytest.raises(TemplateError, match=where.replace("[", r"\[").replace("]", r"\]")) as err:
        prepare_messages([bad])
    assert err.value.param == "messages"
