"""Hook implementations only: what the DeepSeek plugin registers with dgpp."""

from __future__ import annotations

from dgpp.family import FamilySpec, LoadContext
from dgpp.hookspecs import hookimpl

FAMILY = "deepseek"
# Every HF architecture / model_type this family claims, implemented or not yet.
ARCHITECTURES = (
    "DeepseekV4ForCausalLM",
    "DeepseekV41ForCausalLM",
)
MODEL_TYPES = (
    "deepseek_v4",
    "deepseek_v41",
)
# The claimed values this plugin can load today; the rest get a clear "not yet supported".
IMPLEMENTED: tuple[str, ...] = ()


@hookimpl
def dgpp_families() -> list[FamilySpec]:
    return [
        FamilySpec(
            name=FAMILY,
            plugin="dgpp-deepseek",
            architectures=ARCHITECTURES,
            model_types=MODEL_TYPES,
            implemented=IMPLEMENTED,
            description="DeepSeek-V4-Flash (deepseek_v4), DeepSeek-V4.1-Flash (deepseek_v41)",
        )
    ]


@hookimpl
def dgpp_load_model(ctx: LoadContext):
    if ctx.family != FAMILY:
        return None
    from dgpp_deepseek.loader import load_model

    return load_model(ctx)


@hookimpl
def dgpp_tool_dialect(family: str, hf_config: dict):
    if family != FAMILY:
        return None
    from dgpp_deepseek.dialect import dialect_for

    return dialect_for(hf_config)


@hookimpl
def dgpp_chat_template(family: str, hf_config: dict) -> str | None:
    if family != FAMILY:
        return None
    from dgpp_deepseek.dialect import chat_template

    return chat_template(hf_config)
