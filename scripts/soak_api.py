#!/usr/bin/env python3
"""Soak a running ``dgpp serve``: mixed requests at a fixed concurrency, then check nothing was lost,
every greedy answer equals the first answer to the same prompt, and no KV block leaked.

    python scripts/soak_api.py http://127.0.0.1:18080 [--requests 1000] [--concurrency 32]

The mix: chat and legacy completions, one-shot and streamed, greedy (``temperature: 0``, ``ignore_eos``,
fixed ``max_tokens``) over a few prompts, seeded sampled ones, streams the client abandons after two
events, and one-shot batches (two prompts, ``n`` 2) the client gives up on after half a second. A 503 ``overloaded`` is retried after its ``Retry-After`` (counted as shed, not lost). Exits 1
when a request is lost, a greedy answer differs, or blocks stay in use beyond what the prefix cache pins.
Not part of the test suite (it runs for minutes).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import random
import sys
import time
from collections import Counter

import httpx

PROMPTS = [
    "Hello world! What is the weather in Paris today?",
    "def add(a, b):",
    "The quick brown fox",
    "Tell me a story about a robot.",
    "List three colors.",
    "你好，世界。",
    "Why is the sky blue?",
    "Summarize: " + "Background note. " * 40,
]
KINDS = ["chat", "chat_stream", "legacy", "legacy_stream", "abandon", "sampled", "abandon_batch"]
WEIGHTS = [40, 20, 15, 10, 10, 5, 5]
GIVE_UP_S = 0.5  # an abandoned batch's client waits this long, then closes its connection


async def post(
    client: httpx.AsyncClient,
    path: str,
    body: dict,
    stats: Counter,
    stream: bool = False,
    abandon: bool = False,
) -> str | None:
    """The answer's text (joined deltas for a stream); None for an abandoned stream. Retries 503 overloaded."""
    for _ in range(100):
        if not stream:
            r = await client.post(path, json=body)
            if r.status_code == 503 and r.headers.get("retry-after"):
                stats["shed"] += 1
                await asyncio.sleep(float(r.headers["retry-after"]))
                continue
            r.raise_for_status()
            choice = r.json()["choices"][0]
            return choice["message"]["content"] if "message" in choice else choice["text"]
        async with client.stream("POST", path, json=body) as r:
            if r.status_code == 503 and r.headers.get("retry-after"):
                stats["shed"] += 1
                await r.aread()
                await asyncio.sleep(float(r.headers["retry-after"]))
                continue
            r.raise_for_status()
            text, events = "", 0
            async for line in r.aiter_lines():
                if not line.startswith("data: {"):
                    continue
                events += 1
                if abandon and events >= 2:
                    return None  # leaving the block closes the connection mid-stream
                for c in json.loads(line[6:]).get("choices", []):
                    text += c.get("text") or (c.get("delta") or {}).get("content") or ""
            return text
    raise RuntimeError("still overloaded after 100 tries")


async def template_kwargs(client: httpx.AsyncClient, model: str) -> dict:
    """``chat_template_kwargs`` turning thinking off where the chat template has that switch (a template without it
    refuses the key by name, e.g. SmolLM2's)."""
    no_think = {"chat_template_kwargs": {"enable_thinking": False}}
    body = {"model": model, "max_tokens": 1, "messages": [{"role": "user", "content": "Hi"}], **no_think}
    r = await client.post("/v1/chat/completions", json=body)
    return {} if r.status_code == 400 and "enable_thinking" in r.text else no_think


async def one(
    client: httpx.AsyncClient,
    model: str,
    i: int,
    rng: random.Random,
    answers: dict,
    stats: Counter,
    mismatches: list,
    no_think: dict,
) -> None:
    kind = rng.choices(KINDS, WEIGHTS)[0]
    p = rng.randrange(len(PROMPTS))
    chat = kind in ("chat", "chat_stream", "abandon", "sampled")
    body: dict = {"model": model, "max_tokens": 16, "temperature": 0, "ignore_eos": True}
    if chat:
        body |= {"messages": [{"role": "user", "content": PROMPTS[p]}], **no_think}
    else:
        body["prompt"] = PROMPTS[p]
    if kind == "sampled":
        body |= {"temperature": 0.8, "seed": i}
    if kind == "abandon_batch":
        body |= {"prompt": [PROMPTS[p], PROMPTS[(p + 1) % len(PROMPTS)]], "n": 2, "max_tokens": 64}
        try:
            await asyncio.wait_for(client.post("/v1/completions", json=body), GIVE_UP_S)
            stats["abandon_batch_answered"] += 1  # answered (or refused) before the client gave up
        except TimeoutError:
            stats[kind] += 1  # the connection closes: the server must cancel all four sequences
        return
    stream = kind in ("chat_stream", "legacy_stream", "abandon")
    if stream:
        body["stream"] = True
    path = "/v1/chat/completions" if chat else "/v1/completions"
    try:
        text = await post(client, path, body, stats, stream=stream, abandon=kind == "abandon")
    except Exception as exc:  # noqa: BLE001 - a lost request is reported, whatever the reason
        stats["lost"] += 1
        print(f"lost: request {i} ({kind}): {type(exc).__name__}: {exc}", file=sys.stderr)
        return
    stats[kind] += 1
    if text is None or kind == "sampled":
        return
    key = (chat, p)
    if key not in answers:
        answers[key] = text
    elif answers[key] != text:
        mismatches.append((i, kind, p, answers[key], text))


async def soak(url: str, n: int, concurrency: int, seed: int) -> int:
    async with httpx.AsyncClient(base_url=url, timeout=600) as client:
        model = (await client.get("/v1/models")).json()["data"][0]["id"]
        rng, answers, stats, mismatches = random.Random(seed), {}, Counter(), []
        no_think = await template_kwargs(client, model)
        gate = asyncio.Semaphore(concurrency)

        async def gated(i: int) -> None:
            async with gate:
                await one(client, model, i, rng, answers, stats, mismatches, no_think)

        t0 = time.monotonic()
        await asyncio.gather(*(gated(i) for i in range(n)))
        elapsed = time.monotonic() - t0
        for _ in range(600):  # the engine retires abandoned streams on its next ticks
            m = (await client.get("/metrics")).json()
            if m["scheduler"]["active"] == 0 and m["scheduler"]["queued"] == 0:
                break
            await asyncio.sleep(0.1)
        sched, cache = m["scheduler"], m["prefix_cache"]
        leaked = sched["pool_blocks_in_use"] - cache.get("blocks_pinned", 0)
    print(f"{n} requests at {concurrency} concurrent in {elapsed:.1f} s: {dict(sorted(stats.items()))}")
    print(f"greedy prompts: {len(answers)}, mismatched greedy answers: {len(mismatches)}")
    print(
        f"blocks in use after: {sched['pool_blocks_in_use']} (prefix cache pins {cache.get('blocks_pinned', 0)}), "
        f"leaked: {leaked}; active {sched['active']}, queued {sched['queued']}"
    )
    for i, kind, p, want, got in mismatches[:5]:
        print(f"  mismatch: request {i} ({kind}) prompt {p}: {want!r} != {got!r}")
    return 1 if stats["lost"] or mismatches or leaked else 0


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("url")
    ap.add_argument("--requests", type=int, default=1000)
    ap.add_argument("--concurrency", type=int, default=32)
    ap.add_argument("--seed", type=int, default=0)
    args = ap.parse_args()
    return asyncio.run(soak(args.url.rstrip("/"), args.requests, args.concurrency, args.seed))


if __name__ == "__main__":
    sys.exit(main())
