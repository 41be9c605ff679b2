"""Clients nobody on the project wrote, against a real ``dgpp serve`` child: lm-evaluation-harness'
``local-completions`` request shapes scored against transformers, raw sockets abusing the header parser, an
impossible batch, what the log keeps of refused requests, a model without a tool dialect, special tokens and
logprob text, unknown fields and non-JSON bodies.

The model is a tiny random Llama served by the example plugin (no tool-call dialect), with the tiny tokenizer
made SmolLM2-like (``<|im_start|>`` is its BOS, ``<|im_end|>`` its EOS, both special) and its EOS row of
``lm_head`` scaled 4x, so that greedy decoding picks EOS after about half of the scored texts: the items whose
generated token is EOS are the ones lm-eval scored wrong when that token's logprob entry was missing.
"""

from __future__ import annotations

import json
import socket
import threading
import time
from pathlib import Path

import httpx
import openai
import pytest
import torch
from safetensors.torch import load_file, save_file
from serve_fixture import running

from dgpp.testing.builders import build_tiny_checkpoint, load_reference
from dgpp.testing.tokenizers import build_tiny_tokenizer
from dgpp.text.tokenizer import Tokenizer

pytestmark = pytest.mark.e2e
pytest.importorskip("dgpp_llama", reason="the example plugin is installed by scripts/setup.sh")
QUEUE_LIMIT = 8
ENGINE = {
    "max_concurrency": 1,
    "kv_capacity": 4096,
    "block_size": 4,
    "prefill_budget_tokens": 16,
    "default_max_tokens": 16,
    "queue_limit": QUEUE_LIMIT,
    "stats_interval_s": 0,
}
HTTP = {"max_header_bytes": 16384, "header_timeout_s": 1.5}
# lm-eval's (context, continuation) pairs as a multiple-choice task makes them
CONTEXTS = (
    "Question: What is 20 - 18?\nAnswer:",
    "The quick brown fox",
    "Hello world! What is",
    "def add(a, b):",
    "The capital of France is",
    "What is the weather in Paris today?",
)
CONTINUATIONS = (" 2", " 5", " jumps over", " the weather", "\n    return a + b", " Paris", " café 😀")


def _smollm2_like(ckpt: Path) -> None:
    """BOS <|im_start|> and EOS <|im_end|>, as SmolLM2's tokenizer_config has them; EOS made likely."""
    config_path = ckpt / "tokenizer_config.json"
    config = json.loads(config_path.read_text())
    config["bos_token"] = "<|im_start|>"
    config_path.write_text(json.dumps(config))
    eos = Tokenizer.from_dir(ckpt).token_to_id("<|im_end|>")
    weights = load_file(ckpt / "model.safetensors")
    weights["lm_head.weight"][eos] *= 4.0
    save_file(weights, ckpt / "model.safetensors", metadata={"format": "pt"})


@pytest.fixture(scope="module")
def env(tmp_path_factory):
    root = tmp_path_factory.mktemp("clients")
    ckpt = build_tiny_checkpoint("llama", root / "llama")
    build_tiny_tokenizer(ckpt)
    _smollm2_like(ckpt)
    with running(ckpt, root, ENGINE, HTTP) as server:
        yield {
            "server": server,
            "ckpt": ckpt,
            "tok": Tokenizer.from_dir(ckpt),
            "model": str(ckpt),
            "sdk": openai.OpenAI(base_url=server.url + "/v1", api_key="none", max_retries=0),
        }


def post(env, path: str, body: dict, **kw) -> httpx.Response:
    return httpx.post(env["server"].url + path, json=body, timeout=120, **kw)


# ---- 1. lm-evaluation-harness local-completions ----------------------------------------------------------------


