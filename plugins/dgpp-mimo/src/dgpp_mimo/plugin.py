"""What the MiMo plugin tells dgpp: one ``Family`` (its entry point names ``FAMILY``). References are
``"module:name"`` strings, imported on first use, so registering the plugin loads no torch."""

from __future__ import annotations

from dgpp.plugin_api import Family, FamilyModel

FAMILY = Family(
    name="mimo",
    plugin="dgpp-mimo",
    # every config.json value this family claims; a claimed value no model loads is "not yet supported"
    architectures=("MiMoV2FlashForCausalLM", "MiMoV2ForCausalLM"),
    model_types=("mimo_v2_flash", "mimo_v2"),
    models=(
        FamilyModel(
            claims=("MiMoV2FlashForCausalLM", "mimo_v2_flash"),
            config="dgpp_mimo.config:MimoArchConfig",
            model="dgpp_mimo.model:MimoV2FlashForCausalLM",
        ),
        # MiMo-V2.6: the flash model over the release's own keys, tensor layout (a reader) and formats (a
        # scheme), with its MTP drafter
        FamilyModel(
            claims=("MiMoV2ForCausalLM", "mimo_v2"),
            config="dgpp_mimo.v26_config:MimoV26Config",
            model="dgpp_mimo.model:MimoV2FlashForCausalLM",
            drafter="dgpp_mimo.v26_loader:build_draft",
            hooks={
                "load_model": "dgpp_mimo.v26_loader:load_v26",
                "memory_plan": "dgpp_mimo.memory:memory_plan",
            },
        ),
    ),
    description="MiMo-V2-Flash (mimo_v2_flash), MiMo-V2.6-Flash (mimo_v2)",
    dialect="dgpp_mimo.dialect:dialect_for",
    chat_template="dgpp_mimo.dialect:chat_template",
    templates_package=__name__,
    tiny_checkpoints="dgpp_mimo.testing:tiny_checkpoints",
    bench_geometries="dgpp_mimo.testing:bench_geometries",
)
