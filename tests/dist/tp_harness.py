"""One rank of a test world: form it, load this rank's slice, serve a fixed set of requests through the
real scheduler (rank 0 journals, peers follow), then compare logits; results land in ``out_dir``."""

from __future__ import annotations

import json
import socket
import threading
from pathlib import Path
from typing import Any

import torch

from dgpp.config import parse_config
from dgpp.dist.digest import OpStream
from dgpp.dist.follower import Follower
from dgpp.dist.journal import JournalWriter, OpRecorder
from dgpp.dist.world import WorldSpec, form_world, settings_of
from dgpp.sample.params import SamplingParams
from dgpp.sched.request import RetireReason, SeqEvent, Sequence
from dgpp.sched.thread_handoff import GenerationRequest
from dgpp.server_assembly import Rank0Wiring, build_backend
from dgpp.testing import conformance as conf

# (prompt length, params, n): greedy short, greedy chunked over several ticks, seeded and unseeded sampling
REQUESTS: list[tuple[int, dict[str, Any], int]] = [
    (9, {"temperature": 0.0, "max_tokens": 8}, 1),
    (37, {"temperature": 0.0, "max_tokens": 6}, 1),
    (12, {"temperature": 0.8, "top_p": 0.9, "seed": 1234, "max_tokens": 6}, 2),
    (7, {"temperature": 1.0, "max_tokens": 5}, 1),
]
LOGIT_PROMPTS = (5, 19)
STOPPED = "req1/0"  # cancelled by a journaled stop on its third token (it ends after the fourth)


def free_ports(n: int) -> list[int]:
    """``n`` distinct free ports: every socket stays bound until all are picked, so two cannot coincide."""
    socks = [socket.socket() for _ in range(n)]
    try:
        for s in socks:
            s.bind(("127.0.0.1", 0))
        return [s.getsockname()[1] for s in socks]
    finally:
        for s in socks:
            s.close()


def free_port() -> int:
    return free_ports(1)[0]


def deploy_dict(checkpoint: Path, size: int, **engine: Any) -> dict[str, Any]:
    fabric, journal = free_ports(2)
    return {
        "model": str(checkpoint), "world_size": size,
        "ports": {"fabric": fabric, "journal": journal},
        "engine": {"kv_capacity": 1024, "max_concurrency": 4, "prefill_budget_tokens": 16,
                   "rendezvous_timeout_ms": 60000, **engine},
    }


def write_served_deploy(tmp_path: Path, checkpoint: Path, size: int, **engine: Any) -> tuple[Path, int]:
    """A deployment file for a served world on loopback; returns its path and the HTTP port (distinct from
    the fabric and journal ports, all picked with their sockets held together)."""
    http, fabric, journal = free_ports(3)
    raw = deploy_dict(checkpoint, size, **engine)
    raw["ports"] = {"fabric": fabric, "journal": journal}
    raw["http"] = {"bind_host": "127.0.0.1", "port": http}
    config = tmp_path / "deploy.json"
    config.write_text(json.dumps(raw))
    return config, http


def _submit_all(engine: Any, vocab: int) -> tuple[dict[str, list[int]], threading.Event]:
    transcripts: dict[str, list[int]] = {}
    done = threading.Event()
    total = sum(n for _, _, n in REQUESTS)
    finished: list[str] = []
    stopped: list[str] = []
    prompts = conf.make_prompts(vocab, tuple(length for length, _, _ in REQUESTS), seed=21)

    def sink(s: Sequence, ev: SeqEvent) -> None:
        got = transcripts.setdefault(s.request_id, [])
        got.extend(ev.tokens)
        if s.request_id == STOPPED and len(got) >= 3 and ev.retired is None and STOPPED not in stopped:
            stopped.append(STOPPED)  # as a stop string would: the cancel travels in the next tick's record
            engine.inbox.cancel(STOPPED, RetireReason.STOP)
        if ev.retired is not None:
            finished.append(s.request_id)
            if len(finished) == total:
                done.set()

    for r, ((_, raw, n), prompt) in enumerate(zip(REQUESTS, prompts, strict=True)):
        engine.inbox.submit(GenerationRequest(f"req{r}", tuple(prompt), SamplingParams(**raw), n), sink)
    return transcripts, done


def run_rank(rank: int, raw_cfg: dict[str, Any], out_dir: str, diverge_at: int = 0) -> None:
    """The body of one spawned rank (``size == 1``: the single-process reference, no journal)."""
    torch.set_num_threads(1)
    cfg = parse_config(raw_cfg)
    out = Path(out_dir)
    world = None
    orderly = False
    if cfg.world > 1:
        world = form_world(WorldSpec.from_config(cfg, rank), settings_of(cfg), device="cpu")
    try:
        kw = {"world": world.world, "group": world.group} if world else {}
        stream = OpStream()
        if rank == 0:
            hub = world.hub if world else None
            kw["rank0"] = Rank0Wiring(
                journal_for=lambda scheduler: JournalWriter(hub, scheduler, stream) if hub else _LocalRecorder(scheduler, stream),
                name_departures=lambda runner, spec: (runner, spec),
            )
        engine = build_backend(cfg, device="cpu", start_loop=False, **kw)
        if world:
            torch.distributed.barrier()
        result: dict[str, Any] = {}
        if rank == 0:
            loop = engine.loop
            writer = loop.journal
            if world:
                world.hub.watch(loop.fail)
            transcripts, done = _submit_all(engine, engine.limits.vocab_size)
            loop.start()
            finished = done.wait(120)
            loop.stop()
            result["failed"] = loop.failed
            result["transcripts"] = transcripts
            if finished and loop.failed is None:
                result["digests"] = writer.stop() if world else {0: stream.full_digest()}
        else:
            follower = Follower(world.link, engine.loop.scheduler, engine.limits.vocab_size, stream, rank)
            if diverge_at:
                inner = follower.recorder.end_tick

                def end_tick(n: int) -> None:
                    inner(n)
                    if n == diverge_at:
                        stream.add("X injected")

                follower.recorder.end_tick = end_tick  # type: ignore[method-assign]
            result["exit"] = follower.run()
            result["error"] = follower.error
        result["digest"] = stream.full_digest()
        if not diverge_at:  # the same logits on every rank: the reduced hidden state and the head are replicated
            model = engine.loop.scheduler.runner.model
            result["head_rows"] = model.lm_head.vocab_local
            logits = conf.engine_all_logits(model, conf.make_prompts(engine.limits.vocab_size, LOGIT_PROMPTS, seed=5))
            torch.save(logits, out / f"logits{rank}.pt")
        (out / f"rank{rank}.json").write_text(json.dumps(result))
        orderly = not diverge_at
    finally:
        if world:
            world.close(orderly=orderly)


class _LocalRecorder:
    """World 1: the same op stream as rank 0 of a larger world, without a journal."""

    def __init__(self, scheduler: Any, stream: OpStream) -> None:
        self.recorder = OpRecorder(scheduler, stream)
        self.tick = 0

    def recording(self, sink: Any) -> Any:
        return self.recorder.recording(sink)

    def before_tick(self, inbox: list[list[Sequence]], cancels: list) -> None:
        self.tick += 1

    def after_tick(self) -> None:
        self.recorder.end_tick(self.tick)
