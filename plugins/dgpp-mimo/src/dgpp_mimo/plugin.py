"""Hook implementations only (built by ``dgpp.family_hooks.FamilyHooks``): what the MiMo plugin registers with dgpp."""

from __future__ import annotations

from pathlib import Path

from dgpp.deploy_templates import packaged_templates
from dgpp.family import FamilySpec
from dgpp.family_hooks import FamilyHooks
from dgpp.hookspecs import hookimpl

HOOKS = FamilyHooks(
    FamilySpec(
        name="mimo",
        plugin="dgpp-mimo",
        # every HF architecture / model_type this family claims, implemented or not yet
        architectures=(
            "MiMoV2FlashForCausalLM",
            "MiMoV2ForCausalLM",
        ),
        model_types=(
            "mimo_v2_flash",
            "mimo_v2",
        ),
        # the claimed values this plugin can load today; the rest get a clear "not yet supported"
        implemented=(),
        description="MiMo-V2.6-Flash (mimo_v2_flash / mimo_v2)",
    ),
    load_model="dgpp_mimo.loader:load_model",
    tool_dialect="dgpp_mimo.dialect:dialect_for",
    chat_template="dgpp_mimo.dialect:chat_template",
)
globals().update(HOOKS.hookimpls())  # pluggy registers this module's dgpp_* attributes


@hookimpl
def dgpp_deploy_templates() -> list[Path]:
    """The deployment templates of this family's releases, shipped in the wheel's templates/ folder."""
    return packaged_templates(__name__)
