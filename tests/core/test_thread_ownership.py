"""Each thread runs its own layers: a streamed chat completion runs the scheduler, the samplers and the model on
the step loop's thread only, the HTTP and text layers on the event loop's side only, and the two meet in one
file, ``sched/thread_handoff.py``."""

from __future__ import annotations

import sys
import threading
from collections import defaultdict
from pathlib import Path

from litestar.testing import TestClient

import dgpp
from dgpp.config import EngineConfig
from dgpp.serve.app import build_app
from dgpp.testing.tokenizers import build_tiny_tokenizer
from dgpp.testing.toy_backend import build_toy_backend

CORE = Path(dgpp.__file__).parent
STEP_LOOP = "dgpp-step-loop"
BODY = {
    "model": "toy/model",
    "messages": [{"role": "user", "content": "What is the capital of France?"}],
    "max_tokens": 8,
    "temperature": 0,
    "stream": True,
    "chat_template_kwargs": {"enable_thinking": False},
}


def test_the_threads_share_only_the_hand_off(tmp_path) -> None:
    recording = False
    files: dict[str, set[str]] = defaultdict(set)

    def hook(frame, event, arg):  # noqa: ANN001, ANN202 - sys.setprofile's signature
        if recording and event == "call" and frame.f_code.co_filename.startswith(str(CORE)):
            files[threading.current_thread().name].add(
                Path(frame.f_code.co_filename).relative_to(CORE).as_posix()
            )

    threading.setprofile(hook)  # the step loop's thread and the test client's event loop start after this
    sys.setprofile(hook)
    try:
        engine = build_toy_backend(
            "toy/model",
            build_tiny_tokenizer(tmp_path),
            EngineConfig(kv_capacity=512, block_size=4, stats_interval_s=0),
        )
        with TestClient(app=build_app(engine), base_url="http://dgpp.local") as client:
            assert client.post("/v1/chat/completions", json=BODY).status_code == 200  # lazy imports run here
            recording = True
            answer = client.post("/v1/chat/completions", json=BODY)
            recording = False
        engine.shutdown()
    finally:
        sys.setprofile(None)
        threading.setprofile(None)  # type: ignore[arg-type]
    assert answer.status_code == 200 and b"[DONE]" in answer.content
    step = files.pop(STEP_LOOP)
    http = set().union(*files.values())
    assert step & http == {"sched/thread_handoff.py"}
    assert {"sched/scheduler.py", "sched/step_loop.py", "sample/sampler.py"} <= step
    assert not {f for f in http if f.startswith(("sched/", "sample/", "engine/"))} - {
        "sched/thread_handoff.py"
    }
    assert {"serve/output_processor.py", "serve/generation.py", "text/tokenizer.py"} <= http
    assert not {f for f in step if f.startswith(("serve/", "text/"))}
