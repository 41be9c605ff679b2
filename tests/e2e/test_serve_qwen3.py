"""End to end: ``dgpp serve`` on a tiny Qwen3 checkpoint, driven through the openai SDK over loopback."""

from __future__ import annotations

import threading
import time

import httpx
import openai
import pytest
from serve_fixture import Server, tiny_checkpoint

from dgpp.offline import greedy_generate
from dgpp.startup.loading import load_model
from dgpp.text.chat_template import ChatTemplate
from dgpp.text.tokenizer import Tokenizer

pytestmark = pytest.mark.e2e
ENGINE = {
    "max_concurrency": 8,
    "kv_capacity": 8192,
    "block_size": 4,
    "prefill_budget_tokens": 16,
    "prefix_min_tokens": 0,
    "default_max_tokens": 16,
    "queue_limit": 64,
    "stats_interval_s": 1,
}
NO_THINK = {"enable_thinking": False}
SYSTEM = "You are a helpful assistant. Think step by step, then answer the question briefly. " * 2
PROMPTS = [
    "Hello world! What is the weather in Paris today?",
    "def add(a, b):",
    "The quick brown fox",
    "你好，世界。",
]


@pytest.fixture(scope="module")
def env(tmp_path_factory):
    root = tmp_path_factory.mktemp("qwen3")
    ckpt = tiny_checkpoint("qwen3", root)
    server = Server(ckpt, root, ENGINE, http={"max_body_bytes": 50000, "sse_ping_interval": 1})
    try:
        server.wait_ready()
        tok = Tokenizer.from_dir(ckpt)
        yield {
            "server": server,
            "ckpt": ckpt,
            "tok": tok,
            "template": ChatTemplate.for_checkpoint(tok),
            "sdk": openai.OpenAI(base_url=server.url + "/v1", api_key="none", max_retries=0),
            "model": str(ckpt),
        }
    finally:
        server.stop()


def chat(env, content: str, **kw):
    messages = kw.pop("messages", [{"role": "user", "content": content}])
    # DGPP extensions go through extra_body; thinking is off unless asked (the tiny template opens <think>)
    extra = {"chat_template_kwargs": {"enable_thinking": kw.pop("thinking", False)}}
    if "ignore_eos" in kw:
        extra["ignore_eos"] = kw.pop("ignore_eos")
    kw["extra_body"] = {**extra, **kw.get("extra_body", {})}
    return env["sdk"].chat.completions.create(model=env["model"], messages=messages, **kw)


def token_bytes(env, ids: list[int]) -> bytes:
    table = env["tok"].token_bytes
    # ids past the tokenizer (the model's padded vocabulary) have no text
    return b"".join(table[t] for t in ids if t < len(table) and t not in env["tok"].eos_token_ids)


def test_greedy_equals_the_runner(env) -> None:
    model = load_model(env["ckpt"])
    n = 20
    for text in PROMPTS[:2]:
        messages = [{"role": "user", "content": text}]
        ids = env["tok"].encode(env["template"].render(messages, chat_template_kwargs=NO_THINK))
        want = greedy_generate(model, [ids], n, stop_at_eos=False)[0]
        got = chat(env, text, max_tokens=n, temperature=0, ignore_eos=True, logprobs=True)
        entries = got.choices[0].logprobs.content
        assert b"".join(bytes(e.bytes) for e in entries) == token_bytes(env, want)
        assert got.choices[0].message.content == env["tok"].decode(want, skip_special_tokens=True)
        legacy = env["sdk"].completions.create(
            model=env["model"], prompt=text, max_tokens=n, temperature=0, extra_body={"ignore_eos": True}
        )
        want_legacy = greedy_generate(model, [env["tok"].encode(text)], n, stop_at_eos=False)[0]
        assert legacy.choices[0].text == env["tok"].decode(want_legacy, skip_special_tokens=True)
        streamed = env["sdk"].completions.create(
            model=env["model"],
            prompt=text,
            max_tokens=n,
            temperature=0,
            stream=True,
            extra_body={"ignore_eos": True},
        )
        assert "".join(c.choices[0].text for c in streamed if c.choices) == legacy.choices[0].text


def test_seeded_n3_is_reproducible(env) -> None:
    a = chat(env, PROMPTS[2], n=3, seed=7, temperature=0.9, max_tokens=10, ignore_eos=True)
    b = chat(env, PROMPTS[2], n=3, seed=7, temperature=0.9, max_tokens=10, ignore_eos=True)
    texts = [c.message.content for c in a.choices]
    assert texts == [c.message.content for c in b.choices]
    assert len(set(texts)) > 1 and a.usage.completion_tokens == 30


