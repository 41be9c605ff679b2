"""What the Qwen plugin tells dgpp: one ``Family`` (its entry point names ``FAMILY``). References are
``"module:name"`` strings, imported on first use, so registering the plugin loads no torch."""

from __future__ import annotations

from dgpp.plugin_api import Family, FamilyModel

# chat checkpoints name their turn-end token only in generation_config.json, which the loads read: Qwen loads
# through its own hooks (core still builds the models for the bench)
FAMILY = Family(
    name="qwen",
    plugin="dgpp-qwen",
    # every config.json value this family claims; a claimed value no model loads is "not yet supported"
    architectures=(
        "Qwen3ForCausalLM",
        "Qwen3MoeForCausalLM",
        "Qwen3_5ForCausalLM",
        "Qwen3_5ForConditionalGeneration",
        "Qwen3_5MoeForCausalLM",
        "Qwen3_5MoeForConditionalGeneration",
        "Qwen4ExpForCausalLM",
        "Qwen4ExpForConditionalGeneration",
    ),
    model_types=(
        "qwen3",
        "qwen3_moe",
        "qwen3_5",
        "qwen3_5_text",
        "qwen3_5_moe",
        "qwen3_5_moe_text",
        "qwen4_exp",
        "qwen4_exp_text",
    ),
    models=(
        FamilyModel(
            claims=("Qwen3ForCausalLM", "Qwen3MoeForCausalLM", "qwen3", "qwen3_moe"),
            config="dgpp_qwen.config:QwenConfig",
            model="dgpp_qwen.qwen3:Qwen3ForCausalLM",
            hooks={
                "load_model": "dgpp_qwen.loader:load_model",
                "memory_plan": "dgpp_qwen.memory:estimated_memory",
            },
        ),
        FamilyModel(
            claims=(
                "Qwen3_5ForCausalLM",
                "Qwen3_5ForConditionalGeneration",
                "Qwen3_5MoeForCausalLM",
                "Qwen3_5MoeForConditionalGeneration",
                "qwen3_5",
                "qwen3_5_text",
                "qwen3_5_moe",
                "qwen3_5_moe_text",
            ),
            config="dgpp_qwen.config:QwenConfig",
            model="dgpp_qwen.qwen3_5:Qwen35ForCausalLM",
            drafter="dgpp_qwen.draft:build_draft",
            hooks={
                "load_model": "dgpp_qwen.loader:load_model",
                "memory_plan": "dgpp_qwen.memory:estimated_memory",
            },
        ),
        # Qwen3.8-Flash-Next: n-gram tables beside the weights, indexer keys and PLE state in its plan
        FamilyModel(
            claims=("Qwen4ExpForCausalLM", "Qwen4ExpForConditionalGeneration", "qwen4_exp", "qwen4_exp_text"),
            config="dgpp_qwen.qwen4_exp_config:Qwen4ExpConfig",
            model="dgpp_qwen.qwen4_exp:Qwen4ExpForCausalLM",
            drafter="dgpp_qwen.draft:build_draft",
            hooks={
                "load_model": "dgpp_qwen.loader:load_qwen4_exp",
                "memory_plan": "dgpp_qwen.memory:memory_plan",
            },
        ),
    ),
    description="Qwen3, Qwen3-MoE, Qwen3.5 / Qwen3.8-27B hybrids, Qwen3.5-122B-A10B MoE, Qwen3.8-Flash-Next (qwen4_exp)",
    dialect="dgpp_qwen.dialect:dialect_for",
    chat_template="dgpp_qwen.dialect:chat_template",
    templates_package=__name__,
    tiny_checkpoints="dgpp_qwen.testing:tiny_checkpoints",
    image_input="dgpp_qwen.qwen4_exp_images:image_input",
    bench_geometries="dgpp_qwen.testing:bench_geometries",
)
