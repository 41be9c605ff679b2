"""The KV cache format against the loaded model: ``engine.kv_dtype: bf16`` must be the compute dtype.

``fp8`` (e4m3 rows with per-row scales) and ``fp4`` (packed MLA latents) are stored whatever the compute dtype, for
the cache entries whose attention reads them (``dgpp.step.cache_spec.stored_as`` refuses the others). What is left to
check needs the model's compute dtype, known once it is loaded.
"""

from __future__ import annotations

import torch

from dgpp.config_schema import EngineConfig
from dgpp.errors import ConfigError

_KV_NAMES = {"bf16": torch.bfloat16}


def refuse_unstored_kv(engine_cfg: EngineConfig, compute_dtype: torch.dtype) -> None:
    """Raise ``ConfigError`` for a named KV format that is not the compute dtype (K/V are stored in it)."""
    kv = engine_cfg.kv_dtype
    if kv in _KV_NAMES and _KV_NAMES[kv] != compute_dtype:
        raise ConfigError(
            f"engine.kv_dtype: {kv!r} is not the compute dtype, {str(compute_dtype).removeprefix('torch.')} "
            f'(the KV cache is stored in the compute dtype); use "auto"'
        )