def lm_eval_loglikelihood_payload(model: str, prompt: list) -> dict:
    """``LocalCompletionsAPI._create_payload(generate=False)`` of lm-eval 0.4.x (0.4.13 included): the request
    it sends per batch of (context + continuation) prompts, token ids with its default ``tokenized_requests``."""
    return {
        "model": model,
        "prompt": prompt,
        "temperature": 0,
        "max_tokens": 1,
        "logprobs": 1,
        "seed": 1234,
        "echo": True,
    }


def lm_eval_parse_logprobs(out: dict, ctxlens: list[int]) -> list[tuple[float, bool]]:
    """``LocalCompletionsAPI.parse_logprobs``: the continuation is entries ``ctxlen`` to the second last; the
    last entry is taken to be the generated token's."""
    res = []
    for choice, ctxlen in zip(sorted(out["choices"], key=lambda c: c["index"]), ctxlens, strict=True):
        lps = choice["logprobs"]["token_logprobs"][ctxlen:-1]
        tops = choice["logprobs"]["top_logprobs"][ctxlen:-1]
        res.append((sum(lps), all(lp == max(top.values()) for lp, top in zip(lps, tops, strict=True))))
    return res


def test_lm_eval_loglikelihoods_equal_transformers_including_eos_items(env) -> None:
    tok, model = env["tok"], env["model"]
    eos = tok.token_to_id("<|im_end|>")
    reference = load_reference(env["ckpt"])
    items, want, generated_eos = [], [], 0
    for ctx in CONTEXTS:
        for cont in CONTINUATIONS:
            ctx_ids, cont_ids = tok.encode(ctx), tok.encode(cont)
            ids = ctx_ids + cont_ids
            with torch.no_grad():
                logp = torch.log_softmax(reference(torch.tensor([ids])).logits[0].double(), dim=-1)
            rows = range(len(ctx_ids), len(ids))
            want.append(
                (
                    sum(float(logp[i - 1, ids[i]]) for i in rows),
                    all(int(logp[i - 1].argmax()) == ids[i] for i in rows),
                )
            )
            generated_eos += int(logp[-1].argmax()) == eos
            items.append((ids, len(ctx_ids)))
    assert 5 <= generated_eos <= len(items) - 5  # both kinds of item are scored
    got = []
    for batch_size in (1, 4):  # lm-eval's --batch_size: one request carries that many prompts
        got = []
        for at in range(0, len(items), batch_size):
            batch = items[at : at + batch_size]
            r = post(
                env,
                "/v1/completions",
                lm_eval_loglikelihood_payload(model, [ids for ids, _ in batch]),
                headers={"Authorization": "Bearer unused"},
            )  # lm-eval sends its OPENAI_API_KEY
            assert r.status_code == 200, r.text
            got += lm_eval_parse_logprobs(r.json(), [ctxlen for _, ctxlen in batch])
        for (lp, greedy), (want_lp, want_greedy) in zip(got, want, strict=True):
            assert lp == pytest.approx(want_lp, abs=1e-4)
            assert greedy == want_greedy
    # tokenized_requests=False: the same texts as strings give the same numbers
    text_items = [(CONTEXTS[0] + cont, len(tok.encode(CONTEXTS[0]))) for cont in CONTINUATIONS]
    r = post(env, "/v1/completions", lm_eval_loglikelihood_payload(model, [t for t, _ in text_items]))
    assert r.status_code == 200, r.text
    by_text = lm_eval_parse_logprobs(r.json(), [c for _, c in text_items])
    assert [lp for lp, _ in by_text] == pytest.approx([lp for lp, _ in got[: len(text_items)]], abs=1e-6)
    # generate_until's shape (stop strings and a seed) is served too
    r = post(
        env,
        "/v1/completions",
        {
            "prompt": [CONTEXTS[0]],
            "model": model,
            "max_tokens": 8,
            "temperature": 0,
            "stop": ["\n\n", "Question:"],
            "seed": 1234,
        },
    )
    assert r.status_code == 200, r.text


