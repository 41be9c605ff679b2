"""What this plugin tells dgpp: one ``Family`` (its entry point names ``FAMILY``). References are
``"module:name"`` strings, imported on first use, so registering the plugin loads no torch."""

from __future__ import annotations

from dgpp.plugin_api import Family, FamilyModel

FAMILY = Family(
    name="llama",
    plugin="dgpp-llama",
    # every config.json value this family claims; a claimed value no model loads is "not yet supported"
    architectures=("LlamaForCausalLM",),
    model_types=("llama",),
    models=(
        FamilyModel(
            claims=("LlamaForCausalLM", "llama"),
            config="dgpp_llama.config:LlamaConfig",
            model="dgpp_llama.model:LlamaForCausalLM",
        ),
    ),
    description="Llama (LlamaForCausalLM: GQA, RoPE default/linear/llama3/yarn, SwiGLU), e.g. SmolLM2",
    # what the family offers beside its model: a tiny random checkpoint for tests, the GGUF map of its releases
    tiny_checkpoints="dgpp_llama.testing:tiny_checkpoints",
    gguf_architectures="dgpp_llama.gguf_arch:gguf_architectures",
)
