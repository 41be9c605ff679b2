"""Hook implementations only: what the MiMo plugin registers with dgpp."""

from __future__ import annotations

from dgpp.family import FamilySpec, LoadContext
from dgpp.hookspecs import hookimpl

FAMILY = "mimo"
# Every HF architecture / model_type this family claims, implemented or not yet.
ARCHITECTURES = (
    "MiMoV2FlashForCausalLM",
    "MiMoV2ForCausalLM",
)
MODEL_TYPES = (
    "mimo_v2_flash",
    "mimo_v2",
)
# The claimed values this plugin can load today; the rest get a clear "not yet supported".
IMPLEMENTED: tuple[str, ...] = ()


@hookimpl
def dgpp_families() -> list[FamilySpec]:
    return [
        FamilySpec(
            name=FAMILY,
            plugin="dgpp-mimo",
            architectures=ARCHITECTURES,
            model_types=MODEL_TYPES,
            implemented=IMPLEMENTED,
            description="MiMo-V2.6-Flash (mimo_v2_flash / mimo_v2)",
        )
    ]


@hookimpl
def dgpp_load_model(ctx: LoadContext):
    if ctx.family != FAMILY:
        return None
    from dgpp_mimo.loader import load_model

    return load_model(ctx)


@hookimpl
def dgpp_tool_dialect(family: str, hf_config: dict):
    if family != FAMILY:
        return None
    from dgpp_mimo.dialect import dialect_for

    return dialect_for(hf_config)


@hookimpl
def dgpp_chat_template(family: str, hf_config: dict) -> str | None:
    if family != FAMILY:
        return None
    from dgpp_mimo.dialect import chat_template

    return chat_template()