def test_echo_logprobs_carry_the_generated_eos_entry(env) -> None:
    """The issue's reproduction: one generated token that is EOS still has its entry (OpenAI and vLLM give it)."""
    tok = env["tok"]
    eos = tok.token_to_id("<|im_end|>")
    ids = tok.encode("Question: What is 20 - 18?\nAnswer: 5")
    body = {
        "model": env["model"],
        "prompt": ids,
        "max_tokens": 1,
        "echo": True,
        "logprobs": 1,
        "logit_bias": {str(eos): 100},
    }
    choice = post(env, "/v1/completions", body).json()["choices"][0]
    assert choice["finish_reason"] == "stop"
    lp = choice["logprobs"]
    assert len(lp["tokens"]) == len(ids) + 1 and lp["token_logprobs"][-1] is not None
    assert "".join(lp["tokens"]) == choice["text"]  # the hidden EOS adds no text


# ---- 2. header size limit and deadline ---------------------------------------------------------------------------


def _rss_kib(pid: int) -> int:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1])
    raise RuntimeError("no VmRSS")


def _read_all(sock: socket.socket) -> bytes:
    data = b""
    try:
        while chunk := sock.recv(65536):
            data += chunk
    except ConnectionResetError:
        pass
    return data


def _send_header_flood(port: int, size: int) -> socket.socket:
    sock = socket.create_connection(("127.0.0.1", port), timeout=30)
    try:
        sock.sendall(b"GET /health HTTP/1.1\r\nHost: x\r\nX: " + b"a" * size)
    except (BrokenPipeError, ConnectionResetError):  # the server answered and closed early
        pass
    return sock


def test_an_oversized_header_gets_431(env) -> None:
    sock = _send_header_flood(env["server"].port, 8_000_000)
    data = _read_all(sock)
    sock.close()
    assert data.startswith(b"HTTP/1.1 431 "), data[:200]
    body = json.loads(data.partition(b"\r\n\r\n")[2])
    assert body["error"]["code"] == "request_header_fields_too_large"
    assert "http.max_header_bytes" in body["error"]["message"]
    assert httpx.get(env["server"].url + "/health", timeout=10).status_code == 200


def test_a_header_that_never_ends_is_cut_at_the_deadline(env) -> None:
    sock = socket.create_connection(("127.0.0.1", env["server"].port), timeout=30)
    sock.sendall(b"GET /health HTTP/1.1\r\nHost: x\r\nX-Slow: ")
    start = time.monotonic()
    data = b""
    try:
        while time.monotonic() - start < 20 and not data:
            try:
                sock.sendall(b"a")  # a trickle: each byte arrives well within any idle timeout
            except OSError:  # closed by the server: its answer is already here
                data = _read_all(sock)
                break
            sock.settimeout(0.2)
            try:
                data = sock.recv(65536)
            except TimeoutError:
                continue
    finally:
        sock.close()
    elapsed = time.monotonic() - start
    assert data.startswith(b"HTTP/1.1 408 "), data[:200]
    assert HTTP["header_timeout_s"] - 0.5 < elapsed < HTTP["header_timeout_s"] + 5


def test_many_unfinished_huge_headers_do_not_grow_memory(env) -> None:
    server = env["server"]
    before = _rss_kib(server.proc.pid)
    socks = [_send_header_flood(server.port, 16_000_000) for _ in range(16)]  # 256 MB of header in all
    try:
        grown_mib = (_rss_kib(server.proc.pid) - before) / 1024
        assert grown_mib < 64, f"server memory grew {grown_mib:.0f} MiB"
        assert httpx.get(server.url + "/health", timeout=10).status_code == 200
    finally:
        for s in socks:
            s.close()


# ---- 3 and 4. an impossible batch is a 400; refusals log one line without the body --------------------------------


