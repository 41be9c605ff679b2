"""The prefill levers as deployment keys: off by default, listed among the lossy levers (``dgpp check``, the digest),
refused beside ``engine.batch_invariant`` and, when the model loads, on a model they cannot act on;
``engine.prefill_fold_scales`` stays refused with its reason."""

from __future__ import annotations

import json

import pytest

from dgpp.bench.prefill_levers import FP8_BLOCKS
from dgpp.cli import main
from dgpp.config import EngineConfig, parse_config
from dgpp.errors import ConfigError
from dgpp.quant.checkpoints import quantize_checkpoint
from dgpp.testing.builders import build_tiny_checkpoint

LEVERS = ("prefill_bf16_partials", "prefill_fp8_gemm")


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory):
    root = tmp_path_factory.mktemp("levers")
    dense = build_tiny_checkpoint("qwen3", root / "dense", seed=3)
    return {"dense": dense, "fp8": quantize_checkpoint(dense, root / "fp8", FP8_BLOCKS)}


def _check(tmp_path, model, **engine) -> int:
    path = tmp_path / "t.json"
    path.write_text(json.dumps({"model": str(model), "engine": engine}))
    return main(["check", str(path)])


def test_levers_are_off_by_default_and_listed_when_on():
    assert not any(lever in EngineConfig().lossy_levers() for lever in LEVERS)
    for lever in LEVERS:
        assert EngineConfig(**{lever: True}).lossy_levers() == [lever]


@pytest.mark.parametrize("lever", LEVERS)
def test_a_lever_beside_batch_invariance_is_refused_by_name(lever):
    with pytest.raises(ConfigError, match=f"engine.{lever}: engine.batch_invariant computes every row"):
        parse_config({"model": "m", "engine": {lever: True, "batch_invariant": True}})


def test_fold_scales_is_refused_with_why():
    with pytest.raises(
        ConfigError, match="engine.prefill_fold_scales: not built in this engine .*already multiplies"
    ):
        parse_config({"model": "m", "engine": {"prefill_fold_scales": True}})


def test_check_lists_the_fp8_gemm_lever_on_an_fp8_checkpoint(tmp_path, checkpoints, capsys):
    assert _check(tmp_path, checkpoints["fp8"], prefill_fp8_gemm=True) == 0
    assert "lossy levers prefill_fp8_gemm" in capsys.readouterr().out
    assert _check(tmp_path, checkpoints["dense"], dense_weights="fp8", prefill_fp8_gemm=True) == 0
    assert "lossy levers dense_weights, prefill_fp8_gemm" in capsys.readouterr().out


@pytest.mark.parametrize(
    "lever,why",
    [("prefill_fp8_gemm", "no FP8 block-scaled linear"), ("prefill_bf16_partials", "no packed routed")],
)
def test_startup_refuses_a_lever_with_nothing_to_act_on(checkpoints, lever, why):
    from dgpp.server_assembly import build_backend

    cfg = parse_config({"model": str(checkpoints["dense"]), "engine": {lever: True}})
    with pytest.raises(ConfigError, match=f"engine.{lever}: the model has {why}"):
        build_backend(cfg, device="cpu", start_loop=False)
