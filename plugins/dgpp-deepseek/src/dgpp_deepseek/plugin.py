"""What the DeepSeek plugin tells dgpp: one ``Family`` (its entry point names ``FAMILY``). References are
``"module:name"`` strings, imported on first use, so registering the plugin loads no torch."""

from __future__ import annotations

from dgpp.plugin_api import Family, FamilyModel

FAMILY = Family(
    name="deepseek",
    plugin="dgpp-deepseek",
    # every config.json value this family claims; a claimed value no model loads is "not yet supported"
    architectures=("DeepseekV4ForCausalLM", "DeepseekV41ForCausalLM"),
    model_types=("deepseek_v4", "deepseek_v41"),
    models=(
        # the release's tensor names decide what is packed, and its draft stages load beside the model:
        # DeepSeek loads and plans through its own hooks (core still builds it for the bench)
        FamilyModel(
            claims=("DeepseekV4ForCausalLM", "deepseek_v4"),
            config="dgpp_deepseek.config:DeepseekV4ArchConfig",
            model="dgpp_deepseek.model:DeepseekV4ForCausalLM",
            drafter="dgpp_deepseek.dspark:build_draft",  # the DSpark stages (engine.mtp)
            hooks={
                "load_model": "dgpp_deepseek.loader:load_model",
                "memory_plan": "dgpp_deepseek.memory:memory_plan",
            },
        ),
        FamilyModel(
            claims=("DeepseekV41ForCausalLM", "deepseek_v41"),
            config="dgpp_deepseek.v41_config:DeepseekV41ArchConfig",
            model="dgpp_deepseek.v41_model:DeepseekV41ForCausalLM",
            drafter="dgpp_deepseek.v41_dspark:build_draft",  # the DSpark stages (engine.mtp)
            hooks={
                "load_model": "dgpp_deepseek.v41_loader:load_model",
                "memory_plan": "dgpp_deepseek.v41_memory:memory_plan",
            },
        ),
    ),
    description="DeepSeek-V4-Flash (deepseek_v4), DeepSeek-V4.1-Flash (deepseek_v41)",
    dialect="dgpp_deepseek.dialect:dialect_for",
    chat_template="dgpp_deepseek.dialect:chat_template",
    templates_package=__name__,
    tiny_checkpoints="dgpp_deepseek.testing:tiny_checkpoints",
    bench_geometries="dgpp_deepseek.testing:bench_geometries",
)