def test_a_batch_over_the_queue_limit_is_400_and_logged_in_one_line(env) -> None:
    marker = "BODY-MARKER-7f3e"
    prompts = [f"{marker} prompt {i}" for i in range(QUEUE_LIMIT + 1)]
    with pytest.raises(openai.BadRequestError) as caught:
        env["sdk"].completions.create(
            model=env["model"],
            prompt=prompts,
            max_tokens=1,
            extra_headers={"X-Request-Id": "probe-big-batch"},
        )
    err = caught.value.body
    assert err["param"] == "prompt" and "engine.queue_limit = 8" in err["message"]
    log = env["server"].log.read_text()
    lines = [line for line in log.splitlines() if "probe-big-batch" in line]
    assert len(lines) == 1 and "request rejected" in lines[0]
    assert marker not in log


def test_overload_logs_one_line_without_traceback_or_body(env) -> None:
    server, model = env["server"], env["model"]
    marker = "BODY-MARKER-overload"
    hold = {"model": model, "prompt": ["Hello"] * QUEUE_LIMIT, "max_tokens": 400, "ignore_eos": True}
    worker = threading.Thread(target=lambda: post(env, "/v1/completions", hold))
    worker.start()
    try:
        deadline = time.monotonic() + 60
        while httpx.get(server.url + "/metrics", timeout=10).json()["scheduler"]["queued"] < QUEUE_LIMIT - 1:
            assert time.monotonic() < deadline, "the holding batch never queued"
            time.sleep(0.05)
        r = post(
            env,
            "/v1/completions",
            {"model": model, "prompt": [marker, marker], "max_tokens": 1},
            headers={"X-Request-Id": "probe-overload"},
        )
        assert r.status_code == 503 and r.headers["retry-after"] == "1"
        assert r.json()["error"]["code"] == "overloaded"
    finally:
        worker.join()
    log = server.log.read_text()
    lines = [line for line in log.splitlines() if "probe-overload" in line]
    assert len(lines) == 1 and "request shed" in lines[0]
    assert marker not in log and "Traceback" not in log


# ---- 5. a model without a tool-call dialect ---------------------------------------------------------------------

TOOL = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "parameters": {"type": "object", "properties": {"city": {"type": "string"}}},
    },
}
USER = [{"role": "user", "content": "What is the weather in Paris today?"}]


def test_tools_are_refused_where_no_dialect_can_read_calls(env) -> None:
    card = httpx.get(env["server"].url + "/v1/models", timeout=10).json()["data"][0]
    assert card["tools"] == {"available": False, "constrained": False}
    r = post(
        env,
        "/v1/chat/completions",
        {"model": env["model"], "messages": USER, "tools": [TOOL], "tool_choice": "auto", "max_tokens": 2},
    )
    assert r.status_code == 400 and r.json()["error"]["param"] == "tools"
    assert "tool-call dialect" in r.json()["error"]["message"]
    r = post(
        env,
        "/v1/chat/completions",
        {"model": env["model"], "messages": USER, "tools": [TOOL], "tool_choice": "none", "max_tokens": 2},
    )
    assert r.status_code == 200, r.text  # a client that asks for no calls gets none


# ---- 6. special tokens, logprob text, unknown fields, content types ---------------------------------------------


def test_skip_special_tokens_false_shows_bos_and_eos_tokens(env) -> None:
    tok = env["tok"]
    im_start, im_end = tok.token_to_id("<|im_start|>"), tok.token_to_id("<|im_end|>")
    assert (
        tok.bos_token_id == im_start and im_end in tok.eos_token_ids and {im_start, im_end} <= tok.special_ids
    )
    forced = {
        "model": env["model"],
        "prompt": "Hello",
        "max_tokens": 3,
        "temperature": 0,
        "logit_bias": {str(im_start): 100},
    }
    hidden = post(env, "/v1/completions", forced).json()["choices"][0]["text"]
    shown = post(env, "/v1/completions", {**forced, "skip_special_tokens": False}).json()["choices"][0][
        "text"
    ]
    assert hidden == "" and shown == "<|im_start|> <|im_start|> <|im_start|>"
    # EOS under ignore_eos is text too; the EOS that ends a choice never is
    ends = {
        **forced,
        "logit_bias": {str(im_end): 100},
        "skip_special_tokens": False,
        "spaces_between_special_tokens": False,
    }
    assert (
        post(env, "/v1/completions", {**ends, "ignore_eos": True}).json()["choices"][0]["text"]
        == "<|im_end|>" * 3
    )
    assert post(env, "/v1/completions", ends).json()["choices"][0]["text"] == ""


