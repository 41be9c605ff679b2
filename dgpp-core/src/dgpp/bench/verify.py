"""``dgpp bench verify``: what the speculative verify path costs, measured without draft weights.

A random model of a real geometry decodes each case ``PROMPTxBATCHxNEW`` greedily through the scheduler three
ways: plainly (which also records each request's greedy continuation), then with drafts from a scripted drafter
at each depth:

- ``oracle`` proposes the recorded continuation itself: every draft is accepted (the verify path's best case,
  ``1 + depth`` tokens a pass);
- ``null`` proposes a token that is never the recorded one: every draft is rejected (the path's overhead: the
  verify rows, the judge and the hybrid state's re-run, for one token a pass).

Each scripted run must reproduce the plain transcript (greedy verification is exact); a run that does not is a
failure. ``--schedule on`` also runs the drafters under ``engine.mtp_schedule`` (a draft's chance is its
request's running acceptance rate, as for prompt-lookup drafts), where the null drafter falls back to plain rows.

On CUDA every run replays the decode graphs, plain decode and verify steps alike (``dgpp.engine.verify_graphs``;
the ``replays`` column counts them); ``--eager`` also runs each case with every step eager, for comparison. On a
CPU every step is eager.

    dgpp bench verify --geometry qwen3-8b --cases 128x1x128,128x16x128 --verify-depths 1,3
    dgpp bench verify --geometry qwen3-8b --cases 128x1x128,128x16x128 --verify-depths 1,3 --eager  # and eager
    dgpp bench verify --device cpu --geometry tiny --cases 16x4x32     # a smoke run of the path on CPU
"""

from __future__ import annotations

import argparse
import datetime
import time
from dataclasses import dataclass

import torch

from dgpp.bench.args import parse_cases
from dgpp.bench.decode import random_prompts
from dgpp.bench.models import build_random_model
from dgpp.config import EngineConfig
from dgpp.engine.draft_proposal import Proposal
from dgpp.engine.graphs import DecodeGraphs
from dgpp.engine.runner import ModelRunner
from dgpp.engine.speculative import VerifyDecoder
from dgpp.engine.verify_schedule import ScheduleSettings
from dgpp.engine.work import DecodingSequence
from dgpp.sample import ChoiceSampler, SamplingParams
from dgpp.sched.block_pool import BlockPool, SlotPool
from dgpp.sched.config import SchedulerConfig
from dgpp.sched.prefix_cache import PrefixCache
from dgpp.sched.request import SeqEvent, SeqStatus, Sequence
from dgpp.sched.scheduler import Scheduler
from dgpp.step.model import Model
from dgpp.step.pools import CachePools

BLOCK = 16


class ScriptedDecoder(VerifyDecoder):
    """Drafts from recorded greedy continuations (``transcripts``: request id -> prompt + output): the recorded
    tokens (``oracle``) or the token after each in the vocabulary (``null``, never right)."""

    def __init__(
        self,
        runner: ModelRunner,
        depth: int,
        transcripts: dict[str, list[int]],
        drafter: str,
        schedule: ScheduleSettings | None = None,
    ) -> None:
        if drafter not in ("oracle", "null"):
            raise ValueError(f"unknown scripted drafter {drafter!r} (oracle, null)")
        super().__init__(runner, depth, drafter, schedule)
        self.transcripts = transcripts
        self.vocab = runner.model.info.vocab_size
        self.right = drafter == "oracle"

    def _propose(self, seqs: list[DecodingSequence]) -> Proposal:
        rule = self._rule(seqs)
        drafts = []
        for i, s in enumerate(seqs):
            room = self._room(s)
            if rule is not None and room and self._track(s).resting():
                room = 0
            # the token fed at ``computed`` is the last emitted one; the drafts are the positions after it
            recorded = self.transcripts[s.request_id][s.computed + 1 : s.computed + 1 + room]
            proposed = recorded if self.right else [(t + 1) % self.vocab for t in recorded]
            if rule is not None:
                proposed = proposed[: rule.cut(i, [self._track(s).rate] * len(proposed))]
            drafts.append(proposed)
        return Proposal.of(drafts)


