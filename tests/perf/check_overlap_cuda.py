"""Overlapped decode steps on a GPU: the scheduler over a real model with decode graphs, overlap off then on,
the same requests (greedy and seeded sampling, different lengths): tokens must be identical; prints the decode
rate of each (in-process, no HTTP).

    python3 tests/perf/check_overlap_cuda.py [--geometry qwen3-8b] [--streams 64] [--tokens 128]
"""

from __future__ import annotations

import argparse
import sys
import time

import torch

from dgpp.bench.decode import random_prompts
from dgpp.bench.models import build_pair
from dgpp.engine.runner import ModelRunner
from dgpp.sample import ChoiceSampler, SamplingParams
from dgpp.sched.block_pool import BlockPool, SlotPool
from dgpp.sched.prefix_cache import PrefixCache
from dgpp.sched.request import SeqEvent, Sequence
from dgpp.sched.scheduler import Scheduler
from dgpp.step.pools import CachePools
from dgpp.testing.scheduler import scheduler_config

SAMPLED = {"temperature": 0.8, "top_p": 0.95, "top_k": 50}


def run(
    model,
    runner: ModelRunner,
    blocks: int,
    streams: int,
    prompts: list[list[int]],
    tokens: int,
    overlap: bool,
) -> tuple[dict, float, int]:
    conf = scheduler_config(
        block_size=16,
        chunk_tokens=256,
        max_concurrency=streams,
        idle_chunks=32,
        busy_chunks=1,
        prefix_cache=False,
        queue_limit=4 * streams,
    )
    pool, slots = BlockPool(blocks, 16), SlotPool(streams, 0)
    cache = PrefixCache(pool, 256, hybrid=False, slots=slots, copy_state=None, enabled=False)
    sched = Scheduler(conf, runner, pool, slots, cache, eos_token_ids=frozenset())
    sched.overlap_steps = overlap
    out: dict = {}
    vocab = model.info.vocab_size
    for i, prompt in enumerate(prompts):
        extra = SAMPLED | {"seed": i} if i % 8 == 7 else {"temperature": 0.0}
        p = SamplingParams(max_tokens=tokens - (i % 5) * 7, ignore_eos=True, **extra)

        def sink(s: Sequence, ev: SeqEvent, key: int = i) -> None:
            out.setdefault(key, []).extend(ev.tokens)

        sched.submit([Sequence(str(i), 0, prompt, p, ChoiceSampler(p, vocab, prompt), sink)])
    sched.tick()  # the prefill
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    before = sched.stats.tokens_generated
    while sched.has_work:
        sched.tick()
    torch.cuda.synchronize()
    return out, time.perf_counter() - t0, sched.stats.tokens_generated - before


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--geometry", default="qwen3-8b")
    ap.add_argument("--streams", default="64,8,1")
    ap.add_argument("--tokens", type=int, default=128)
    args = ap.parse_args()
    model, _ = build_pair(args.geometry, "cuda", torch.bfloat16, with_hf=False)
    widest = max(int(n) for n in args.streams.split(","))
    per_seq = -(-(128 + args.tokens + 16) // 16)
    pools = CachePools(model.cache_spec(), widest * per_seq, 16, widest, device="cuda")
    runner = ModelRunner(model, pools, decode_graph=True, max_batch=widest, max_blocks=per_seq)
    failed = False
    for n in (int(x) for x in args.streams.split(",")):
        prompts = random_prompts(n, 128, model.info.vocab_size, n)
        run(model, runner, widest * per_seq, n, prompts, 16, False)  # graphs captured, kernels compiled
        off, off_s, off_n = run(model, runner, widest * per_seq, n, prompts, args.tokens, False)
        on, on_s, on_n = run(model, runner, widest * per_seq, n, prompts, args.tokens, True)
        same = off == on
        failed |= not same
        print(
            f"{n} streams: overlap off {off_n / off_s:,.0f} tok/s, on {on_n / on_s:,.0f} tok/s "
            f"({on_n / on_s / (off_n / off_s) - 1:+.1%}); tokens identical: {same}",
            flush=True,
        )
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
