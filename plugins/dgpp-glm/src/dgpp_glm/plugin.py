"""What the GLM plugin tells dgpp: one ``Family`` (its entry point names ``FAMILY``). References are
``"module:name"`` strings, imported on first use, so registering the plugin loads no torch."""

from __future__ import annotations

from dgpp.plugin_api import Family, FamilyModel

FAMILY = Family(
    name="glm",
    plugin="dgpp-glm",
    # every config.json value this family claims; a claimed value no model loads is "not yet supported"
    architectures=(
        "Glm4MoeForCausalLM",
        "Glm5NextForConditionalGeneration",
        "Glm5NextForCausalLM",
        "GlmMoeDsaForCausalLM",
    ),
    model_types=("glm4_moe", "glm5_next", "glm5_next_text", "glm_moe_dsa"),
    models=(
        # the MTP drafter's layout is read from the checkpoint's names, so GLM plans its own memory
        FamilyModel(
            claims=("Glm4MoeForCausalLM", "glm4_moe"),
            config="dgpp_glm.config:Glm4MoeArchConfig",
            model="dgpp_glm.model:Glm4MoeForCausalLM",
            renames="dgpp_glm.model:checkpoint_name",
            drafter="dgpp_glm.draft:build_draft",
            hooks={"memory_plan": "dgpp_glm.memory:memory_plan"},
        ),
        FamilyModel(
            claims=("GlmMoeDsaForCausalLM", "glm_moe_dsa"),
            config="dgpp_glm.glm5_config:GlmMoeDsaArchConfig",
            model="dgpp_glm.glm5:GlmMoeDsaForCausalLM",
            renames="dgpp_glm.model:checkpoint_name",
            drafter="dgpp_glm.glm5_draft:build_draft",
            hooks={"memory_plan": "dgpp_glm.memory:glm5_memory_plan"},
        ),
        FamilyModel(
            claims=("Glm5NextForConditionalGeneration", "Glm5NextForCausalLM", "glm5_next", "glm5_next_text"),
            config="dgpp_glm.glm5_next_config:Glm5NextArchConfig",
            model="dgpp_glm.glm5_next:Glm5NextForCausalLM",
            renames="dgpp_glm.glm5_next:checkpoint_name",
            drafter="dgpp_glm.glm5_next_draft:build_draft",
            # the release's tensor names decide what is packed: GLM-5.3-Flash loads and plans through its own hooks
            hooks={
                "load_model": "dgpp_glm.glm5_next_release:load_model",
                "memory_plan": "dgpp_glm.memory:glm5_next_memory_plan",
            },
        ),
    ),
    description="GLM-4.7 (glm4_moe), GLM-5.3-Flash (glm5_next), full GLM-5.3 (glm_moe_dsa)",
    dialect="dgpp_glm.dialect:dialect_for",
    image_input="dgpp_glm.glm5_next_images:image_input",
    chat_template="dgpp_glm.dialect:chat_template",
    templates_package=__name__,
    tiny_checkpoints="dgpp_glm.testing:tiny_checkpoints",
    bench_geometries="dgpp_glm.testing:bench_geometries",
)
