"""Prompt-lookup drafts on the CPU demo in process, measured in CPU time: each prompt of
tests/perf/lookup_prompts.json decoded greedily through the scheduler plainly and with ``engine.draft: "lookup"``
(docs/benchmarks.md, "CPU demo: prompt-lookup drafts").

    python tests/perf/bench_lookup_cpu_time.py [--depth 5] [--tokens 128] [--repeats 2]

The served bench (``bench_lookup_drafts.py``) times wall clock, which on a machine shared with other work moves
more than the drafts do; this one sums the process CPU time of the decode steps (one thread, after the prefill),
so other work perturbs it far less. Each request stops at the model's end of turn, as served; the two runs of a
prompt must emit the same tokens. A prompt's speed-up is plain CPU time over lookup CPU time.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

import torch

REPO = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO / "tests" / "perf"))
PROMPTS = json.loads((REPO / "tests" / "perf" / "lookup_prompts.json").read_text())


def main() -> None:
    import transformers
    from bench_cpu_serve import demo_gguf

    from dgpp.checkpoint.gguf_convert import ensure_converted
    from dgpp.config import EngineConfig
    from dgpp.engine.lookup_draft import LookupDecoder
    from dgpp.engine.runner import ModelRunner
    from dgpp.sample import ChoiceSampler, SamplingParams
    from dgpp.sched.block_pool import BlockPool, SlotPool
    from dgpp.sched.config import SchedulerConfig
    from dgpp.sched.prefix_cache import PrefixCache
    from dgpp.sched.request import Sequence
    from dgpp.sched.scheduler import Scheduler
    from dgpp.startup.loading import load_model
    from dgpp.step.pools import CachePools

    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--depth", type=int, default=5)
    parser.add_argument("--tokens", type=int, default=128)
    parser.add_argument("--repeats", type=int, default=2)
    parser.add_argument("--ngram", type=int, default=3)
    parser.add_argument("--min-ngram", type=int, default=2)
    args = parser.parse_args()
    torch.set_num_threads(1)  # a served CPU engine's default on 2 cores
    checkpoint = ensure_converted(demo_gguf())
    tokenizer = transformers.AutoTokenizer.from_pretrained(str(checkpoint))
    model = load_model(checkpoint)
    eos = {tokenizer.eos_token_id}
    chats = [
        tokenizer.apply_chat_template(
            [{"role": "user", "content": p}], add_generation_prompt=True, tokenize=True, return_dict=True
        )["input_ids"]
        for p in PROMPTS
    ]

    def decode(prompt: list[int], depth: int) -> tuple[list[int], float]:
        """The greedy answer and the CPU seconds of its decode steps (lookup drafts at ``depth``; 0: plain)."""
        conf = SchedulerConfig.from_engine(EngineConfig(max_concurrency=1), 16, max_position=1 << 30)
        blocks = -(-(len(prompt) + args.tokens + 16) // 16)
        pools = CachePools(model.cache_spec(), blocks, 16, 2)
        runner = ModelRunner(model, pools)
        block_pool, slots = BlockPool(blocks, 16), SlotPool(1, 1)
        cache = PrefixCache(
            block_pool, conf.chunk_tokens, hybrid=False, slots=slots, copy_state=pools.copy_state
        )
        sched = Scheduler(conf, runner, block_pool, slots, cache, eos_token_ids=eos)
        if depth:
            sched.speculative = LookupDecoder(runner, depth, args.min_ngram, args.ngram)
        out: list[int] = []
        params = SamplingParams(temperature=0.0, max_tokens=args.tokens)
        sampler = ChoiceSampler(params, model.info.vocab_size, prompt)
        sched.submit([Sequence("r", 0, prompt, params, sampler, lambda s, ev: out.extend(ev.tokens))])
        sched.tick()  # the prefill
        start = time.process_time()
        while sched.has_work:
            sched.tick()
        return out, time.process_time() - start

    with torch.inference_mode():
        decode(chats[0], args.depth)  # first products check their shapes
        ratios: list[list[float]] = [[] for _ in chats]
        for _ in range(args.repeats):
            for i, prompt in enumerate(chats):
                plain, plain_s = decode(prompt, 0)
                drafted, drafted_s = decode(prompt, args.depth)
                assert drafted == plain, f"prompt {i}: lookup output differs from plain"
                ratios[i].append(plain_s / drafted_s)
    print(f"depth {args.depth}, ngram {args.min_ngram}..{args.ngram}, {args.repeats} runs; outputs identical")
    for i, r in enumerate(ratios):
        print(f"prompt {i}: {statistics.median(r):.2f}x (runs {', '.join(f'{x:.2f}' for x in r)})")
    print(
        f"geometric mean of the medians {statistics.geometric_mean(statistics.median(r) for r in ratios):.2f}x"
    )


if __name__ == "__main__":
    main()
