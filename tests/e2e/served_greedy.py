"""The served-vs-runner check family serve tests share: a cold request, a prefix-cache hit and concurrent requests
all return exactly the runner's greedy tokens for the same rendered prompts."""

from __future__ import annotations

import json
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from contextlib import contextmanager
from pathlib import Path

import openai
from serve_fixture import Server, running

from dgpp.offline import greedy_generate
from dgpp.startup.loading import load_model
from dgpp.testing.tokenizers import build_tiny_tokenizer
from dgpp.text.chat_template import ChatTemplate
from dgpp.text.tokenizer import Tokenizer

NO_THINK = {"enable_thinking": False}
# a strict tool whose call a grammar can force, and a question that asks for it
WEATHER_TOOL = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "weather for a city",
        "parameters": {
            "type": "object",
            "properties": {
                "city": {"type": "string", "enum": ["Paris", "Rome"]},
                "days": {"type": "integer", "minimum": 1, "maximum": 3},
            },
            "required": ["city", "days"],
            "additionalProperties": False,
        },
        "strict": True,
    },
}
WEATHER_QUESTION = [{"role": "user", "content": "Weather in Paris for two days?"}]
# small prefill chunks and blocks, several requests at once, a prefix cache that keeps every cut
SERVE_ENGINE = {
    "max_concurrency": 4,
    "kv_capacity": 4096,
    "block_size": 4,
    "prefill_budget_tokens": 16,
    "prefix_min_tokens": 0,
    "prefix_cache_gib": 0.01,
    "default_max_tokens": 12,
    "stats_interval_s": 0,
}
QUESTIONS = ("What is the weather in Paris today?", "def add(a, b):", "The quick brown fox")


@contextmanager
def served(
    ckpt: Path, root: Path, chat_template: bool = True, engine: dict | None = None
) -> Iterator[tuple[Server, openai.OpenAI]]:
    """``dgpp serve`` (``engine``, default ``SERVE_ENGINE``) on ``ckpt`` with the tiny tokenizer, and an openai
    client for it. ``chat_template=False``: the tokenizer ships none, so the family plugin's template is used."""
    build_tiny_tokenizer(ckpt)
    if not chat_template:
        config = json.loads((ckpt / "tokenizer_config.json").read_text())
        del config["chat_template"]
        (ckpt / "tokenizer_config.json").write_text(json.dumps(config))
    with running(ckpt, root, SERVE_ENGINE if engine is None else engine) as server:
        yield server, openai.OpenAI(base_url=server.url + "/v1", api_key="none", max_retries=0)


def chat_messages(question: str) -> list[dict]:
    """A long shared system prompt (so a repeat hits the prefix cache) and one question."""
    return [
        {"role": "system", "content": "You are a helpful assistant. Think step by step. " * 3},
        {"role": "user", "content": question},
    ]


def check_served_greedy(
    ckpt: Path,
    sdk: openai.OpenAI,
    questions: tuple[str, ...],
    min_prompt_tokens: int,
    max_tokens: int = 12,
    kv_dtype: str = "auto",
) -> None:
    """Cold, hit (at least 16 cached tokens) and concurrent answers equal the runner's greedy continuation (K/V
    stored as the server's ``engine.kv_dtype``, given as ``kv_dtype``); every rendered prompt is longer than
    ``min_prompt_tokens``."""

    def ask(question: str, **extra) -> openai.types.chat.ChatCompletion:
        return sdk.chat.completions.create(
            model=str(ckpt),
            messages=chat_messages(question),
            max_tokens=max_tokens,
            temperature=0,
            extra_body={"ignore_eos": True, "chat_template_kwargs": NO_THINK, **extra},
        )

    tok = Tokenizer.from_dir(ckpt)
    template = ChatTemplate.for_checkpoint(tok)
    model = load_model(ckpt)
    prompts = [
        tok.encode(template.render(chat_messages(q), chat_template_kwargs=NO_THINK)) for q in questions
    ]
    assert min(len(p) for p in prompts) > min_prompt_tokens
    want = [
        tok.decode(t, skip_special_tokens=True)
        for t in greedy_generate(model, prompts, max_tokens, stop_at_eos=False, kv_dtype=kv_dtype)
    ]

    cold = ask(questions[0], prefix_cache=False)
    ask(questions[0])
    hit = ask(questions[0])
    assert cold.choices[0].message.content == hit.choices[0].message.content == want[0]
    assert hit.usage.prompt_tokens_details.cached_tokens >= 16
    with ThreadPoolExecutor(len(questions)) as pool:
        together = list(pool.map(lambda q: ask(q).choices[0].message.content, questions))
    assert together == want


def check_family_serves(ckpt: Path, root: Path, min_prompt_tokens: int) -> None:
    """``dgpp serve`` on ``ckpt`` (``SERVE_ENGINE``, files under ``root``): cold, prefix-hit and concurrent answers to
    ``QUESTIONS`` are the runner's greedy tokens (a family's end-to-end check)."""
    with served(ckpt, root) as (_, sdk):
        check_served_greedy(ckpt, sdk, QUESTIONS, min_prompt_tokens)


def ask_greedy(
    sdk: openai.OpenAI, ckpt: Path, msgs: list[dict], max_tokens: int, n: int | None = None, **extra
) -> openai.types.chat.ChatCompletion:
    """One greedy chat completion of ``msgs`` (``max_tokens`` past EOS, thinking off; ``extra`` in the body)."""
    return sdk.chat.completions.create(
        model=str(ckpt),
        messages=msgs,
        max_tokens=max_tokens,
        temperature=0,
        n=n,
        extra_body={"ignore_eos": True, "chat_template_kwargs": NO_THINK, **extra},
    )


def stream_greedy(sdk: openai.OpenAI, ckpt: Path, msgs: list[dict], max_tokens: int) -> str:
    """The text of the same greedy request streamed, its deltas joined."""
    stream = sdk.chat.completions.create(
        model=str(ckpt),
        messages=msgs,
        max_tokens=max_tokens,
        temperature=0,
        stream=True,
        extra_body={"ignore_eos": True, "chat_template_kwargs": NO_THINK},
    )
    return "".join(c.choices[0].delta.content or "" for c in stream if c.choices)
