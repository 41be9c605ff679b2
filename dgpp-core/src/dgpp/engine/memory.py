"""The memory plan where the engine imports it from (defined in ``dgpp.step.memory``, below the plugin
contract whose ``dgpp_memory_plan`` hook returns a ``ModelMemory``)."""

from __future__ import annotations

from dgpp.step.memory import (
    DEFAULT_HEADROOM,
    GiB,
    MemoryPlan,
    ModelMemory,
    cache_rates,
    format_bytes,
    free_memory_bytes,
    plan_memory,
    prefill_rows,
    transformer_activation_bytes,
)

__all__ = [
    "DEFAULT_HEADROOM",
    "GiB",
    "MemoryPlan",
    "ModelMemory",
    "cache_rates",
    "format_bytes",
    "free_memory_bytes",
    "plan_memory",
    "prefill_rows",
    "transformer_activation_bytes",
]
