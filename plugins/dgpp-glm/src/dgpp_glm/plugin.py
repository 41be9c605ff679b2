"""Hook implementations only (``HOOKS``, a ``dgpp.plugin_api.FamilyHooks`` the entry point names): what the GLM plugin registers with dgpp."""

from __future__ import annotations

from dgpp.plugin_api import FamilyHooks, FamilySpec

HOOKS = FamilyHooks(
    FamilySpec(
        name="glm",
        plugin="dgpp-glm",
        # every HF architecture / model_type this family claims, implemented or not yet
        architectures=(
            "Glm4MoeForCausalLM",
            "Glm5NextForConditionalGeneration",
            "Glm5NextForCausalLM",
            "GlmMoeDsaForCausalLM",
        ),
        model_types=(
            "glm4_moe",
            "glm5_next",
            "glm5_next_text",
            "glm_moe_dsa",
        ),
        # the claimed values this plugin can load today; the rest get a clear "not yet supported"
        implemented=("Glm4MoeForCausalLM", "glm4_moe", "GlmMoeDsaForCausalLM", "glm_moe_dsa"),
        description="GLM-4.7 (glm4_moe), GLM-5.3-Flash (glm5_next), full GLM-5.3 (glm_moe_dsa)",
    ),
    load_model="dgpp_glm.glm5_loader:load_model",  # GLM-5.3 here, the rest via loader.py
    tool_dialect="dgpp_glm.dialect:dialect_for",
    chat_template="dgpp_glm.dialect:chat_template",
    build_draft="dgpp_glm.glm5_draft:build_draft",  # GLM-5.3 here, the rest via draft.py
    memory_plan="dgpp_glm.glm5_memory:memory_plan",  # GLM-5.3 here, the rest via memory.py
    templates_package=__name__,
    tiny_checkpoints="dgpp_glm.testing:tiny_checkpoints",
    bench_geometries="dgpp_glm.testing:bench_geometries",
)
