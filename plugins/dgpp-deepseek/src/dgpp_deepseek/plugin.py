"""Hook implementations only (``HOOKS``, a ``dgpp.plugin_api.FamilyHooks`` the entry point names): what the DeepSeek plugin registers with dgpp."""

from __future__ import annotations

from dgpp.plugin_api import FamilyHooks, FamilySpec

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
        implemented=("DeepseekV4ForCausalLM", "deepseek_v4"),
        description="DeepSeek-V4-Flash (deepseek_v4), DeepSeek-V4.1-Flash (deepseek_v41)",
    ),
    load_model="dgpp_deepseek.loader:load_model",
    build_model="dgpp_deepseek.model:build_unloaded",
    tool_dialect="dgpp_deepseek.dialect:dialect_for",
    chat_template="dgpp_deepseek.dialect:chat_template",
    memory_plan="dgpp_deepseek.memory:memory_plan",
    templates_package=__name__,
    tiny_checkpoints="dgpp_deepseek.testing:tiny_checkpoints",
    bench_geometries="dgpp_deepseek.testing:bench_geometries",
)
