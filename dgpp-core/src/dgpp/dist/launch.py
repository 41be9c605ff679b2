"""Start every local rank of a world as its own process (``dgpp launch CONFIG``).

Each rank runs ``dgpp serve CONFIG --rank R``. ^C goes to rank 0 only (it journals the stop to the
peers); when any rank ends, the launcher waits for the rest and returns rank 0's exit code, or the
first failing one.
"""

from __future__ import annotations

import signal
import socket
import subprocess
import sys
import time
from typing import Any

from dgpp.log import get_logger

log = get_logger("dgpp.launch")
_LOCAL = {"127.0.0.1", "localhost", "::1"}


def local_ranks(cfg: Any) -> list[int]:
    """Ranks of ``cfg`` that run on this machine: all of them for ``world_size``, else the local ``nodes``."""
    if not cfg.nodes:
        return list(range(cfg.world))
    names = _LOCAL | {socket.gethostname(), socket.getfqdn()}
    return [r for r, node in enumerate(cfg.nodes) if node.rsplit("@", 1)[-1] in names]


def rank_command(config: str, rank: int, extra: list[str]) -> list[str]:
    return [sys.executable, "-m", "dgpp.cli", "serve", config, "--rank", str(rank), *extra]


def launch(config: str, cfg: Any, extra: list[str] | None = None, grace_s: float = 10.0) -> int:
    """Run the local ranks to completion; the world's exit code."""
    ranks = local_ranks(cfg)
    if not ranks:
        log.error("no rank of this world runs on this machine", nodes=cfg.nodes)
        return 1
    procs = {r: subprocess.Popen(rank_command(config, r, extra or [])) for r in ranks}
    log.info("launched", ranks=ranks, pids={r: p.pid for r, p in procs.items()})
    try:
        while all(p.poll() is None for p in procs.values()):
            time.sleep(0.2)
    except KeyboardInterrupt:
        if 0 in procs and procs[0].poll() is None:
            procs[0].send_signal(signal.SIGINT)
    deadline = time.monotonic() + grace_s
    for p in procs.values():
        try:
            p.wait(max(0.1, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            p.kill()
            p.wait()
    codes = {r: p.returncode for r, p in procs.items()}
    log.info("world ended", exit_codes=codes)
    if 0 in codes and codes[0] != 0:
        return codes[0]
    return next((c for _, c in sorted(codes.items()) if c != 0), 0)