def test_logprob_tokens_join_to_the_text(env) -> None:
    model, tok = env["model"], env["tok"]
    prompt = "你好 café 😀 Ωμέγα ✓ 🦀"  # the last three are not in the tiny tokenizer's merges: byte tokens
    echo = post(
        env,
        "/v1/completions",
        {"model": model, "prompt": prompt, "max_tokens": 0, "echo": True, "logprobs": 0},
    ).json()["choices"][0]
    assert "".join(echo["logprobs"]["tokens"]) == echo["text"] == prompt
    split = [t for t in tok.encode(prompt) if "\ufffd" in tok.decode([t])]
    assert split  # some token holds part of a character: decoded alone, the tokens would not join
    sampled = {"model": model, "max_tokens": 40, "temperature": 1.0, "seed": 11, "ignore_eos": True}
    legacy = post(env, "/v1/completions", {**sampled, "prompt": prompt, "logprobs": 1}).json()["choices"][0]
    assert "".join(legacy["logprobs"]["tokens"]) == legacy["text"]
    assert len(legacy["logprobs"]["tokens"]) == 40
    chat = post(
        env,
        "/v1/chat/completions",
        {**sampled, "messages": USER, "logprobs": True, "chat_template_kwargs": {"enable_thinking": False}},
    ).json()["choices"][0]
    assert chat["message"]["content"]
    assert "".join(e["token"] for e in chat["logprobs"]["content"]) == chat["message"]["content"]
    # tokens decoded alone would not join here: some hold part of a character or are hidden special tokens
    token_of = {b: i for i, b in enumerate(tok.token_bytes)}
    alone = [tok.decode([token_of[bytes(e["bytes"])]]) for e in chat["logprobs"]["content"]]
    assert "".join(alone) != chat["message"]["content"]


def test_unknown_fields_are_refused_by_name(env) -> None:
    model = env["model"]
    r = post(
        env,
        "/v1/completions",
        {"model": model, "prompt": "Hi", "max_tokens": 2, "min_tokens": 4, "guided_json": {"type": "object"}},
    )
    assert r.status_code == 400, r.text
    err = r.json()["error"]
    assert err["code"] == "unsupported_parameter" and err["param"] == "guided_json"
    assert "'guided_json', 'min_tokens'" in err["message"] and "response_format" in err["message"]
    r = post(
        env,
        "/v1/chat/completions",
        {"model": model, "messages": USER, "max_tokens": 2, "guided_choice": ["a"]},
    )
    assert r.status_code == 400 and r.json()["error"]["param"] == "guided_choice"
    # OpenCode's preserveThinking changes nothing here and is accepted
    r = post(
        env,
        "/v1/chat/completions",
        {"model": model, "messages": USER, "max_tokens": 2, "preserveThinking": True},
    )
    assert r.status_code == 200, r.text


def test_non_json_content_types_get_415(env) -> None:
    url = env["server"].url + "/v1/completions"
    body = json.dumps({"model": env["model"], "prompt": "Hi", "max_tokens": 1})
    for content_type in (
        "text/plain",
        "application/x-www-form-urlencoded",
        "multipart/form-data; boundary=x",
    ):
        r = httpx.post(url, content=body, headers={"Content-Type": content_type}, timeout=60)
        assert r.status_code == 415, (content_type, r.text)
        assert r.json()["error"]["code"] == "unsupported_media_type"
    for content_type in ("application/json", "application/json; charset=utf-8"):
        assert (
            httpx.post(url, content=body, headers={"Content-Type": content_type}, timeout=60).status_code
            == 200
        )