def test_stop_strings_cut_exactly(env) -> None:
    full = chat(env, PROMPTS[0], temperature=0, max_tokens=24, ignore_eos=True, logprobs=True)
    text = full.choices[0].message.content
    pieces = [bytes(e.bytes) for e in full.choices[0].logprobs.content]
    # a stop string made of the last character of one token and the first of the next: it spans a boundary
    at, stop = 0, None
    for i in range(len(pieces) - 1):
        at += len(pieces[i].decode("utf-8", "replace"))
        left, right = pieces[i].decode("utf-8", "ignore"), pieces[i + 1].decode("utf-8", "ignore")
        if (
            at > 1
            and left
            and right
            and text[at - 1 : at + 1] == left[-1] + right[0]
            and text.find(left[-1] + right[0]) == at - 1
        ):
            stop = left[-1] + right[0]
            break
    assert stop is not None, "no token boundary to test in this output"
    cut = text[: at - 1]
    one = chat(env, PROMPTS[0], temperature=0, max_tokens=24, ignore_eos=True, stop=[stop])
    assert one.choices[0].message.content == cut and one.choices[0].finish_reason == "stop"
    assert one.usage.completion_tokens == i + 2  # counted up to the token that completed the match
    stream = chat(
        env,
        PROMPTS[0],
        temperature=0,
        max_tokens=24,
        ignore_eos=True,
        stop=stop,
        stream=True,
        stream_options={"include_usage": True},
    )
    chunks = list(stream)
    assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices) == cut
    assert chunks[-1].usage.completion_tokens == one.usage.completion_tokens < 24


def test_logit_bias_forces_and_forbids(env) -> None:
    tid = env["tok"].encode(" fox")[0]
    forced = chat(env, PROMPTS[1], max_tokens=3, temperature=0.7, seed=1, logit_bias={str(tid): 100})
    assert forced.choices[0].message.content == env["tok"].decode([tid] * 3)
    greedy = chat(env, PROMPTS[1], max_tokens=1, temperature=0, logprobs=True, ignore_eos=True)
    first = bytes(greedy.choices[0].logprobs.content[0].bytes)
    first_id = env["tok"].token_bytes.index(first)
    banned = chat(
        env,
        PROMPTS[1],
        max_tokens=1,
        temperature=0,
        logprobs=True,
        ignore_eos=True,
        logit_bias={str(first_id): -100},
    )
    assert bytes(banned.choices[0].logprobs.content[0].bytes) != first


def _stream_text(env, i: int) -> str:
    kw = {"temperature": 0.0} if i % 2 == 0 else {"temperature": 0.8, "seed": i % 8}
    stream = chat(env, PROMPTS[i % len(PROMPTS)], max_tokens=12, ignore_eos=True, stream=True, **kw)
    return "".join(c.choices[0].delta.content or "" for c in stream if c.choices)


def test_32_concurrent_streams_match_solo_runs(env) -> None:
    solo = {i: _stream_text(env, i) for i in range(8)}  # requests i and i+8k are identical
    results: dict[int, str] = {}
    errors: list[BaseException] = []

    def client(i: int) -> None:
        try:
            results[i] = _stream_text(env, i)
        except BaseException as e:  # noqa: BLE001 - reported below
            errors.append(e)

    threads = [threading.Thread(target=client, args=(i,)) for i in range(32)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(120)
    assert not errors and len(results) == 32
    assert all(results[i] == solo[i % 8] for i in range(32))


def test_prefix_cache_hit_equals_cold(env) -> None:
    messages = [{"role": "system", "content": SYSTEM}, {"role": "user", "content": PROMPTS[0]}]
    cold = chat(
        env,
        "",
        messages=messages,
        temperature=0,
        max_tokens=12,
        ignore_eos=True,
        extra_body={"prefix_cache": False},
    )
    warm = chat(env, "", messages=messages, temperature=0, max_tokens=12, ignore_eos=True)
    hit = chat(env, "", messages=messages, temperature=0, max_tokens=12, ignore_eos=True)
    assert (
        cold.choices[0].message.content == warm.choices[0].message.content == hit.choices[0].message.content
    )
    assert cold.usage.prompt_tokens_details.cached_tokens == 0
    assert hit.usage.prompt_tokens_details.cached_tokens >= 16


def test_error_shapes(env) -> None:
    url = env["server"].url
    body = {"model": env["model"], "messages": [{"role": "user", "content": "hi"}]}
    cases = [
        ({**body, "top_p": 1.5}, 400, "invalid_parameter"),
        ({**body, "model": "nope"}, 404, "model_not_found"),
        ({**body, "web_search_options": {}}, 400, "unsupported_parameter"),
        ({**body, "max_tokens": 100000}, 400, "context_length_exceeded"),
        ({**body, "messages": [{"role": "user", "content": "x" * 60000}]}, 413, "request_too_large"),
    ]
    for payload, status, code in cases:
        r = httpx.post(url + "/v1/chat/completions", json=payload)
        assert r.status_code == status and r.json()["error"]["code"] == code, r.text
        assert set(r.json()["error"]) == {"message", "type", "param", "code"}


def _metrics(env) -> dict:
    return httpx.get(env["server"].url + "/metrics").json()


def test_disconnect_frees_the_slot_and_server_keeps_serving(env) -> None:
    before = _metrics(env)["service"]["requests_cancelled"]
    body = {
        "model": env["model"],
        "messages": [{"role": "user", "content": "hi"}],
        "max_tokens": 400,
        "ignore_eos": True,
        "stream": True,
    }
    with httpx.stream("POST", env["server"].url + "/v1/chat/completions", json=body) as r:
        lines = r.iter_lines()
        got = [next(lines) for _ in range(3)]
        assert got[0].startswith("data: ")
    deadline = time.monotonic() + 20
    while time.monotonic() < deadline:
        m = _metrics(env)
        if m["scheduler"]["active"] == 0 and m["service"]["requests_cancelled"] > before:
            break
        time.sleep(0.1)
    assert m["scheduler"]["active"] == 0 and m["service"]["requests_cancelled"] == before + 1
    assert chat(env, "hi", max_tokens=2).choices[0].finish_reason in ("length", "stop")
    # a one-shot request whose client gives up is cancelled too
    one_shot = {**body, "stream": False}
    with pytest.raises(httpx.TimeoutException):
        httpx.post(env["server"].url + "/v1/chat/completions", json=one_shot, timeout=0.3)
    deadline = time.monotonic() + 20
    while time.monotonic() < deadline:
        m = _metrics(env)
        if m["scheduler"]["active"] == 0 and m["service"]["requests_cancelled"] == before + 2:
            break
        time.sleep(0.1)
    assert m["scheduler"]["active"] == 0 and m["service"]["requests_cancelled"] == before + 2
    prom = httpx.get(env["server"].url + "/metrics/prometheus").text
    assert 'reason="cancelled"' in prom and "dgpp_kv_pool_blocks_in_use" in prom
    deadline = (
        time.monotonic() + 5
    )  # the periodic stats line (engine.stats_interval_s = 1) follows busy seconds
    while "stats: decode" not in env["server"].log.read_text() and time.monotonic() < deadline:
        time.sleep(0.2)
    assert "stats: decode" in env["server"].log.read_text()


WEATHER_TOOL = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "weather for a city",
        "parameters": {
            "type": "object",
            "properties": {"city": {"type": "string", "enum": ["Paris", "Rome"]}},
            "required": ["city"],
        },
    },
}


