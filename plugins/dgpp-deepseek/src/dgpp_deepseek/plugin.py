"""Hook implementations only (built by ``dgpp.family_hooks.FamilyHooks``): what the DeepSeek plugin registers with dgpp."""

from __future__ import annotations

from pathlib import Path

from dgpp.deploy_templates import packaged_templates
from dgpp.family import FamilySpec
from dgpp.family_hooks import FamilyHooks
from dgpp.hookspecs import hookimpl

HOOKS = FamilyHooks(
    FamilySpec(
        name="deepseek",
        plugin="dgpp-deepseek",
        # every HF architecture / model_type this family claims, implemented or not yet
        architectures=(
            "DeepseekV4ForCausalLM",
            "DeepseekV41ForCausalLM",
        ),
        model_types=(
            "deepseek_v4",
            "deepseek_v41",
        ),
        # the claimed values this plugin can load today; the rest get a clear "not yet supported"
        implemented=(),
        description="DeepSeek-V4-Flash (deepseek_v4), DeepSeek-V4.1-Flash (deepseek_v41)",
    ),
    load_model="dgpp_deepseek.loader:load_model",
    tool_dialect="dgpp_deepseek.dialect:dialect_for",
    chat_template="dgpp_deepseek.dialect:chat_template",
)
globals().update(HOOKS.hookimpls())  # pluggy registers this module's dgpp_* attributes


@hookimpl
def dgpp_deploy_templates() -> list[Path]:
    """The deployment templates of this family's releases, shipped in the wheel's templates/ folder."""
    return packaged_templates(__name__)
