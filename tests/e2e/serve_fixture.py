"""Start ``dgpp serve`` on a tiny checkpoint in a child process, on a free loopback port."""

from __future__ import annotations

import json
import socket
import subprocess
import sys
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import httpx

from dgpp.testing.builders import build_tiny_checkpoint
from dgpp.testing.tokenizers import build_tiny_tokenizer


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def tiny_checkpoint(kind: str, root: Path) -> Path:
    ckpt = build_tiny_checkpoint(kind, root / kind)
    build_tiny_tokenizer(ckpt)  # tokenizer.json, chat template and eos ids next to the weights
    return ckpt


class Server:
    """A running ``dgpp serve`` child; ``url`` is its base, ``log`` its captured output file."""

    def __init__(self, checkpoint: Path, workdir: Path, engine: dict, http: dict | None = None) -> None:
        port = free_port()
        self.config = workdir / "deploy.json"
        self.config.write_text(
            json.dumps(
                {
                    "model": str(checkpoint),
                    "http": {"bind_host": "127.0.0.1", "port": port, **(http or {})},
                    "engine": engine,
                }
            )
        )
        cmd = [
            sys.executable,
            "-c",
            "import sys; from dgpp.cli import main; sys.exit(main())",
            "serve",
            str(self.config),
        ]
        self._start(cmd, port, workdir)

    @classmethod
    def command(cls, cmd: list[str], port: int, workdir: Path, **popen: Any) -> Server:
        """A server started by ``cmd`` (which must listen on ``port``), e.g. an installed ``dgpp`` script."""
        server = cls.__new__(cls)
        server._start(cmd, port, workdir, **popen)
        return server

    def _start(self, cmd: list[str], port: int, workdir: Path, **popen: Any) -> None:
        self.port = port
        self.url = f"http://127.0.0.1:{port}"
        self.log = workdir / "server.log"
        self._log_file = open(self.log, "w")  # noqa: SIM115 - closed in stop()
        self.proc = subprocess.Popen(cmd, stdout=self._log_file, stderr=subprocess.STDOUT, **popen)

    def wait_ready(self, timeout: float = 120.0) -> None:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"server exited with {self.proc.returncode}:\n{self.log.read_text()}")
            try:
                if httpx.get(self.url + "/health", timeout=1.0).status_code == 200:
                    return
            except httpx.HTTPError:
                pass
            time.sleep(0.2)
        raise RuntimeError(f"server not ready after {timeout}s:\n{self.log.read_text()}")

    def stop(self) -> None:
        self.proc.terminate()
        try:
            self.proc.wait(10)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()
        self._log_file.close()


@contextmanager
def running(checkpoint: Path, workdir: Path, engine: dict, http: dict | None = None) -> Iterator[Server]:
    """A ready ``Server``, stopped on exit."""
    server = Server(checkpoint, workdir, engine, http)
    try:
        server.wait_ready()
        yield server
    finally:
        server.stop()
