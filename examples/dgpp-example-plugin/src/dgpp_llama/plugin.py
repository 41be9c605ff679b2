"""Hook implementations: everything this plugin tells dgpp. Only ``dgpp.hookimpl``-decorated functions count.

Heavy imports (torch, the model) stay inside the hook bodies, so ``dgpp plugins`` stays fast.
"""

from __future__ import annotations

from dgpp.plugin_api import FamilySpec, LoadContext, hookimpl

FAMILY = "llama"
PLUGIN = "dgpp-llama"
ARCHITECTURES = ("LlamaForCausalLM",)
MODEL_TYPES = ("llama",)


@hookimpl
def dgpp_families() -> list[FamilySpec]:
    return [
        FamilySpec(
            name=FAMILY,
            plugin=PLUGIN,
            architectures=ARCHITECTURES,
            model_types=MODEL_TYPES,
            implemented=(*ARCHITECTURES, *MODEL_TYPES),
            description="Llama (LlamaForCausalLM: GQA, RoPE default/linear/llama3/yarn, SwiGLU), e.g. SmolLM2",
        )
    ]


@hookimpl
def dgpp_load_model(ctx: LoadContext):
    if ctx.family != FAMILY:
        return None  # not ours: let the family's own plugin answer
    from dgpp_llama.loader import load_model

    return load_model(ctx)


@hookimpl
def dgpp_tiny_checkpoints():
    from dgpp_llama.testing import tiny_checkpoints

    return tiny_checkpoints()


@hookimpl
def dgpp_gguf_architectures():
    from dgpp_llama.gguf_arch import gguf_architectures

    return gguf_architectures()
