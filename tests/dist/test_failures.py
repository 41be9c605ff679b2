"""Failure semantics: an op-stream divergence on one rank stops the world naming the tick; a peer
killed with SIGKILL makes rank 0 answer /health 503 and end live streams with engine_failure."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import httpx
import torch.multiprocessing as mp
from tp_harness import deploy_dict, run_rank, write_served_deploy

from dgpp.testing.builders import build_tiny_checkpoint
from dgpp.testing.tokenizers import build_tiny_tokenizer


def _checkpoint(root: Path) -> Path:
    ckpt = build_tiny_checkpoint("qwen3", root / "ckpt", seed=3)
    build_tiny_tokenizer(ckpt)
    return ckpt


def test_divergence_on_one_rank_stops_the_world_naming_the_tick(tmp_path):
    ckpt = _checkpoint(tmp_path)
    # rank 1 appends a line of its own after tick 2: rank 0's fold in tick 3's record disagrees
    mp.spawn(run_rank, args=(deploy_dict(ckpt, 2), str(tmp_path), 2), nprocs=2, join=True)
    rank0, rank1 = (json.loads((tmp_path / f"rank{r}.json").read_text()) for r in range(2))
    assert rank1["exit"] == 3
    assert rank1["error"].startswith("op-stream divergence at tick 3: rank 1 folded")
    assert rank0["failed"].startswith("op-stream divergence at tick 3 (rank 1 folded")
    assert "digests" not in rank0


def _serve(config: Path, rank: int, log: Path) -> subprocess.Popen:
    cmd = [sys.executable, "-m", "dgpp.cli", "serve", str(config), "--rank", str(rank)]
    return subprocess.Popen(cmd, stdout=log.open("w"), stderr=subprocess.STDOUT)


def _wait_healthy(url: str, procs: list[subprocess.Popen], logs: list[Path], timeout: float = 180.0) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        for p, log in zip(procs, logs, strict=True):
            if p.poll() is not None:
                raise RuntimeError(f"rank exited with {p.returncode}:\n{log.read_text()}")
        try:
            if httpx.get(url + "/health", timeout=1.0).status_code == 200:
                return
        except httpx.HTTPError:
            pass
        time.sleep(0.3)
    raise RuntimeError("rank 0 never became healthy:\n" + "\n".join(log.read_text() for log in logs))


def test_peer_killed_gives_health_503_and_engine_failure_within_5s(tmp_path):
    ckpt = _checkpoint(tmp_path)
    config, port = write_served_deploy(tmp_path, ckpt, 2, kv_capacity=2048)
    logs = [tmp_path / f"rank{r}.log" for r in range(2)]
    procs = [_serve(config, r, logs[r]) for r in range(2)]
    url = f"http://127.0.0.1:{port}"
    try:
        _wait_healthy(url, procs, logs)
        body = {"model": str(ckpt), "prompt": "hello world", "max_tokens": 480, "stream": True,
                "ignore_eos": True, "temperature": 0}
        events: list[str] = []
        with httpx.stream("POST", url + "/v1/completions", json=body, timeout=30.0) as response:
            assert response.status_code == 200
            lines = response.iter_lines()
            for line in lines:  # a few tokens first: the stream is live
                if line.startswith("data: {"):
                    events.append(line)
                    if len(events) == 3:
                        break
            os.kill(procs[1].pid, signal.SIGKILL)
            killed = time.monotonic()
            events += [line for line in lines if line]
            ended = time.monotonic() - killed
        assert ended < 5.0, f"stream ended {ended:.1f} s after the kill"
        errors = [json.loads(e[6:]) for e in events if e.startswith("data: {") and '"error"' in e]
        assert errors and errors[-1]["error"]["code"] == "engine_failure", events[-3:]
        assert events[-1] == "data: [DONE]"
        health = httpx.get(url + "/health", timeout=2.0)
        assert health.status_code == 503 and "rank 1" in health.json()["error"]
        assert procs[0].wait(15) == 2  # rank 0 leaves with the engine-failure exit code, 2
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
                p.wait()


def test_rank0_killed_releases_the_peer_with_exit_3(tmp_path):
    ckpt = _checkpoint(tmp_path)
    config, port = write_served_deploy(tmp_path, ckpt, 2)
    logs = [tmp_path / f"rank{r}.log" for r in range(2)]
    procs = [_serve(config, r, logs[r]) for r in range(2)]
    try:
        _wait_healthy(f"http://127.0.0.1:{port}", procs, logs)
        os.kill(procs[0].pid, signal.SIGKILL)
        killed = time.monotonic()
        assert procs[1].wait(10) == 3
        assert time.monotonic() - killed < 5.0
        assert "rank 0 closed the journal" in logs[1].read_text()
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
                p.wait()
