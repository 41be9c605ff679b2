"""Hook implementations only (``HOOKS``, a ``dgpp.plugin_api.FamilyHooks`` the entry point names): what the MiMo plugin registers with dgpp."""

from __future__ import annotations

from dgpp.plugin_api import FamilyHooks, FamilySpec

HOOKS = FamilyHooks(
    FamilySpec(
        name="mimo",
        plugin="dgpp-mimo",
        # every HF architecture / model_type this family claims, implemented or not yet
        architectures=(
            "MiMoV2FlashForCausalLM",
            "MiMoV2ForCausalLM",
        ),
        model_types=(
            "mimo_v2_flash",
            "mimo_v2",
        ),
        # the claimed values this plugin can load today; the rest get a clear "not yet supported"
        implemented=("MiMoV2FlashForCausalLM", "mimo_v2_flash", "MiMoV2ForCausalLM", "mimo_v2"),
        description="MiMo-V2-Flash (mimo_v2_flash), MiMo-V2.6-Flash (mimo_v2)",
    ),
    load_model="dgpp_mimo.loader:load_model",
    tool_dialect="dgpp_mimo.dialect:dialect_for",
    chat_template="dgpp_mimo.dialect:chat_template",
    memory_plan="dgpp_mimo.memory:memory_plan",
    build_model="dgpp_mimo.v26_loader:build_model",
    build_draft="dgpp_mimo.v26_loader:build_draft",
    templates_package=__name__,
    tiny_checkpoints="dgpp_mimo.testing:tiny_checkpoints",
    bench_geometries="dgpp_mimo.testing:bench_geometries",
)
