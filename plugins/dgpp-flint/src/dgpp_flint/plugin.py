"""What the Flint plugin tells dgpp: one ``Family`` (its entry point names ``FAMILY``). References are
``"module:name"`` strings, imported on first use, so registering the plugin loads no torch."""

from __future__ import annotations

from dgpp.plugin_api import Family, FamilyModel

FAMILY = Family(
    name="flint",
    plugin="dgpp-flint",
    # every config.json value this family claims; a claimed value no model loads is "not yet supported"
    architectures=("FlintForCausalLM",),
    model_types=("flint",),
    models=(
        FamilyModel(
            claims=("FlintForCausalLM", "flint"),
            config="dgpp_flint.config:FlintArchConfig",
            model="dgpp_flint.model:FlintForCausalLM",
        ),
    ),
    description="Flint (flint)",
    dialect="dgpp_flint.dialect:dialect_for",
    chat_template="dgpp_flint.dialect:chat_template",
    templates_package=__name__,
    tiny_checkpoints="dgpp_flint.testing:tiny_checkpoints",
    bench_geometries="dgpp_flint.testing:bench_geometries",
)
