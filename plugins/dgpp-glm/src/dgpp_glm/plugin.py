"""Hook implementations only: what the GLM plugin registers with dgpp."""

from __future__ import annotations

from dgpp.family import FamilySpec, LoadContext
from dgpp.hookspecs import hookimpl

FAMILY = "glm"
# Every HF architecture / model_type this family claims, implemented or not yet.
ARCHITECTURES = (
    "Glm4MoeForCausalLM",
    "Glm5NextForConditionalGeneration",
    "Glm5NextForCausalLM",
    "GlmMoeDsaForCausalLM",
)
MODEL_TYPES = (
    "glm4_moe",
    "glm5_next",
    "glm5_next_text",
    "glm_moe_dsa",
)
# The claimed values this plugin can load today; the rest get a clear "not yet supported".
IMPLEMENTED: tuple[str, ...] = ("Glm4MoeForCausalLM", "glm4_moe")


@hookimpl
def dgpp_families() -> list[FamilySpec]:
    return [
        FamilySpec(
            name=FAMILY,
            plugin="dgpp-glm",
            architectures=ARCHITECTURES,
            model_types=MODEL_TYPES,
            implemented=IMPLEMENTED,
            description="GLM-4.7 (glm4_moe), GLM-5.3-Flash (glm5_next), full GLM-5.3 (glm_moe_dsa)",
        )
    ]


@hookimpl
def dgpp_load_model(ctx: LoadContext):
    if ctx.family != FAMILY:
        return None
    from dgpp_glm.loader import load_model

    return load_model(ctx)


@hookimpl
def dgpp_tool_dialect(family: str, hf_config: dict):
    if family != FAMILY:
        return None
    from dgpp_glm.dialect import dialect_for

    return dialect_for(hf_config)


@hookimpl
def dgpp_chat_template(family: str, hf_config: dict) -> str | None:
    if family != FAMILY:
        return None
    from dgpp_glm.dialect import chat_template

    return chat_template()


@hookimpl
def dgpp_build_draft(ctx: LoadContext, model):
    if ctx.family != FAMILY:
        return None
    from dgpp_glm.draft import build_draft

    return build_draft(ctx, model)


@hookimpl
def dgpp_memory_plan(ctx: LoadContext):
    if ctx.family != FAMILY:
        return None
    from dgpp_glm.memory import memory_plan

    return memory_plan(ctx)