def test_json_schema_and_forced_tool_call(env) -> None:
    import json

    schema = {
        "type": "object",
        "properties": {"unit": {"enum": ["celsius", "fahrenheit"]}},
        "required": ["unit"],
        "additionalProperties": False,
    }
    r = chat(
        env,
        PROMPTS[0],
        max_tokens=40,
        temperature=0.7,
        seed=5,
        response_format={
            "type": "json_schema",
            "json_schema": {"name": "u", "schema": schema, "strict": True},
        },
    )
    assert json.loads(r.choices[0].message.content)["unit"] in ("celsius", "fahrenheit")
    assert r.choices[0].finish_reason == "stop"
    forced = chat(env, PROMPTS[0], max_tokens=60, temperature=0, tools=[WEATHER_TOOL], tool_choice="required")
    choice = forced.choices[0]
    assert choice.finish_reason == "tool_calls" and choice.message.content is None
    call = choice.message.tool_calls[0]
    assert call.function.name == "get_weather" and json.loads(call.function.arguments)["city"] in (
        "Paris",
        "Rome",
    )
    assert call.id.startswith("call_") and len(call.id) == 21
    chunks = list(
        chat(
            env,
            PROMPTS[0],
            max_tokens=60,
            temperature=0,
            tools=[WEATHER_TOOL],
            tool_choice="required",
            stream=True,
        )
    )
    deltas = [c.choices[0].delta.tool_calls for c in chunks if c.choices and c.choices[0].delta.tool_calls]
    assert len(deltas) == 2 and deltas[0][0].function.name == "get_weather"
    assert deltas[1][0].function.arguments == call.function.arguments
    assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == "tool_calls"
    assert httpx.get(env["server"].url + "/metrics").json()["service"]["tool_calls_out"] >= 2
    bad = httpx.post(
        env["server"].url + "/v1/chat/completions",
        json={
            "model": env["model"],
            "messages": [{"role": "user", "content": "x"}],
            "tools": [WEATHER_TOOL],
            "tool_choice": {"type": "function", "function": {"name": "nope"}},
        },
    )
    assert bad.status_code == 400 and bad.json()["error"]["code"] == "invalid_grammar"


def test_reasoning_is_split_from_content(env) -> None:
    r = chat(env, PROMPTS[0], max_tokens=8, temperature=0, thinking=True, ignore_eos=True)
    assert r.choices[0].message.content == ""  # the tiny model never closes </think> this early
    assert len(r.choices[0].message.model_extra["reasoning_content"]) > 0
    assert r.usage.completion_tokens_details.reasoning_tokens == 8
