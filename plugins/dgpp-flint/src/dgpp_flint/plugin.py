"""Hook implementations only (built by ``dgpp.family_hooks.FamilyHooks``): what the Flint plugin registers with dgpp."""

from __future__ import annotations

from dgpp.family import FamilySpec
from dgpp.family_hooks import FamilyHooks

HOOKS = FamilyHooks(
    FamilySpec(
        name="flint",
        plugin="dgpp-flint",
        # every HF architecture / model_type this family claims, implemented or not yet
        architectures=("FlintForCausalLM",),
        model_types=("flint",),
        # the claimed values this plugin can load today; the rest get a clear "not yet supported"
        implemented=("FlintForCausalLM", "flint"),
        description="Flint (flint)",
    ),
    load_model="dgpp_flint.loader:load_model",
    tool_dialect="dgpp_flint.dialect:dialect_for",
    chat_template="dgpp_flint.dialect:chat_template",
    memory_plan="dgpp_flint.memory:memory_plan",
)
globals().update(HOOKS.hookimpls())  # pluggy registers this module's dgpp_* attributes
