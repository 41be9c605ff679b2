"""Engine keys the serving path accepts but does not act on yet: refused when lossy, otherwise warned.

``dgpp.config`` validates the full key set of the original engine so templates stay portable, but some
levers have no implementation behind them in this build. Serving with one silently would mislead: a
template asking for an FP8 KV cache would get the compute dtype (and a memory plan that counted FP8 bytes),
and ``engine.mtp_schedule: true`` would give no confidence schedule while the log said nothing.
"""

from __future__ import annotations

from typing import Any

import structlog
import torch

from dgpp.config_schema import EngineConfig
from dgpp.errors import ConfigError

log = structlog.get_logger("dgpp.serve")

_KV_NAMES = {"bf16": torch.bfloat16}
# key -> the value at which it has no effect; any other value is accepted by the config but ignored here
INERT_KEYS: dict[str, Any] = {
    "mtp_schedule": False,
    "mtp_draft": "auto",  # drafts are always the drafter's argmax (exact for the output distribution)
    "mtp_draft_temperature": 1.0,
    "mtp_expert_format": "fp8",  # drafter experts are kept in the checkpoint's own format
    "prefill_group": True,
    "fp8_head": "gemv",
    "graph_batch_min_live": 0,  # decode graphs batch every decode-only step; there is no per-slot mode
    "sampling_candidates": 128,  # the sampler works on the full row (dgpp.sample), no candidate table
    "prefill_bf16_partials": False,
    "prefill_fold_scales": False,
    "prefill_fp8_gemm": False,
    "prefill_fp8_per_tensor": False,
}


def check_engine_keys(engine_cfg: EngineConfig, compute_dtype: torch.dtype | None = None) -> list[str]:
    """Raise ``ConfigError`` for a KV format this build cannot store; return (and log) the set keys that
    have no effect here. Before the model is loaded ``compute_dtype`` is None and only the formats that are
    never stored (fp8, fp4) are refused, so a refusal costs no weight loading."""
    refuse_unstored_kv(engine_cfg, compute_dtype)
    if compute_dtype is not None:
        return []  # the second call (after loading) only checks the KV dtype against the model's
    inert = [key for key, off in INERT_KEYS.items() if getattr(engine_cfg, key) != off]
    for key in inert:
        log.warning("engine key has no effect in this build", key=f"engine.{key}", value=getattr(engine_cfg, key))
    return inert


def refuse_unstored_kv(engine_cfg: EngineConfig, compute_dtype: torch.dtype | None = None) -> None:
    """Raise ``ConfigError`` for a KV format this build cannot store (``dgpp check`` and ``dgpp serve`` alike)."""
    kv = engine_cfg.kv_dtype
    named = _KV_NAMES.get(kv)
    if kv != "auto" and (named is None or (compute_dtype is not None and named != compute_dtype)):
        where = f", {str(compute_dtype).removeprefix('torch.')}" if compute_dtype is not None else ""
        raise ConfigError(
            f"engine.kv_dtype: {kv!r} is not implemented by this build (the KV cache is stored in the compute "
            f"dtype{where}); use \"auto\""
        )
