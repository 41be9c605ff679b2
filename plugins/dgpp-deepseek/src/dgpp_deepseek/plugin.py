"""Hook implementations only (built by ``dgpp.family_hooks.FamilyHooks``): what the DeepSeek plugin registers with dgpp."""

from __future__ import annotations

from dgpp.family import FamilySpec
from dgpp.family_hooks import FamilyHooks

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
