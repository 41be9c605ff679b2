"""The step mixes a GPU server meets first, run before it answers (``engine.warmup``).

Triton compiles a kernel variant the first time a step needs it: a prefill tile class (by the step's row count),
the flash prefill attention of a burst, the decode attention of decode rows beside prefill chunks, the sampling
kernels. Each costs seconds, which a server without warm-up charges to the first burst of each new mix
(docs/benchmarks.md). Here the server sends itself, before it listens, the mixes its users bring:
one short prompt, bursts of 2, 3, 8 and up to 64 short prompts (every prefill tile class), one long prompt
(its chunks in cuBLAS beside the grouped ones), a burst arriving while earlier requests decode, and sampled
rows. Each is a real request through ``Backend.submit`` with the prefix cache off, so nothing is left behind
but compiled kernels and captured decode graphs: no cached prefix, no held block, no counted request.
"""

from __future__ import annotations

import asyncio
import random
import time
from dataclasses import replace

from dgpp.log import get_logger
from dgpp.sample.params import SamplingParams
from dgpp.serve.backend import Backend
from dgpp.serve.generation import generation_request

log = get_logger("dgpp.serve")

SHORT = 128  # tokens of a burst's prompt
LONG = 2048  # tokens of a prompt whose chunks take their own cuBLAS calls
DECODING_TOKENS = 24  # new tokens of the requests a later burst arrives beside
BURSTS = (1, 2, 3, 8, 64)  # prompts per burst: 128 to 8,192 rows, every prefill tile class
GREEDY = SamplingParams(temperature=0.0, max_tokens=4, ignore_eos=True)
SAMPLED = SamplingParams(temperature=0.8, top_p=0.95, top_k=50, max_tokens=4, ignore_eos=True, seed=0)


async def _generate(backend: Backend, prompt: list[int], params: SamplingParams) -> None:
    request = generation_request(
        "cmpl",
        prompt,
        params,
        backend.limits,
        named_limit=True,
        token_text=backend.token_text,
        use_prefix_cache=False,
    )
    handle = backend.submit(request)
    async for _, ev in handle.events():
        if ev.error is not None:
            raise RuntimeError(f"engine warm-up request failed: {ev.error}")


async def _run(backend: Backend, width: int) -> int:
    rng = random.Random(0)
    vocab = backend.limits.vocab_size

    def prompt(tokens: int) -> list[int]:
        return [rng.randrange(vocab) for _ in range(tokens)]

    # a model whose context cannot hold a 128-token prompt and 24 new tokens warms up with shorter prompts
    short = min(SHORT, backend.limits.request_limit_tokens - DECODING_TOKENS)
    if short < 1:
        return 0
    sent = 0
    for size in sorted({min(b, width) for b in BURSTS}):
        await asyncio.gather(*(_generate(backend, prompt(short), GREEDY) for _ in range(size)))
        sent += size
    room = backend.limits.request_limit_tokens - GREEDY.max_tokens
    if room > short:  # a long prompt beside short ones: its chunks in cuBLAS, theirs grouped
        long = min(LONG, room)
        await asyncio.gather(
            _generate(backend, prompt(long), GREEDY),
            *(_generate(backend, prompt(short), GREEDY) for _ in range(min(7, width - 1))),
        )
        sent += 1 + min(7, width - 1)
    # a burst arriving while earlier requests decode: prefill chunks beside decode rows, greedy and sampled
    for params in (GREEDY, SAMPLED):
        early = [
            asyncio.ensure_future(
                _generate(backend, prompt(short), replace(params, max_tokens=DECODING_TOKENS))
            )
            for _ in range(min(4, width))
        ]
        await asyncio.sleep(0.05)
        late = max(0, width - len(early))
        await asyncio.gather(*early, *(_generate(backend, prompt(short), params) for _ in range(late)))
        sent += len(early) + late
    return sent


def warm_up(backend: Backend, max_concurrency: int) -> int:
    """Run the warm-up requests on a fresh event loop and wait for them (the server listens afterwards);
    returns how many were sent."""
    width = max(
        1,
        min(max_concurrency, max(BURSTS), backend.limits.kv_pool_tokens // (SHORT + DECODING_TOKENS)),
    )
    start = time.monotonic()
    sent = asyncio.run(_run(backend, width))
    log.info("engine warm-up", requests=sent, seconds=round(time.monotonic() - start, 1))
    return sent
