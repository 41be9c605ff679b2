"""Qwen's memory (model hooks). qwen4_exp: per-rank bytes of the model as it would be built, without reading a
weight; core sizes the deployment's plan from them (``dgpp.step.memory.plan_memory``). Qwen3 and the Qwen3.5
hybrids keep core's estimate from config.json and the safetensors headers (``estimated_memory``), which their
deployments' numbers were measured with.

The model (and the MTP drafter when ``engine.mtp`` is on) is built on the ``meta`` device for this rank, so
weights are this rank's real parameter bytes; KV per token and state per request come from
``cache_spec()``, so they include the QSA indexer's keys and the PLE n-gram context and conv history. The
PLE n-gram tables (their stored bytes; for a config without weight files, such as a bench geometry, the rows
its hash addresses) count as weights when ``engine.ngram_table`` is ``resident``; when ``mmap`` they stay
in the page cache of the checkpoint files and are only noted.
"""

from __future__ import annotations

import dataclasses
import math
from pathlib import Path

import torch

from dgpp.plugin_api import LoadContext, ModelMemory, estimate_model_memory, stored_as, tensor_bytes
from dgpp_qwen.qwen4_exp_vision import VisionConfig

MIB = 1 << 20


def ngram_table_bytes(checkpoint_dir: Path) -> int:
    """On-disk bytes of every PLE table of the main model (all shards)."""
    return sum(
        size
        for name, size in tensor_bytes(checkpoint_dir).items()
        if ".ple_embedding.ngram_embedding." in name and not name.startswith("mtp.")
    )


def _ngram_table_bytes(ctx: LoadContext, model: torch.nn.Module, dtype: torch.dtype) -> int:
    """The checkpoint's stored table bytes; for a config without weight files (a benchmark geometry, whose
    random tables are built in ``dtype``), the rows the hash addresses."""
    checkpoint = Path(ctx.checkpoint_dir)
    if any(checkpoint.glob("*.safetensors")):
        return ngram_table_bytes(checkpoint)
    from dgpp_qwen.layers.ngram import PLELayer

    itemsize = torch.empty((), dtype=dtype).element_size()
    return sum(
        m.table_rows * m.ple_embedding.dim * itemsize for m in model.modules() if isinstance(m, PLELayer)
    )


def estimated_memory(ctx: LoadContext) -> ModelMemory:
    """Qwen3 / the Qwen3.5 hybrids: core's estimate from config.json and the safetensors headers; with a DFlash2
    drafter (``engine.mtp`` and ``engine.dflash_model``) the drafter item is its weights in the target's dtype,
    replicated, instead of the MTP layer, and its context adds each drafter layer's K/V row per token."""
    memory = estimate_model_memory(ctx.checkpoint_dir, ctx.hf_config, ctx.engine, world_size=ctx.world.size)
    if not (ctx.engine.mtp and ctx.engine.dflash_model):
        return memory
    from dgpp_qwen.dflash2 import expected_shapes
    from dgpp_qwen.dflash2_config import DFlash2Config, drafter_dir

    cfg = DFlash2Config.from_dir(drafter_dir(ctx.engine.dflash_model))
    from dgpp_qwen.config import QwenConfig

    dtype = (
        ctx.dtype or QwenConfig.from_hf_config(ctx.hf_config).dtype
    )  # the target's, which the drafter takes
    itemsize = torch.empty((), dtype=dtype).element_size()
    weights = sum(math.prod(shape) for shape in expected_shapes(cfg).values()) * itemsize
    context = cfg.num_hidden_layers * 2 * cfg.num_key_value_heads * cfg.head_dim * itemsize
    return dataclasses.replace(
        memory,
        drafter=weights,
        kv_per_token=memory.kv_per_token + context,
        notes=(
            *memory.notes,
            f"DFlash2 drafter {ctx.engine.dflash_model}: weights replicated, context K/V per token",
        ),
    )


def vision_workspace_bytes(vision: VisionConfig, ctx: LoadContext, itemsize: int) -> int:
    """Scratch of one encoder pass over the largest picture the processor lets through (``longest_edge`` pixels of
    ``preprocessor_config.json``): per patch row its fp32 pixels, the residual and normed rows, q/k/v and the
    attention output (attention itself runs fused, without a score matrix), the MLP's hidden; plus the merged
    output rows."""
    from dgpp_qwen.qwen4_exp_images import Qwen4ExpImageInput

    images = Qwen4ExpImageInput.from_checkpoint(ctx.hf_config, ctx.checkpoint_dir)
    patches = images.max_pixels // vision.patch_size**2
    per_patch = 4 * vision.patch_values + (6 * vision.hidden_size + vision.intermediate_size) * itemsize
    merged = (
        patches // vision.spatial_merge_size**2 * (vision.hidden_size * 4 + vision.out_hidden_size) * itemsize
    )
    return patches * per_patch + merged


def memory_plan(ctx: LoadContext) -> ModelMemory:
    from dgpp_qwen.qwen4_exp import Qwen4ExpForCausalLM
    from dgpp_qwen.qwen4_exp_config import Qwen4ExpConfig
    from dgpp_qwen.qwen4_exp_mtp import Qwen4ExpMTPDrafter

    engine = ctx.engine
    cfg = Qwen4ExpConfig.from_hf_config(ctx.hf_config)
    base = cfg.base
    dtype = ctx.dtype or base.dtype
    with torch.device("meta"):
        model = Qwen4ExpForCausalLM(cfg, ctx.world)
        spec = dict(model.cache_spec())
        drafter_bytes = 0
        if engine.mtp:
            drafter = Qwen4ExpMTPDrafter(model)
            spec.update(drafter.cache_spec())
            drafter_bytes = sum(p.numel() * p.element_size() for p in drafter.parameters())
    weights = sum(p.numel() * p.element_size() for p in model.parameters())
    table = _ngram_table_bytes(ctx, model, dtype) if cfg.ngram else 0
    mapped = engine.ngram_table == "mmap"
    itemsize = torch.empty((), dtype=dtype).element_size()
    world, moe = ctx.world.size, base.moe
    assert moe is not None, "qwen4_exp parses as the Qwen3.5-MoE hybrid: it always has experts"
    notes = [f"qwen4_exp plan: modules built on meta for rank {ctx.world.rank} of {world}"]
    if table:
        notes.append(
            f"PLE n-gram tables {table / MIB:,.1f} MiB "
            + ("memory-mapped, not resident" if mapped else "resident")
        )
    extra: dict[str, int] = {}
    if cfg.vision is not None and model.visual is not None:
        vision_bytes = sum(p.numel() * p.element_size() for p in model.visual.parameters())
        notes.append(f"vision tower {vision_bytes / MIB:,.1f} MiB (in weights)")
        extra["vision_workspace"] = vision_workspace_bytes(cfg.vision, ctx, itemsize)
    return ModelMemory.from_cache_spec(
        stored_as(spec, engine.kv_dtype),
        extra=extra,
        weights=weights + (0 if mapped else table),
        # a prefill row: the hyper state and its normed copy, the block input, q/k/v/attention rows, the routed
        # experts' gate/up/act on this rank
        activations_per_token=(
            2 * cfg.hc_count * base.hidden_size
            + 6 * base.hidden_size
            + 3 * moe.intermediate_size * moe.top_k // world
        )
        * itemsize,
        drafter=drafter_bytes,
        vocab_size=base.vocab_size,
        max_position=base.max_position,
        notes=tuple(notes),
    )
