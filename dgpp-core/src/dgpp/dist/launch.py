"""Start every local rank of a world as its own process (``dgpp launch CONFIG``).

Each rank runs ``dgpp serve CONFIG --rank R`` in a session of its own, so a terminal's ^C (sent to the
whole foreground process group) reaches the launcher alone; the launcher passes it, and a SIGTERM, on to
rank 0 only, once (rank 0 journals the stop to the peers). When any rank ends, the launcher waits for the
rest and returns rank 0's exit code, or the first failing one.
"""

from __future__ import annotations

import signal
import socket
import subprocess
import sys
import threading
import time
from typing import Any

from dgpp.config import DeployConfig
from dgpp.log import get_logger

log = get_logger("dgpp.launch")
_LOCAL = {"127.0.0.1", "localhost", "::1"}


def local_ranks(cfg: DeployConfig) -> list[int]:
    """Ranks of ``cfg`` that run on this machine: all of them for ``world_size``, else the local ``nodes``."""
    if not cfg.nodes:
        return list(range(cfg.world))
    names = _LOCAL | {socket.gethostname(), socket.getfqdn()}
    return [r for r, node in enumerate(cfg.nodes) if node.rsplit("@", 1)[-1] in names]


def rank_command(config: str, rank: int, extra: list[str]) -> list[str]:
    return [sys.executable, "-m", "dgpp.cli", "serve", config, "--rank", str(rank), *extra]


def launch(config: str, cfg: DeployConfig, extra: list[str] | None = None, grace_s: float = 10.0) -> int:
    """Run the local ranks to completion; the world's exit code."""
    ranks = local_ranks(cfg)
    if not ranks:
        log.error("no rank of this world runs on this machine", nodes=cfg.nodes)
        return 1
    # a SIGTERM (a service manager's stop) ends the world like ^C; left unhandled it would kill the launcher
    # alone and leave every rank running, holding its ports
    handles_term = threading.current_thread() is threading.main_thread()  # signal handlers: main thread only
    previous = signal.signal(signal.SIGTERM, _interrupt) if handles_term else None
    try:
        procs = {r: subprocess.Popen(rank_command(config, r, extra or []), start_new_session=True) for r in ranks}
        log.info("launched", ranks=ranks, pids={r: p.pid for r, p in procs.items()})
        try:
            while all(p.poll() is None for p in procs.values()):
                time.sleep(0.2)
        except KeyboardInterrupt:
            if 0 in procs and procs[0].poll() is None:
                procs[0].send_signal(signal.SIGINT)
        _reap(procs, grace_s)
    finally:
        if handles_term:
            signal.signal(signal.SIGTERM, previous if previous is not None else signal.SIG_DFL)
    codes = {r: p.returncode for r, p in procs.items()}
    log.info("world ended", exit_codes=codes)
    if 0 in codes and codes[0] != 0:
        return codes[0]
    return next((c for _, c in sorted(codes.items()) if c != 0), 0)


def _interrupt(signum: int, frame: Any) -> None:
    raise KeyboardInterrupt


def _reap(procs: dict[int, subprocess.Popen], grace_s: float) -> None:
    """Wait up to ``grace_s`` for every rank, then kill the rest; a second ^C / SIGTERM kills them at once
    (the ranks are in sessions of their own: nothing else would reach them)."""
    deadline = time.monotonic() + grace_s
    try:
        for p in procs.values():
            try:
                p.wait(max(0.1, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                pass
    except KeyboardInterrupt:
        log.warning("interrupted again: killing the ranks")
    for p in procs.values():
        if p.poll() is None:
            p.kill()
            p.wait()
