"""The lossy prefill levers against the model: a lever with nothing to act on is refused by its key.

``engine.prefill_fp8_gemm`` acts on FP8 block-scaled linears (an FP8 checkpoint, or ``engine.dense_weights: fp8``)
and ``engine.prefill_bf16_partials`` on packed routed experts; turned on for a model without them, either would
be logged as a lossy lever while changing nothing, so startup refuses instead, once the model is loaded (which
modules hold packed weights is the loader's answer; ``dgpp check`` reads no weight).
"""

from __future__ import annotations

from torch import nn

from dgpp.config_schema import EngineConfig
from dgpp.errors import ConfigError
from dgpp.quant.fp8 import FP8Block
from dgpp.quant.linear import QuantLinearMethod
from dgpp.quant.moe import QuantExperts


def _has_fp8_linears(model: nn.Module) -> bool:
    methods = (getattr(m, "quant_method", None) for m in model.modules())
    return any(isinstance(q, QuantLinearMethod) and isinstance(q.fmt, FP8Block) for q in methods)


def refuse_idle_prefill_levers(engine_cfg: EngineConfig, model: nn.Module) -> None:
    """Raise ``ConfigError`` naming a prefill lever that is on although ``model`` has nothing it acts on
    (``engine.dense_weights: fp8`` gives the dense stack FP8 blocks at load, so it counts as FP8 linears)."""
    fp8 = engine_cfg.dense_weights == "fp8" or _has_fp8_linears(model)
    if engine_cfg.prefill_fp8_gemm and not fp8:
        raise ConfigError(
            "engine.prefill_fp8_gemm: the model has no FP8 block-scaled linear for it to act on (serve an FP8 "
            'checkpoint, or set engine.dense_weights: "fp8")'
        )
    if engine_cfg.prefill_bf16_partials and not any(isinstance(m, QuantExperts) for m in model.modules()):
        raise ConfigError(
            "engine.prefill_bf16_partials: the model has no packed routed experts for it to act on"
        )
