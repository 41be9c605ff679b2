"""``dgpp launch``'s signal handling with stand-in ranks (no model): a terminal ^C, which reaches the whole
foreground process group, is delivered to rank 0 once and never to a peer; a SIGTERM to the launcher ends the
world the same way instead of leaving the ranks running."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest

# a rank: records every SIGINT it gets; rank 0 ends on one, a peer ends once rank 0 has (as a follower would)
RANK = textwrap.dedent("""
    import os, signal, sys, time
    from pathlib import Path
    out, rank = Path(sys.argv[1]), int(sys.argv[2])
    def on_int(signum, frame):
        with open(out / f"sigint{rank}", "a") as f:
            f.write("x")
    signal.signal(signal.SIGINT, on_int)
    (out / f"pid{rank}").write_text(str(os.getpid()))
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline:
        if (out / ("sigint0" if rank == 0 else "done0")).exists():
            break
        time.sleep(0.05)
    time.sleep(0.3)  # a second signal, if one comes, lands before we leave
    if rank == 0:
        (out / "done0").write_text("")
""")

DRIVER = textwrap.dedent("""
    import sys, types
    from dgpp.dist import launch as L
    out = sys.argv[1]
    L.rank_command = lambda config, rank, extra: [sys.executable, out + "/rank.py", out, str(rank)]
    sys.exit(L.launch("unused.json", types.SimpleNamespace(world=2, nodes=[]), grace_s=20.0))
""")


def _start(tmp_path: Path) -> subprocess.Popen:
    (tmp_path / "rank.py").write_text(RANK)
    (tmp_path / "driver.py").write_text(DRIVER)
    # its own session: the test can signal its process group as a terminal would
    proc = subprocess.Popen([sys.executable, str(tmp_path / "driver.py"), str(tmp_path)], start_new_session=True,
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    deadline = time.monotonic() + 60
    while not all((tmp_path / f"pid{r}").exists() for r in range(2)):
        assert proc.poll() is None and time.monotonic() < deadline, "the stand-in ranks did not start"
        time.sleep(0.05)
    time.sleep(0.3)  # the launcher is in its poll loop, the ranks' handlers are installed
    return proc


def _cleanup(proc: subprocess.Popen, tmp_path: Path) -> None:
    for r in range(2):
        pid_file = tmp_path / f"pid{r}"
        if pid_file.exists():
            try:
                os.kill(int(pid_file.read_text()), signal.SIGKILL)
            except ProcessLookupError:
                pass
    if proc.poll() is None:
        proc.kill()
        proc.wait()


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    return True


@pytest.mark.parametrize("how", ["terminal ^C", "SIGTERM"])
def test_only_rank_0_is_interrupted_and_the_world_ends(tmp_path, how):
    proc = _start(tmp_path)
    try:
        if how == "terminal ^C":
            os.killpg(proc.pid, signal.SIGINT)  # what a terminal does on ^C
        else:
            proc.send_signal(signal.SIGTERM)
        assert proc.wait(30) == 0
        pids = [int((tmp_path / f"pid{r}").read_text()) for r in range(2)]
        deadline = time.monotonic() + 5
        while any(map(_alive, pids)) and time.monotonic() < deadline:
            time.sleep(0.05)
        assert not any(map(_alive, pids)), "a rank outlived the launcher"
        assert (tmp_path / "sigint0").read_text() == "x"  # once: not the terminal's and the launcher's
        assert not (tmp_path / "sigint1").exists()  # peers end on rank 0's stop, never on ^C
    finally:
        _cleanup(proc, tmp_path)
