"""Engine keys accepted by the config but not implemented by the serving path: refused or warned, never silent."""

from __future__ import annotations

import pytest
import structlog
import torch

from dgpp.config import EngineConfig
from dgpp.engine.keys import INERT_KEYS, check_engine_keys
from dgpp.errors import ConfigError


@pytest.mark.parametrize("kv", ["fp8", "fp4"])
def test_quantized_kv_cache_is_refused_before_loading(kv) -> None:
    with pytest.raises(ConfigError, match=f"engine.kv_dtype: '{kv}' is not implemented"):
        check_engine_keys(EngineConfig(kv_dtype=kv))


def test_bf16_kv_must_match_the_compute_dtype() -> None:
    cfg = EngineConfig(kv_dtype="bf16")
    assert check_engine_keys(cfg) == []  # not known yet before loading
    check_engine_keys(cfg, torch.bfloat16)
    with pytest.raises(ConfigError, match="compute dtype, float32"):
        check_engine_keys(cfg, torch.float32)
    check_engine_keys(EngineConfig(), torch.float32)  # auto is always fine


def test_defaults_have_no_inert_keys_and_set_ones_are_warned() -> None:
    assert check_engine_keys(EngineConfig()) == []
    assert all(getattr(EngineConfig(), key) == off for key, off in INERT_KEYS.items())
    with structlog.testing.capture_logs() as logs:
        inert = check_engine_keys(EngineConfig(mtp=True, mtp_schedule=True, prefill_fp8_gemm=True))
    assert inert == ["mtp_schedule", "prefill_fp8_gemm"]  # engine.mtp is implemented (dgpp.engine.speculative)
    assert [e["key"] for e in logs if e["event"] == "engine key has no effect in this build"] == [
        "engine.mtp_schedule", "engine.prefill_fp8_gemm"]


def test_drafter_keys_nothing_reads_are_warned() -> None:
    inert = check_engine_keys(EngineConfig(mtp=True, mtp_draft="sampled", mtp_expert_format="bf16"))
    assert inert == ["mtp_draft", "mtp_expert_format"]
