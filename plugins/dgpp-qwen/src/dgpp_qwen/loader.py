"""Qwen's own loads (model hooks: chat checkpoints name their turn-end token only in generation_config.json, and
qwen4_exp reads its PLE n-gram tables and checks its hash constants while the checkpoint is open), through core's
pipeline (``load_family_weights``): parameters filled from the HF tensor names (multimodal wrappers keep the
text model under ``model.language_model.``)."""

from __future__ import annotations

import dataclasses
import json
from collections.abc import Callable
from pathlib import Path

import torch

from dgpp.plugin_api import (
    CheckpointError,
    CheckpointReader,
    LoadContext,
    Model,
    load_family_weights,
)
from dgpp_qwen.config import HYBRID_TYPES, QwenConfig
from dgpp_qwen.qwen4_exp_config import Qwen4ExpConfig, with_engine_rope_scaling


def generation_eos(checkpoint_dir: Path) -> tuple[int, ...]:
    """EOS ids from generation_config.json (chat models list ``<|im_end|>`` there), if present."""
    path = checkpoint_dir / "generation_config.json"
    if not path.exists():
        return ()
    try:
        value = json.loads(path.read_text()).get("eos_token_id")
    except ValueError as e:
        raise CheckpointError(f"{path}: not valid JSON ({e})") from e
    if value is None:
        return ()
    return tuple(value) if isinstance(value, list) else (value,)


def build_model(cfg: QwenConfig, ctx: LoadContext) -> Model:
    if cfg.model_type in HYBRID_TYPES:
        from dgpp_qwen.qwen3_5 import Qwen35ForCausalLM

        return Qwen35ForCausalLM(cfg, ctx.world, group=ctx.group)
    from dgpp_qwen.qwen3 import Qwen3ForCausalLM

    return Qwen3ForCausalLM(cfg, ctx.world, ctx.group)


def rename_for(cfg: QwenConfig) -> Callable[[str], str]:
    """Module-side names use ``model.``; the checkpoint may nest the text model deeper."""
    if cfg.weight_prefix == "model.":
        return lambda name: name
    return lambda name: cfg.weight_prefix + name[len("model.") :] if name.startswith("model.") else name


def load_model(ctx: LoadContext) -> Model:
    """Qwen3 / Qwen3-MoE / the Qwen3.5 hybrids."""
    cfg = QwenConfig.from_hf_config(ctx.hf_config)
    # chat checkpoints name their turn-end token (<|im_end|>) only in generation_config.json
    eos = tuple(dict.fromkeys((*cfg.eos_token_ids, *generation_eos(Path(ctx.checkpoint_dir)))))
    cfg = dataclasses.replace(cfg, eos_token_ids=eos, dtype=ctx.dtype or cfg.dtype)
    return load_family_weights(ctx, lambda: build_model(cfg, ctx), rename_for(cfg))


def load_qwen4_exp(ctx: LoadContext) -> Model:
    from dgpp_qwen.qwen4_exp import Qwen4ExpForCausalLM

    cfg = Qwen4ExpConfig.from_hf_config(ctx.hf_config)
    base = cfg.base
    eos = tuple(dict.fromkeys((*base.eos_token_ids, *generation_eos(Path(ctx.checkpoint_dir)))))
    cfg = dataclasses.replace(
        cfg, base=dataclasses.replace(base, eos_token_ids=eos, dtype=ctx.dtype or base.dtype)
    )
    cfg = with_engine_rope_scaling(cfg, ctx.engine.rope_scaling)
    text_rename = rename_for(cfg.base)

    def rename(name: str) -> str:  # the vision tower sits beside the text model: model.visual.*
        return "model." + name if name.startswith("visual.") else text_rename(name)

    def tables(model: Qwen4ExpForCausalLM, reader: CheckpointReader) -> None:
        check_hash_buffers(model, reader, rename)
        load_ngram_tables(model, reader, rename, ctx)

    return load_family_weights(
        ctx, lambda: Qwen4ExpForCausalLM(cfg, ctx.world, ctx.group), rename, after_load=tables
    )


def check_hash_buffers(model: Model, reader: CheckpointReader, rename: Callable[[str], str]) -> None:
    """Releases save the hash constants; they must equal what this engine derives from the config."""
    for i, layer in enumerate(model.model.layers):
        if layer.ple is None:
            continue
        hasher = layer.ple.ple_embedding.hasher
        for ours, theirs in (
            ("multipliers", "layer_multipliers"),
            ("sizes", "ngram_heads_vocab_sizes"),
            ("offsets", "ngram_heads_offsets"),
        ):
            name = rename(f"model.layers.{i}.ple.ple_embedding.{theirs}")
            if name in reader and not torch.equal(reader.get(name).long().cpu(), getattr(hasher, ours).cpu()):
                raise CheckpointError(
                    f"tensor {name!r} in {reader.where(name)} disagrees with the n-gram hash derived from config.json"
                )


def load_ngram_tables(
    model: Model, reader: CheckpointReader, rename: Callable[[str], str], ctx: LoadContext
) -> None:
    """The PLE n-gram tables (resident, or memory-mapped under ``engine.ngram_table: mmap``)."""
    mode = ctx.engine.ngram_table
    ngram = model.cfg.ngram
    for i, layer in enumerate(model.model.layers):
        if layer.ple is not None:
            prefix = rename(f"model.layers.{i}.ple.ple_embedding.ngram_embedding")
            layer.ple.ple_embedding.load(reader, prefix, ngram.split_parts, mode, ctx.device or "cpu")
