"""Hook implementations only (``HOOKS``, a ``dgpp.plugin_api.FamilyHooks`` the entry point names): what the Qwen plugin registers with dgpp."""

from __future__ import annotations

from dgpp.plugin_api import FamilyHooks, FamilySpec

HOOKS = FamilyHooks(
    FamilySpec(
        name="qwen",
        plugin="dgpp-qwen",
        # every HF architecture / model_type this family claims, implemented or not yet
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
        # the claimed values this plugin can load today; the rest get a clear "not yet supported"
        implemented=(
            # Qwen3 / Qwen3-MoE (dgpp_qwen.qwen3)
            "Qwen3ForCausalLM",
            "Qwen3MoeForCausalLM",
            "qwen3",
            "qwen3_moe",
            # Qwen3.5 hybrids (dgpp_qwen.qwen3_5)
            "Qwen3_5ForCausalLM",
            "Qwen3_5ForConditionalGeneration",
            "Qwen3_5MoeForCausalLM",
            "Qwen3_5MoeForConditionalGeneration",
            "qwen3_5",
            "qwen3_5_text",
            "qwen3_5_moe",
            "qwen3_5_moe_text",
            # Qwen3.8-Flash-Next (dgpp_qwen.qwen4_exp)
            "Qwen4ExpForCausalLM",
            "Qwen4ExpForConditionalGeneration",
            "qwen4_exp",
            "qwen4_exp_text",
        ),
        description="Qwen3, Qwen3-MoE, Qwen3.5 / Qwen3.8-27B hybrids, Qwen3.5-122B-A10B MoE, Qwen3.8-Flash-Next (qwen4_exp)",
    ),
    load_model="dgpp_qwen.loader:load_model",
    build_model="dgpp_qwen.loader:build_unloaded",
    tool_dialect="dgpp_qwen.dialect:dialect_for",
    chat_template="dgpp_qwen.dialect:chat_template",
    build_draft="dgpp_qwen.draft:build_draft",
    memory_plan="dgpp_qwen.memory:memory_plan",
    # qwen4_exp's indexer keys, PLE state and n-gram tables are outside the generic memory estimate; the other
    # Qwen models keep it (the hook returns None for them)
    only_model_types={"memory_plan": ("qwen4_exp", "qwen4_exp_text")},
    templates_package=__name__,
    tiny_checkpoints="dgpp_qwen.testing:tiny_checkpoints",
    bench_geometries="dgpp_qwen.testing:bench_geometries",
)