@dataclass
class Timed:
    """A run's tokens per request and its decode phase: the passes after every prompt was prefilled."""

    tokens: dict[str, list[int]]
    seconds: float
    passes: int
    rows: int
    generated: int
    replays: int = 0  # steps replayed through the decode graphs


@dataclass
class VerifyResult:
    case: str
    drafter: str  # plain, oracle or null
    depth: int
    scheduled: bool
    run: Timed
    drafted: int
    accepted: int
    exact: bool
    graphs: bool = False

    @property
    def tok_s(self) -> float:
        return self.run.generated / self.run.seconds if self.run.seconds else 0.0

    @property
    def ms_per_pass(self) -> float:
        return 1e3 * self.run.seconds / self.run.passes if self.run.passes else 0.0


def _scheduler(model: Model, batch: int, max_len: int, graphs: bool) -> Scheduler:
    """A scheduler over fresh pools; ``graphs``: decode and verify steps through the decode graphs (captured on
    CUDA; elsewhere their padded static batch runs eagerly)."""
    blocks_per_seq = -(-max_len // BLOCK) + 1
    # a deployment's scheduler at the engine's defaults, sized to the batch
    engine = EngineConfig(max_concurrency=batch, queue_limit=max(64, batch))
    conf = SchedulerConfig.from_engine(engine, BLOCK, max_position=1 << 30)
    device = next(model.parameters()).device
    pools = CachePools(model.cache_spec(), batch * blocks_per_seq, BLOCK, batch + 1, device=device)
    runner = ModelRunner(model, pools)
    if graphs:  # what engine.decode_graph builds, sized to the batch
        runner.graphs = DecodeGraphs(model, pools, batch, blocks_per_seq)
    blocks, slots = BlockPool(batch * blocks_per_seq, BLOCK), SlotPool(batch, 1)
    cache = PrefixCache(
        blocks, conf.chunk_tokens, hybrid=model.info.hybrid, slots=slots, copy_state=pools.copy_state
    )
    return Scheduler(conf, runner, blocks, slots, cache)


def _decode(sched: Scheduler, prompts: list[list[int]], new: int) -> Timed:
    """Every prompt through ``sched``, greedy."""
    out: dict[str, list[int]] = {}

    def sink(s: Sequence, ev: SeqEvent) -> None:
        if ev.error is not None:
            raise RuntimeError(f"request {s.request_id} failed: {ev.error}")
        out.setdefault(s.request_id, []).extend(ev.tokens)

    if sched.runner.graphs is not None:
        sched.runner.graphs.capture()  # before the clock starts (a verify decoder sizes its own graph set)
    vocab = sched.runner.model.info.vocab_size
    params = SamplingParams(temperature=0.0, max_tokens=new, ignore_eos=True)
    seqs = [
        Sequence(f"r{i}", 0, p, params, ChoiceSampler(params, vocab, p), sink) for i, p in enumerate(prompts)
    ]
    sched.submit(seqs)
    st = sched.stats
    start: tuple[float, int, int, int] | None = None
    for _ in range(len(prompts) * (new + 8) + 64):
        if not sched.has_work:
            break
        if start is None and all(s.status in (SeqStatus.DECODE, SeqStatus.FINISHED) for s in seqs):
            start = (time.perf_counter(), st.decode_steps, st.decode_batch_rows, st.tokens_generated)
        sched.tick()
    if sched.has_work:
        raise RuntimeError("the scheduler did not drain")
    graphs = sched.runner.graphs
    t0, passes, rows, generated = start or (
        time.perf_counter(),
        st.decode_steps,
        st.decode_batch_rows,
        st.tokens_generated,
    )
    return Timed(
        out,
        time.perf_counter() - t0,
        st.decode_steps - passes,
        st.decode_batch_rows - rows,
        st.tokens_generated - generated,
        graphs.stats.replays if graphs is not None else 0,
    )


def run_verify_case(
    model: Model,
    prompt: int,
    batch: int,
    new: int,
    depths: list[int],
    drafters: list[str],
    schedules: list[bool],
    graphs: bool = False,
) -> list[VerifyResult]:
    """The plain run, then each drafter at each depth (and schedule), on the same prompts; ``graphs``: every run's
    steps through the decode graphs."""
    case = f"{prompt}x{batch}x{new}"
    prompts = random_prompts(batch, prompt, model.info.vocab_size, seed=prompt * 1000 + batch)
    _decode(_scheduler(model, batch, prompt + new, graphs), prompts, min(new, 4))  # warm-up: first-call costs
    plain = _decode(_scheduler(model, batch, prompt + new, graphs), prompts, new)
    results = [VerifyResult(case, "plain", 0, False, plain, 0, 0, True, graphs)]
    transcripts = {rid: prompts[int(rid[1:])] + tokens for rid, tokens in plain.tokens.items()}
    for scheduled in schedules:
        for drafter in drafters:
            for depth in depths:
                sched = _scheduler(model, batch, prompt + new, graphs)
                settings = ScheduleSettings() if scheduled else None
                decoder = ScriptedDecoder(sched.runner, depth, transcripts, drafter, settings)
                sched.speculative = decoder
                run = _decode(sched, prompts, new)
                spec = decoder.stats
                results.append(
                    VerifyResult(
                        case,
                        drafter,
                        depth,
                        scheduled,
                        run,
                        spec.num_draft_tokens_total,
                        spec.num_accepted_tokens_total,
                        run.tokens == plain.tokens,
                        graphs,
                    )
                )
    return results


def format_verify_table(results: list[VerifyResult]) -> str:
    lines = [
        "| case | drafter | depth | schedule | decode tok/s | ms/pass | passes | verify rows | drafted | accepted | exact "
        "| steps | replays |",
        "|---|---|---:|---|---:|---:|---:|---:|---:|---:|---|---|---:|",
    ]
    for r in results:
        rate = f"{100 * r.accepted / r.drafted:.0f}%" if r.drafted else "-"
        lines.append(
            f"| {r.case} | {r.drafter} | {r.depth} | {'on' if r.scheduled else 'off'} | {r.tok_s:.1f} | "
            f"{r.ms_per_pass:.2f} | {r.run.passes} | {r.run.rows} | {r.drafted} | {r.accepted} ({rate}) | "
            f"{'yes' if r.exact else 'NO'} | {'graph' if r.graphs else 'eager'} | {r.run.replays} |"
        )
    return "\n".join(lines)


def run_verify(args: argparse.Namespace) -> int:
    device = args.device
    dtype = torch.bfloat16 if device == "cuda" else torch.float32
    model = build_random_model(args.geometry, device, dtype)
    depths = [int(d) for d in args.verify_depths.split(",") if d]
    drafters = [d for d in args.verify_drafters.split(",") if d]
    schedules = {"off": [False], "on": [True], "both": [False, True]}[args.schedule]
    # CUDA: graph replays, and with --eager every step eager too; a CPU has no graphs to replay
    modes = ([True, False] if args.eager else [True]) if device == "cuda" else [False]
    results: list[VerifyResult] = []
    with torch.inference_mode():
        for prompt, batch, new in parse_cases(args.cases):
            for graphs in modes:
                found = run_verify_case(model, prompt, batch, new, depths, drafters, schedules, graphs)
                for r in found:
                    print(
                        f"{r.case} {r.drafter} depth {r.depth} {'graph' if graphs else 'eager'}: "
                        f"{r.tok_s:.1f} tok/s, exact {r.exact}",
                        flush=True,
                    )
                results += found
    header = (
        f"date {datetime.datetime.now(datetime.UTC):%Y-%m-%d %H:%M} UTC, device "
        f"{torch.cuda.get_device_name() if device == 'cuda' else 'cpu'}, torch {torch.__version__}, "
        f"geometry {args.geometry} {model.info.dtype} random weights, verify path with scripted drafters"
    )
    table = format_verify_table(results)
    print("\n" + header + "\n" + table)
    if args.out:
        with open(args.out, "w") as f:
            f.write(header + "\n\n" + table + "\n")
    inexact = [f"{r.case} {r.drafter} depth {r.depth}" for r in results if not r.exact]
    if inexact:
        print(f"failed: greedy with drafts differs from plain for {inexact}")
    return 1 if inexact else 0
