"""Which memory plan a deployment gets: its family's model bytes (``dgpp_memory_plan``) when the plugin offers
them, else the generic estimate from config.json and the safetensors headers; sized by core either way."""

from __future__ import annotations

from typing import TYPE_CHECKING

from dgpp.family import LoadContext
from dgpp.startup.memory_estimate import estimate_model_memory
from dgpp.step.memory import MemoryPlan, ModelMemory, plan_memory

if TYPE_CHECKING:
    import pluggy


def plan_for(pm: pluggy.PluginManager, ctx: LoadContext) -> MemoryPlan:
    """The plan for ``ctx``: the plugin's ``ModelMemory`` (or a complete ``MemoryPlan`` it sized itself), else
    the generic estimate."""
    answer = pm.hook.dgpp_memory_plan(ctx=ctx)
    if isinstance(answer, MemoryPlan):
        return answer
    model = (
        answer
        if isinstance(answer, ModelMemory)
        else estimate_model_memory(ctx.checkpoint_dir, ctx.hf_config, ctx.engine, world_size=ctx.world.size)
    )
    return plan_memory(model, ctx.engine)
