"""End to end: ``POST /v1/responses`` text output (one shot, streamed, through the SDK's stream helper), reasoning
items and a JSON-schema text format."""

from __future__ import annotations

import json

import pytest
from responses_client import NO_THINK, QUESTION, TOOL, respond

pytestmark = pytest.mark.e2e


def test_text_one_shot_stream_and_chat_agree(env) -> None:
    """Greedy output of a Responses request equals the chat route's on the same conversation, streamed or not,
    and the stream's events come in the Responses order."""
    chat = env["sdk"].chat.completions.create(
        model=env["model"],
        messages=[{"role": "system", "content": "Be brief."}, {"role": "user", "content": QUESTION}],
        max_tokens=12,
        temperature=0,
        logprobs=True,
        top_logprobs=2,
        extra_body={"ignore_eos": True, "chat_template_kwargs": {"enable_thinking": False}},
    )
    one = respond(
        env,
        instructions="Be brief.",
        input=QUESTION,
        max_output_tokens=12,
        temperature=0,
        reasoning=NO_THINK,
        top_logprobs=2,
        extra_body={"ignore_eos": True},
    )
    assert one.object == "response" and one.id.startswith("resp_")
    assert one.output_text == chat.choices[0].message.content and one.output_text
    assert one.status == "incomplete" and one.incomplete_details.reason == "max_output_tokens"
    assert one.usage.input_tokens == chat.usage.prompt_tokens and one.usage.output_tokens == 12
    assert one.usage.total_tokens == one.usage.input_tokens + 12
    part = one.output[0].content[0]
    assert one.output[0].type == "message" and one.output[0].role == "assistant"
    want = [(e.bytes, e.logprob, [t.token for t in e.top_logprobs]) for e in chat.choices[0].logprobs.content]
    assert [(e.bytes, e.logprob, [t.token for t in e.top_logprobs]) for e in part.logprobs] == want
    assert len(want) == 12 and len(part.logprobs[0].top_logprobs) == 2
    events = list(
        respond(
            env,
            instructions="Be brief.",
            input=QUESTION,
            max_output_tokens=12,
            temperature=0,
            reasoning=NO_THINK,
            stream=True,
            extra_body={"ignore_eos": True},
        )
    )
    kinds = [e.type for e in events]
    deltas = [e for e in events if e.type == "response.output_text.delta"]
    assert kinds[:4] == [
        "response.created",
        "response.in_progress",
        "response.output_item.added",
        "response.content_part.added",
    ]
    assert kinds[4 : 4 + len(deltas)] == ["response.output_text.delta"] * len(deltas)
    assert kinds[4 + len(deltas) :] == [
        "response.output_text.done",
        "response.content_part.done",
        "response.output_item.done",
        "response.incomplete",
    ]
    assert [e.sequence_number for e in events] == list(range(len(events)))
    assert "".join(d.delta for d in deltas) == one.output_text == events[-2].item.content[0].text
    assert events[0].response.status == "in_progress" and events[-1].response.output_text == one.output_text
    assert events[-1].response.usage.output_tokens == 12


def test_reasoning_item_streamed_and_not(env) -> None:
    """With thinking on, the reasoning goes to a reasoning item (reasoning_text), as chat's reasoning_content."""
    chat = env["sdk"].chat.completions.create(
        model=env["model"],
        messages=[{"role": "user", "content": QUESTION}],
        max_tokens=8,
        temperature=0,
        extra_body={"ignore_eos": True, "chat_template_kwargs": {"enable_thinking": True}},
    )
    one = respond(
        env,
        input=QUESTION,
        max_output_tokens=8,
        temperature=0,
        reasoning={"effort": "high"},
        extra_body={"ignore_eos": True},
    )
    assert [o.type for o in one.output] == ["reasoning"]  # the tiny model does not close </think> this early
    assert one.output[0].content[0].text == chat.choices[0].message.model_extra["reasoning_content"]
    assert one.usage.output_tokens_details.reasoning_tokens == 8
    events = list(
        respond(
            env,
            input=QUESTION,
            max_output_tokens=8,
            temperature=0,
            reasoning={"effort": "high"},
            stream=True,
            extra_body={"ignore_eos": True},
        )
    )
    deltas = [e.delta for e in events if e.type == "response.reasoning_text.delta"]
    done = next(e for e in events if e.type == "response.reasoning_text.done")
    assert "".join(deltas) == done.text == one.output[0].content[0].text
    assert events[-1].response.output[0].type == "reasoning"


def _essence(item) -> tuple:
    """What an output item says (ids and call ids are fresh per response)."""
    texts = tuple(p.text for p in getattr(item, "content", None) or [])
    return (
        item.type,
        getattr(item, "name", None),
        getattr(item, "arguments", None),
        getattr(item, "input", None),
        texts,
    )


@pytest.mark.parametrize("kind", ["json_schema_text", "function_call", "custom_tool_call"])
def test_the_sdk_stream_helper_accumulates_the_same_response(env, kind) -> None:
    """``client.responses.stream`` rebuilds the response from the events alone (item by item, part by part,
    delta by delta) and needs ``response.completed``: outputs that end by EOS (a grammar's end, a forced
    call) equal the one-shot response's."""
    custom = {
        "type": "custom",
        "name": "set_city",
        "format": {"type": "grammar", "syntax": "regex", "definition": "(Paris|Rome)"},
    }
    schema = {
        "type": "object",
        "properties": {"unit": {"enum": ["celsius", "fahrenheit"]}},
        "required": ["unit"],
        "additionalProperties": False,
    }
    kw = {
        "json_schema_text": {"text": {"format": {"type": "json_schema", "name": "u", "schema": schema}}},
        "function_call": {"tools": [TOOL], "tool_choice": "required"},
        "custom_tool_call": {"tools": [custom], "tool_choice": {"type": "custom", "name": "set_city"}},
    }[kind]
    kw = {"reasoning": NO_THINK, "input": QUESTION, "temperature": 0, "max_output_tokens": 60, **kw}
    one = respond(env, **kw)
    with env["sdk"].responses.stream(model=env["model"], **kw) as stream:
        for _ in stream:
            pass
        final = stream.get_final_response()
    assert one.status == final.status == "completed"
    assert [_essence(o) for o in final.output] == [_essence(o) for o in one.output]
    assert final.output[-1].type == ("message" if kind == "json_schema_text" else kind)


def test_text_format_json_schema_constrains_the_output(env) -> None:
    schema = {
        "type": "object",
        "properties": {"unit": {"enum": ["celsius", "fahrenheit"]}},
        "required": ["unit"],
        "additionalProperties": False,
    }
    fmt = {"type": "json_schema", "name": "unit", "schema": schema, "strict": True}
    r = respond(
        env,
        input=QUESTION,
        text={"format": fmt},
        temperature=0.7,
        max_output_tokens=40,
        reasoning=NO_THINK,
        extra_body={"seed": 5},
    )
    assert r.status == "completed" and json.loads(r.output_text)["unit"] in ("celsius", "fahrenheit")
    assert r.text.format.type == "json_schema" and r.text.format.name == "unit"
