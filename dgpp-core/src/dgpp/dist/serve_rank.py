"""``dgpp serve CONFIG --rank R`` for worlds of more than one rank.

Every rank forms the world, loads its slice of the checkpoint and builds the same scheduler. Rank 0
serves HTTP and journals each tick to the peers; the peers follow the journal. A peer's death makes
rank 0 fail its step loop (``/health`` 503, streams end with ``engine_failure``) and exit 2; rank 0's
death releases the peers (exit 3). At an orderly shutdown every rank's op-stream digest is compared.
"""

from __future__ import annotations

import os
import signal
from typing import TYPE_CHECKING

import torch.distributed as dist

from dgpp.dist.channel import WorldError
from dgpp.dist.digest import OpStream
from dgpp.dist.follower import Follower
from dgpp.dist.journal import JournalWriter
from dgpp.dist.watchdog import (
    EXIT_ENGINE_FAILURE,
    PROGRESS_LIMIT_S,
    ProgressWatchdog,
    exit_after_failure,
    name_departed_peers,
)
from dgpp.dist.world import DistWorld, WorldSpec, form_world, settings_of
from dgpp.config import DeployConfig
from dgpp.log import get_logger

if TYPE_CHECKING:
    from dgpp.startup.deployment import Deployment
    from dgpp.serve.backend import Backend

log = get_logger("dgpp.dist")


def progress_limit_s() -> float:
    """The progress watchdog's limit (``DGPP_PROGRESS_WATCHDOG_S`` shortens it for tests and drills)."""
    return float(os.environ.get("DGPP_PROGRESS_WATCHDOG_S", PROGRESS_LIMIT_S))


def serve_rank(cfg: DeployConfig, rank: int, deployment: Deployment | None = None) -> int:
    """Run rank ``rank`` of ``cfg``'s world to the end; returns the process exit code (``deployment``:
    preflight's resolution of checkpoint and family, reused for loading)."""
    from dgpp.dist.fabric import apply_fabric_env
    from dgpp.server_assembly import Rank0Wiring, build_backend

    spec = WorldSpec.from_config(cfg, rank)
    if cfg.node_env:  # this rank's allow-listed environment from the template (RoCE lanes, caches, log level)
        os.environ.update(cfg.node_env[rank])
    apply_fabric_env(log_result=True)  # NCCL reads its env at init: before the process group forms
    world = form_world(spec, settings_of(cfg))
    code = 1
    try:
        stream = OpStream()
        rank0 = None
        if rank == 0:
            hub = world.hub
            assert hub is not None
            rank0 = Rank0Wiring(journal_for=lambda scheduler: JournalWriter(hub, scheduler, stream),
                                name_departures=lambda runner, spec: name_departed_peers(runner, spec, hub))
        backend = build_backend(cfg, deployment, world=world.world, group=world.group, device=world.device,
                                start_loop=False, rank0=rank0)
        dist.barrier()  # every rank has its slice before rank 0 accepts a request
        if rank == 0:
            code = _serve_rank0(cfg, world, backend, stream)
        else:
            signal.signal(signal.SIGINT, signal.SIG_IGN)  # peers end on rank 0's Stop, not on the launcher's ^C
            assert world.link is not None
            code = Follower(world.link, backend.loop.scheduler, backend.limits.vocab_size, stream, rank,
                            constraint_matcher=backend.constraint_matcher if backend.grammar is not None else None).run()
        return code
    finally:
        world.close(orderly=code == 0)


def _serve_rank0(cfg: DeployConfig, world: DistWorld, backend: Backend, stream: OpStream) -> int:
    from dgpp.serve.app import run

    assert world.hub is not None
    loop = backend.loop
    writer = loop.journal
    assert isinstance(writer, JournalWriter)
    world.hub.watch(loop.fail)
    watchdog = ProgressWatchdog(writer, progress_limit_s(), loop.fail).start()
    failure_exit = exit_after_failure(loop, before_exit=lambda: log.info("op stream", rank=0, md5=stream.full_digest()))
    loop.start()
    try:
        run(cfg, backend)
    finally:
        loop.stop()
        watchdog.set()
    if loop.failed is not None:
        return EXIT_ENGINE_FAILURE
    failure_exit.set()
    try:
        writer.stop()
    except WorldError as e:
        log.error("shutdown", error=str(e))
        return EXIT_ENGINE_FAILURE
    return 0
