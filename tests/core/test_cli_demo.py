"""``dgpp serve deploy/demo_tiny_cpu.json`` (the offline demo): starts with no GPU and no network,
builds the demo checkpoint on first use, and answers the README's OpenAI SDK example."""

from __future__ import annotations

import os
import socket
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

import pytest

DEMO = Path(__file__).resolve().parents[2] / "deploy" / "demo_tiny_cpu.json"


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.mark.e2e
def test_demo_serves_the_readme_example(tmp_path):
    port = free_port()
    env = {
        **os.environ,
        "DGPP_DEMO_DIR": str(tmp_path / "demo"),
        "CUDA_VISIBLE_DEVICES": "",
        "HF_HUB_OFFLINE": "1",
        "TRANSFORMERS_OFFLINE": "1",
        "NO_PROXY": "*",
        "http_proxy": "",
        "https_proxy": "",
    }
    log = open(tmp_path / "serve.log", "w")
    proc = subprocess.Popen(
        [sys.executable, "-m", "dgpp.cli", "serve", str(DEMO), "--port", str(port)],
        env=env,
        stdout=log,
        stderr=subprocess.STDOUT,
    )
    try:
        deadline = time.monotonic() + 240
        while True:
            assert proc.poll() is None, (tmp_path / "serve.log").read_text()
            try:
                with urllib.request.urlopen(f"http://127.0.0.1:{port}/health", timeout=2):
                    break
            except OSError:
                assert time.monotonic() < deadline, "demo server did not become healthy"
                time.sleep(0.5)
        from openai import OpenAI

        client = OpenAI(base_url=f"http://127.0.0.1:{port}/v1", api_key="unused")
        chunks = list(
            client.chat.completions.create(
                model="dgpp-demo",
                messages=[{"role": "user", "content": "Hello!"}],
                max_tokens=8,
                temperature=0,
                stream=True,
            )
        )
        streamed = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
        once = client.chat.completions.create(
            model="dgpp-demo", messages=[{"role": "user", "content": "Hello!"}], max_tokens=8, temperature=0
        )
        assert once.choices[0].message.content == streamed  # greedy: the same text streamed or not
        assert once.usage.completion_tokens >= 1
        assert (tmp_path / "demo" / "qwen3-tiny" / "config.json").is_file()
    finally:
        proc.terminate()
        try:
            proc.wait(timeout=30)
        except subprocess.TimeoutExpired:
            proc.kill()
        log.close()
