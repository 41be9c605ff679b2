"""``dgpp launch`` on one machine: both ranks start, rank 0 serves (plain completions and a json_schema
chat, whose grammar constraint the peer builds from the journal), ^C ends the world in order with every
rank's op-stream digest equal (exit 0)."""

from __future__ import annotations

import json
import re
import signal
import subprocess
import sys

import httpx
import jsonschema
from constrained_rank import SCHEMA
from test_failures import _checkpoint, _wait_healthy
from tp_harness import write_served_deploy


def test_launch_serves_and_stops_with_equal_digests(tmp_path):
    ckpt = _checkpoint(tmp_path)
    config, port = write_served_deploy(tmp_path, ckpt, 2)
    log = tmp_path / "launch.log"
    proc = subprocess.Popen([sys.executable, "-m", "dgpp.cli", "launch", str(config)],
                            stdout=log.open("w"), stderr=subprocess.STDOUT)
    url = f"http://127.0.0.1:{port}"
    try:
        _wait_healthy(url, [proc], [log])
        for prompt in ("one two", "three"):
            body = {"model": str(ckpt), "prompt": prompt, "max_tokens": 6, "temperature": 0}
            answer = httpx.post(url + "/v1/completions", json=body, timeout=60.0)
            assert answer.status_code == 200, answer.text
        # a constrained chat: the peer compiles the journaled spec (a missing mask would diverge the world)
        chat = {"model": str(ckpt), "messages": [{"role": "user", "content": "JSON please"}], "max_tokens": 96,
                "temperature": 1.0, "seed": 7, "response_format": {"type": "json_schema", "json_schema": {
                    "name": "answer", "schema": SCHEMA, "strict": True}},
                "chat_template_kwargs": {"enable_thinking": False}}
        answer = httpx.post(url + "/v1/chat/completions", json=chat, timeout=60.0)
        assert answer.status_code == 200, answer.text
        choice = answer.json()["choices"][0]
        assert choice["finish_reason"] == "stop", choice
        jsonschema.validate(json.loads(choice["message"]["content"]), SCHEMA)
        proc.send_signal(signal.SIGINT)
        assert proc.wait(60) == 0, log.read_text()
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    text = log.read_text()
    pairs = re.findall(r"op stream\s.*?md5=(\w+) rank=(\d)", text)
    assert {rank for _, rank in pairs} == {"0", "1"}, text[-2000:]
    assert len({md5 for md5, _ in pairs}) == 1, pairs
