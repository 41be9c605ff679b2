#!/usr/bin/env python3
"""Which product files run Python for one request, on which thread: a real ``dgpp serve`` with a profile hook on
every thread, one streamed chat completion through the ``openai`` client.

    python scripts/trace_request.py [CONFIG] [--port N] [--json OUT]

CONFIG defaults to the tiny offline demo (``deploy/demo_tiny_cpu.json``). A first request runs untraced (lazy
imports and first compiles are not the request's path); the second is traced from before it is sent until
after its last chunk arrived. Prints each thread's files (under ``dgpp-core/src``, ``plugins/``, ``examples/``),
the files that run on more than one thread, and the counts. Not part of the test suite.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
SOURCES = ("dgpp-core/src", "plugins", "examples")


def _served() -> None:
    """The server side (``--served``): record files per thread between SIGUSR1 and SIGUSR2, then run dgpp."""
    import threading
    from collections import defaultdict

    roots = tuple(str(ROOT / s) for s in SOURCES)
    recording = False
    seen: dict[str, set[str]] = defaultdict(set)

    def hook(frame, event, arg):  # noqa: ANN001, ANN202 - sys.setprofile's signature
        if recording and event == "call" and frame.f_code.co_filename.startswith(roots):
            seen[threading.current_thread().name].add(os.path.relpath(frame.f_code.co_filename, ROOT))

    def start(*_: object) -> None:
        nonlocal recording
        seen.clear()
        recording = True

    def stop(*_: object) -> None:
        nonlocal recording
        recording = False
        Path(os.environ["DGPP_TRACE_OUT"]).write_text(json.dumps({k: sorted(v) for k, v in seen.items()}))

    signal.signal(signal.SIGUSR1, start)
    signal.signal(signal.SIGUSR2, stop)
    sys.setprofile(hook)
    threading.setprofile(hook)  # threads started from here on (the step loop, the preparation pool)
    from dgpp.cli import main

    sys.exit(main(sys.argv[2:]))


def _chat(url: str) -> int:
    from openai import OpenAI

    client = OpenAI(base_url=f"{url}/v1", api_key="unused")
    stream = client.chat.completions.create(
        model=client.models.list().data[0].id,
        messages=[{"role": "user", "content": "What is the capital of France?"}],
        max_tokens=16,
        temperature=0,
        stream=True,
    )
    return sum(1 for _ in stream)


def main() -> int:
    if sys.argv[1:2] == ["--served"]:
        _served()
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("config", nargs="?", default=str(ROOT / "deploy/demo_tiny_cpu.json"))
    ap.add_argument("--port", type=int, default=18199)
    ap.add_argument("--json", help="also write the files per thread here")
    args = ap.parse_args()
    url = f"http://127.0.0.1:{args.port}"
    with tempfile.TemporaryDirectory() as tmp:
        out = Path(tmp) / "trace.json"
        server = subprocess.Popen(
            [sys.executable, __file__, "--served", "serve", args.config, "--port", str(args.port)],
            env={**os.environ, "DGPP_TRACE_OUT": str(out)},
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
        )
        try:
            import httpx

            for _ in range(600):
                try:
                    if httpx.get(f"{url}/health", timeout=1).status_code == 200:
                        break
                except httpx.HTTPError:
                    pass
                time.sleep(0.5)
            _chat(url)
            server.send_signal(signal.SIGUSR1)
            time.sleep(0.5)
            chunks = _chat(url)
            time.sleep(0.5)
            server.send_signal(signal.SIGUSR2)
            for _ in range(100):
                if out.exists():
                    break
                time.sleep(0.1)
            by_thread: dict[str, list[str]] = json.loads(out.read_text())
        finally:
            server.terminate()
            server.wait(30)
    files = sorted({f for fs in by_thread.values() for f in fs})
    shared = [f for f in files if sum(f in fs for fs in by_thread.values()) > 1]
    for thread, fs in sorted(by_thread.items()):
        print(f"{thread}: {len(fs)} files")
        for f in fs:
            print(f"  {f}")
    print(f"on more than one thread: {', '.join(shared) or 'none'}")
    core = sum(f.startswith("dgpp-core/") for f in files)
    print(
        f"{chunks} chunks; {len(files)} files ({core} core), "
        + ", ".join(f"{t} {len(fs)}" for t, fs in sorted(by_thread.items()))
        + f", {len(shared)} on more than one"
    )
    if args.json:
        Path(args.json).write_text(json.dumps(by_thread, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
