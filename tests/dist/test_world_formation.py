"""World formation: the settings handshake refuses a mismatched world by name; records keep sampling
floats bit-exact; the op-stream fold and digest; the progress watchdog."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch.multiprocessing as mp
from tp_harness import free_ports

from dgpp.config import parse_config
from dgpp.dist.channel import WorldError
from dgpp.dist.digest import OpStream
from dgpp.dist.records import Admission, Tick, decode, encode, params_from_wire, params_to_wire
from dgpp.dist.watchdog import ProgressWatchdog
from dgpp.dist.world import WorldSpec, form_world, settings_difference, settings_of
from dgpp.sample.params import SamplingParams


def _form(rank: int, raws: list[dict], out_dir: str) -> None:
    cfg = parse_config(raws[rank])
    try:
        world = form_world(WorldSpec.from_config(cfg, rank), settings_of(cfg), device="cpu")
    except WorldError as e:
        message = str(e)
    else:
        message = "formed"
        world.close()
    (Path(out_dir) / f"rank{rank}.txt").write_text(message)


def _raw(ports: dict, **engine) -> dict:
    return {
        "model": "/nonexistent/ckpt",
        "world_size": 2,
        "ports": ports,
        "engine": {"rendezvous_timeout_ms": 30000, **engine},
    }


def test_matching_world_forms_and_mismatched_config_digest_is_refused_by_name(tmp_path):
    ports = dict(zip(("fabric", "journal"), free_ports(2), strict=True))
    mp.spawn(_form, args=([_raw(ports), _raw(ports)], str(tmp_path)), nprocs=2, join=True)
    assert [(tmp_path / f"rank{r}.txt").read_text() for r in range(2)] == ["formed", "formed"]

    ports = dict(zip(("fabric", "journal"), free_ports(2), strict=True))
    raws = [_raw(ports, kv_capacity=4096), _raw(ports, kv_capacity=8192)]
    mp.spawn(_form, args=(raws, str(tmp_path)), nprocs=2, join=True)
    for rank in range(2):  # both sides refuse, naming the digest and the differing key
        message = (tmp_path / f"rank{rank}.txt").read_text()
        assert message.startswith("world refused: config digest"), message
        assert "engine.kv_capacity (4096 vs 8192)" in message


def test_settings_difference_names_version_and_model():
    ours = settings_of(parse_config({"model": "a", "world_size": 2}))
    theirs = dict(ours, version="0.0.0-other", model="b")
    text = settings_difference(ours, theirs, 1)
    assert "version" in text and "'a' on rank 0 vs 'b' on rank 1" in text
    assert settings_difference(ours, dict(ours), 1) is None


def test_rank_outside_world_is_refused():
    with pytest.raises(WorldError, match="--rank 2 is outside the world of 2"):
        WorldSpec.from_config(parse_config({"model": "a", "world_size": 2}), 2)


def test_tick_records_keep_sampling_bits_exact():
    params = SamplingParams(
        temperature=0.1 + 0.2,
        top_p=1 / 3,
        min_p=5e-324,
        logit_bias={7: -0.1, 2: 1e-300},
        seed=2**63 - 1,
        stop=("END",),
        max_tokens=9,
    )
    tick = Tick(
        n=4,
        od="00ff",
        s=[[Admission(id="r/0", choice=0, p=[1, 2, 3], sp=params_to_wire(params), gs=99)]],
        c=[("x/0", "stop")],
    )
    back = decode(encode(tick))
    assert back == tick
    assert params_from_wire(json.loads(json.dumps(back.s[0][0].sp))) == params


def test_op_stream_fold_tracks_every_line(tmp_path):
    a, b = OpStream(), OpStream(tmp_path / "ops.txt")
    for s in (a, b):
        s.add("A r/0 0 0 1,2")
        s.add("K r/0 17")
    assert a.fold == b.fold and a.full_digest() == b.full_digest()
    b.add("T 1")
    b.close()
    assert a.fold != b.fold
    assert (tmp_path / "ops.txt").read_text().splitlines()[-1] == "T 1"


class _Progress:
    tick = 7
    tick_started: float | None = None


def test_progress_watchdog_reports_a_stalled_tick():
    now = [100.0]
    progress = _Progress()
    dog = ProgressWatchdog(progress, 120.0, on_stall=lambda m: None, clock=lambda: now[0])
    assert dog.check() is None  # idle between ticks: nothing to watch
    progress.tick_started = 50.0
    assert dog.check() is None
    now[0] = 171.0
    assert dog.check() == "engine progress watchdog: tick 7 has made no progress for 121.0 s"


def test_progress_watchdog_thread_calls_on_stall_once_and_can_be_disarmed():
    import threading
    import time

    progress = _Progress()
    progress.tick_started = time.monotonic()
    stalls: list[str] = []
    called = threading.Event()
    stop = ProgressWatchdog(progress, 0.2, on_stall=lambda m: (stalls.append(m), called.set())).start(0.05)
    assert called.wait(5.0) and len(stalls) == 1 and stalls[0].startswith("engine progress watchdog: tick 7")
    stop.set()
    quiet = ProgressWatchdog(_Progress(), 0.2, on_stall=stalls.append).start(0.05)
    time.sleep(0.3)  # idle: nothing reported
    quiet.set()
    assert len(stalls) == 1


@pytest.mark.parametrize(
    "key,value,shown",
    [
        ("kv_dtype", "fp8", "('auto' vs 'fp8')"),
        ("kv_dtype", "fp4", "('auto' vs 'fp4')"),
        ("prefill_fp8_gemm", True, "(False vs True)"),
        ("prefill_bf16_partials", True, "(False vs True)"),
    ],
)
def test_a_lossy_lever_on_one_rank_only_is_refused_by_name(key, value, shown):
    """Every rank runs the same arithmetic: a lossy lever (the K/V format, fp8 or fp4 latents, a prefill lever) on one rank and not the
    other refuses the world, naming the key."""
    exact = settings_of(parse_config({"model": "a", "world_size": 2}))
    lossy = settings_of(parse_config({"model": "a", "world_size": 2, "engine": {key: value}}))
    text = settings_difference(exact, lossy, 1)
    assert text is not None and "config digest" in text and f"engine.{key} {shown}" in text
