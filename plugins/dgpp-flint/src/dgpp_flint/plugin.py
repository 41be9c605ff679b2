"""Hook implementations only (built by ``dgpp.family_hooks.FamilyHooks``): what the Flint plugin registers with dgpp."""

from __future__ import annotations

from pathlib import Path

from dgpp.deploy_templates import packaged_templates
from dgpp.family import FamilySpec
from dgpp.family_hooks import FamilyHooks
from dgpp.hookspecs import hookimpl

HOOKS = FamilyHooks(
    FamilySpec(
        name="flint",
        plugin="dgpp-flint",
        # every HF architecture / model_type this family claims, implemented or not yet
        architectures=("FlintForCausalLM",),
        model_types=("flint",),
        # the claimed values this plugin can load today; the rest get a clear "not yet supported"
        implemented=(),
        description="Flint (flint)",
    ),
    load_model="dgpp_flint.loader:load_model",
)
globals().update(HOOKS.hookimpls())  # pluggy registers this module's dgpp_* attributes


@hookimpl
def dgpp_deploy_templates() -> list[Path]:
    """The deployment templates of this family's releases, shipped in the wheel's templates/ folder."""
    return packaged_templates(__name__)
