"""Hook implementations only: what the Flint plugin registers with dgpp."""

from __future__ import annotations

from dgpp.family import FamilySpec, LoadContext
from dgpp.hookspecs import hookimpl

FAMILY = "flint"
# Every HF architecture / model_type this family claims, implemented or not yet.
ARCHITECTURES = (
    "FlintForCausalLM",
)
MODEL_TYPES = (
    "flint",
)
# The claimed values this plugin can load today; the rest get a clear "not yet supported".
IMPLEMENTED: tuple[str, ...] = ()


@hookimpl
def dgpp_families() -> list[FamilySpec]:
    return [
        FamilySpec(
            name=FAMILY,
            plugin="dgpp-flint",
            architectures=ARCHITECTURES,
            model_types=MODEL_TYPES,
            implemented=IMPLEMENTED,
            description="Flint (flint)",
        )
    ]


@hookimpl
def dgpp_load_model(ctx: LoadContext):
    if ctx.family != FAMILY:
        return None
    from dgpp_flint.loader import load_model

    return load_model(ctx)
