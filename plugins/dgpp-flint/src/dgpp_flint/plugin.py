"""Hook implementations only (``HOOKS``, a ``dgpp.plugin_api.FamilyHooks`` the entry point names): what the Flint plugin registers with dgpp."""

from __future__ import annotations

from dgpp.plugin_api import FamilyHooks, FamilySpec

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
    templates_package=__name__,
    tiny_checkpoints="dgpp_flint.testing:tiny_checkpoints",
)
