"""A declared family model (``dgpp.family_contract.FamilyModel``) made real: its config read, the model built for
the rank, its weights loaded, and its memory counted from the model built on ``meta``. The one pipeline every
declared family runs; a family supplies only classes and renames.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch

from dgpp.checkpoint.gguf_packed import planned_packing
from dgpp.errors import PluginError
from dgpp.family import FamilyModel, LoadContext, resolve_reference
from dgpp.quant.apply import quantize_modules
from dgpp.quant.resident import resident_bytes
from dgpp.startup.weights import load_family_weights, same_name, settle_weights
from dgpp.step.cache_spec import stored_as
from dgpp.step.memory import MemoryPlan, ModelMemory
from dgpp.step.model import Model

_MODEL_METHODS = ("cache_spec", "forward", "compute_logits", "activation_bytes_per_token")


def declared_config(ctx: LoadContext, entry: FamilyModel) -> Any:
    """``entry.config.from_hf_config(ctx.hf_config)``: the family's typed config (a ConfigError names the key)."""
    config_class = resolve_reference(entry.config)
    if not callable(getattr(config_class, "from_hf_config", None)):
        raise PluginError(f"{entry.config} has no from_hf_config(hf_config) classmethod")
    cfg = config_class.from_hf_config(ctx.hf_config)
    if not isinstance(getattr(cfg, "dtype", None), torch.dtype):
        raise PluginError(f"{entry.config}.from_hf_config gave a config without a torch dtype in .dtype")
    return cfg


def model_builder(ctx: LoadContext, entry: FamilyModel) -> Callable[[], Model]:
    """A function that builds the declared model for ``ctx`` (on the current default device), in ``ctx.dtype``
    when a deployment key set one, else the checkpoint's."""
    model_class = resolve_reference(entry.model)
    if not (isinstance(model_class, type) and issubclass(model_class, Model)):
        raise PluginError(f"{entry.model} is not a dgpp.plugin_api.Model subclass")
    missing = [m for m in _MODEL_METHODS if not callable(getattr(model_class, m, None))]
    if missing:
        raise PluginError(f"{entry.model} lacks {', '.join(missing)} (the model contract)")
    cfg = declared_config(ctx, entry)
    dtype = ctx.dtype or cfg.dtype
    return lambda: model_class(cfg, dtype=dtype, world=ctx.world, group=ctx.group)


def renames(entry: FamilyModel) -> Callable[[str], str]:
    return same_name if entry.renames is None else resolve_reference(entry.renames)


def load_declared_model(ctx: LoadContext, entry: FamilyModel) -> Model:
    """The model with its weights: built, quantized where the checkpoint is, loaded, settled, converted."""
    own = entry.hooks.get("load_model")
    if own is not None:
        model: Model = resolve_reference(own)(ctx)
        return model
    return load_family_weights(ctx, model_builder(ctx, entry), renames(entry))


def build_declared_model(ctx: LoadContext, entry: FamilyModel) -> Model:
    """The model on ``ctx.device`` with its parameters allocated, not loaded (``dgpp bench``)."""
    with torch.device(ctx.device or "cpu"):
        return model_builder(ctx, entry)().eval()


def declared_model_memory(ctx: LoadContext, entry: FamilyModel) -> ModelMemory | MemoryPlan:
    """The model's bytes on this rank as it would be loaded, without reading a weight: built on ``meta`` for the
    rank, packed where the checkpoint is quantized, settled, with the deployment's weight-form keys
    (``engine.bf16_weights``, ``engine.dense_weights``, ``engine.gguf_weights``) applied to the count; KV and state rates from the cache
    entries its attention modules declare."""
    own = entry.hooks.get("memory_plan")
    if own is not None:
        plan: ModelMemory | MemoryPlan = resolve_reference(own)(ctx)
        return plan
    rename = renames(entry)
    with torch.device("meta"):
        model = model_builder(ctx, entry)()
        quantize_modules(model, ctx.hf_config, rename=rename)
    settle_weights(model)
    int4pack, int4pack_heads = planned_packing(model, ctx.checkpoint_dir, ctx.engine, rename)
    return ModelMemory.from_cache_spec(
        stored_as(model.cache_spec(), ctx.engine.kv_dtype),
        weights=resident_bytes(model, ctx.engine.bf16_weights, ctx.engine.dense_weights, int4pack)
        + int4pack_heads,
        activations_per_token=model.activation_bytes_per_token(),
        vocab_size=model.info.vocab_size,
        max_position=model.info.max_position,
        notes=(
            f"{ctx.family} plan: {type(model).__name__} built on meta for rank {ctx.world.rank} of "
            f"{ctx.world.size}; cache entries as its attention modules declare them",
        ),
    )
