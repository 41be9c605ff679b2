"""Hook implementations only: what the Qwen plugin registers with dgpp."""

from __future__ import annotations

from dgpp.family import FamilySpec, LoadContext
from dgpp.hookspecs import hookimpl

FAMILY = "qwen"
# Every HF architecture / model_type this family claims, implemented or not yet.
ARCHITECTURES = (
    "Qwen3ForCausalLM",
    "Qwen3MoeForCausalLM",
    "Qwen3_5ForCausalLM",
    "Qwen3_5ForConditionalGeneration",
    "Qwen3_5MoeForCausalLM",
    "Qwen3_5MoeForConditionalGeneration",
    "Qwen4ExpForCausalLM",
    "Qwen4ExpForConditionalGeneration",
)
MODEL_TYPES = (
    "qwen3",
    "qwen3_moe",
    "qwen3_5",
    "qwen3_5_text",
    "qwen3_5_moe",
    "qwen3_5_moe_text",
    "qwen4_exp",
    "qwen4_exp_text",
)
# The claimed values this plugin can load today; the rest get a clear "not yet supported".
IMPLEMENTED: tuple[str, ...] = (
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
)


@hookimpl
def dgpp_families() -> list[FamilySpec]:
    return [
        FamilySpec(
            name=FAMILY,
            plugin="dgpp-qwen",
            architectures=ARCHITECTURES,
            model_types=MODEL_TYPES,
            implemented=IMPLEMENTED,
            description="Qwen3, Qwen3-MoE, Qwen3.5 / Qwen3.8-27B hybrids, Qwen3.5-122B-A10B MoE, Qwen3.8-Flash-Next (qwen4_exp)",
        )
    ]


@hookimpl
def dgpp_load_model(ctx: LoadContext):
    if ctx.family != FAMILY:
        return None
    from dgpp_qwen.loader import load_model

    return load_model(ctx)


@hookimpl
def dgpp_tool_dialect(family: str, hf_config: dict):
    if family != FAMILY:
        return None
    from dgpp_qwen.dialect import dialect_for

    return dialect_for(hf_config)


@hookimpl
def dgpp_chat_template(family: str, hf_config: dict) -> str | None:
    if family != FAMILY:
        return None
    from dgpp_qwen.dialect import chat_template

    return chat_template()


@hookimpl
def dgpp_build_draft(ctx: LoadContext, model):
    if ctx.family != FAMILY:
        return None
    from dgpp_qwen.draft import build_draft

    return build_draft(ctx, model)


@hookimpl
def dgpp_memory_plan(ctx: LoadContext):
    # qwen4_exp's indexer keys, PLE state and n-gram tables are outside the generic estimate; the other
    # Qwen models keep it (None lets it apply)
    if ctx.family != FAMILY or ctx.hf_config.get("model_type") not in ("qwen4_exp", "qwen4_exp_text"):
        return None
    from dgpp_qwen.qwen4_exp_memory import memory_plan

    return memory_plan(ctx)
