"""config.json -> typed config for ``qwen4_exp`` / ``qwen4_exp_text`` (Qwen3.8-Flash-Next).

The shared part (sizes, GDN, MoE, RoPE, dtype, EOS) is the Qwen3.5-MoE hybrid's and goes through
``dgpp_qwen.config.QwenConfig.from_hf_config``; this module adds the QSA indexer, the gated-residual streams and the
PLE n-gram table, and rejects values the engine cannot run, naming the key.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import torch

from dgpp.nn.rotary import RopeScaling, YarnScaling
from dgpp.plugin_api import ConfigError, ConfigKeys
from dgpp_qwen.config import QwenConfig, RopeConfig
from dgpp_qwen.qwen4_exp_vision import VisionConfig

_WHERE = "config.json"

QWEN4_EXP_TYPES = ("qwen4_exp", "qwen4_exp_text")
INDEXED_ATTENTION = "indexed_attention"


@dataclass(frozen=True)
class IndexerConfig:
    """QSA block indexer: ``n_heads`` query heads and one key head of ``head_dim``; keys averaged over
    ``compress_ratio`` tokens per block; ``budget`` tokens (``budget / compress_ratio`` blocks) kept."""

    n_heads: int
    head_dim: int
    budget: int
    compress_ratio: int

    @property
    def block_topk(self) -> int:
        return self.budget // self.compress_ratio


@dataclass(frozen=True)
class NGramConfig:
    """PLE hashed n-gram embedding: one table per PLE layer (``layer_ids`` zero-indexed)."""

    layer_ids: tuple[int, ...]
    embed_dim: int
    conv_kernel: int
    ngram_size: int
    heads_per_ngram: int
    vocab_size_base: int
    vocab_divisor: int
    seed: int
    split_parts: int
    eos_token_id: int

    @property
    def num_heads(self) -> int:
        return (self.ngram_size - 1) * self.heads_per_ngram


@dataclass(frozen=True)
class Qwen4ExpConfig:
    """The Qwen3.5-MoE hybrid fields (``base``) plus what qwen4_exp adds."""

    base: QwenConfig
    indexer: IndexerConfig
    hc_count: int
    hc_lowrank: int
    ngram: NGramConfig | None
    gdn_output_gate: str  # "silu" or "sigmoid"
    norm_topk_prob: bool
    vision: VisionConfig | None = None  # the vision tower of a wrapped checkpoint (``vision_config``)
    image_token_id: int | None = None  # the placeholder token image embeddings replace

    @property
    def dtype(self) -> torch.dtype:
        """The checkpoint's dtype (the base fields')."""
        return self.base.dtype

    @classmethod
    def from_hf_config(cls, hf_config: Mapping[str, Any]) -> Qwen4ExpConfig:
        """Validate config.json (as a dict) and return the typed config; ConfigError names the key."""
        hf_config = dict(hf_config)
        keys, prefix = _text_keys(hf_config)
        base = QwenConfig.from_hf_config(_as_hybrid_moe(keys, hf_config))
        archs = hf_config.get("architectures") or []
        base = dataclasses.replace(
            base,
            model_type="qwen4_exp_text",
            architecture=archs[0] if archs else hf_config["model_type"],
            weight_prefix=prefix,
        )
        gate = keys.optional("output_gate_type", str, None) or keys.optional("hidden_act", str, "silu")
        if gate not in ("silu", "sigmoid"):
            raise keys.error(f"{keys.name('output_gate_type')} = {gate!r} is not supported (silu, sigmoid)")
        hc_count = keys.positive("hc_count", 4)
        if hc_count < 2:
            raise keys.error(f"{keys.name('hc_count')} = {hc_count} must be at least 2")
        vision = None
        if hf_config.get("model_type") == "qwen4_exp" and hf_config.get("vision_config"):
            vision = VisionConfig.from_hf_config(hf_config["vision_config"])
            if vision.out_hidden_size != base.hidden_size:
                raise ConfigError(
                    f"config.json: vision_config.out_hidden_size = {vision.out_hidden_size} must equal "
                    f"text_config.hidden_size = {base.hidden_size}"
                )
            base = dataclasses.replace(base, rope=_multimodal_rope(keys, base))
        return cls(
            base=base,
            indexer=_parse_indexer(keys, base),
            hc_count=hc_count,
            hc_lowrank=keys.positive("hc_lowrank", 320),
            ngram=_parse_ngram(keys, base),
            gdn_output_gate=gate,
            norm_topk_prob=keys.optional("norm_topk_prob", bool, True),
            vision=vision,
            image_token_id=int(hf_config.get("image_token_id", 248056)) if vision else None,
        )


def _text_keys(hf_config: dict[str, Any]) -> tuple[ConfigKeys, str]:
    model_type = hf_config.get("model_type")
    if model_type == "qwen4_exp":
        text = hf_config.get("text_config")
        if not isinstance(text, dict):
            raise ConfigError("config.json: qwen4_exp needs a 'text_config' object")
        return ConfigKeys(text, _WHERE, prefix="text_config."), "model.language_model."
    if model_type == "qwen4_exp_text":
        return ConfigKeys(hf_config, _WHERE), "model."
    raise ConfigError(f"config.json: model_type = {model_type!r} is not a qwen4_exp type")


def _as_hybrid_moe(keys: ConfigKeys, hf_config: dict[str, Any]) -> dict[str, Any]:
    """The text config in the qwen3_5_moe_text shape ``parse_config`` reads: QSA layers are its full-attention
    layers, and RoPE is full-width unless ``partial_rotary_factor`` says otherwise (transformers' default here)."""
    text = dict(keys.cfg)
    text["model_type"] = "qwen3_5_moe_text"
    types = text.get("layer_types")
    if isinstance(types, list):
        text["layer_types"] = [
            "full_attention" if t in (INDEXED_ATTENTION, "full_attention") else t for t in types
        ]
    rope = text.get("rope_parameters")
    if isinstance(rope, dict) and "partial_rotary_factor" not in rope:
        text["rope_parameters"] = {**rope, "partial_rotary_factor": 1.0}
    if keys.prefix:  # the multimodal wrapper: parse as qwen3_5_moe, so errors name text_config.<key>
        top = {
            k: v
            for k, v in hf_config.items()
            if k in ("architectures", "dtype", "torch_dtype", "tie_word_embeddings", "eos_token_id")
        }
        return {**top, "model_type": "qwen3_5_moe", "text_config": text}
    return text


def _multimodal_rope(keys: ConfigKeys, base: QwenConfig) -> RopeConfig:
    """Image positions turn the text RoPE's sections (temporal, row, column) by their own axes, interleaved
    frequency by frequency; the sections default to [11, 11, 10]."""
    rope = base.rope
    section = rope.mrope_section or (11, 11, 10)
    if 2 * sum(section) != rope.rotary_dim or len(section) != 3:
        raise keys.error(
            f"{keys.name('rope_parameters')}.mrope_section = {list(section)} must be three sections summing to "
            f"rotary_dim/2 = {rope.rotary_dim // 2}"
        )
    return dataclasses.replace(rope, mrope_section=tuple(section), mrope_interleaved=True)


def _parse_indexer(keys: ConfigKeys, base: QwenConfig) -> IndexerConfig:
    if keys.optional("indexer_kv_heads", int, 1) != 1:
        raise keys.error(f"{keys.name('indexer_kv_heads')} must be 1 (QSA has one index key head)")
    cfg = IndexerConfig(
        n_heads=keys.positive("indexer_n_heads"),
        head_dim=keys.positive("indexer_head_dim"),
        budget=keys.positive("indexer_budget"),
        compress_ratio=keys.positive("indexer_compress_ratio"),
    )
    if cfg.budget % cfg.compress_ratio:
        raise keys.error(
            f"{keys.name('indexer_budget')} = {cfg.budget} is not a multiple of indexer_compress_ratio"
        )
    if base.rope.rotary_dim > cfg.head_dim:
        raise keys.error(
            f"{keys.name('indexer_head_dim')} = {cfg.head_dim} is below the rotary dim {base.rope.rotary_dim}"
        )
    return cfg


def _parse_ngram(keys: ConfigKeys, base: QwenConfig) -> NGramConfig | None:
    ids = keys.optional("ple_layer_ids", list, [])
    if not ids:
        return None
    if not all(isinstance(i, int) and 1 <= i <= base.num_layers for i in ids):
        raise keys.error(
            f"{keys.name('ple_layer_ids')} = {ids!r} must be one-indexed layer ids in [1, {base.num_layers}]"
        )
    layer_ids = tuple(sorted({i - 1 for i in ids}))
    if any(base.layer_types[i] != "linear_attention" for i in layer_ids):
        raise keys.error(f"{keys.name('ple_layer_ids')} may only name linear_attention layers")
    if not base.eos_token_ids:
        raise keys.error(f"{keys.name('eos_token_id')} must be set when ple_layer_ids is")
    cfg = NGramConfig(
        layer_ids=layer_ids,
        embed_dim=keys.positive("ple_embed_dim", base.hidden_size),
        conv_kernel=keys.positive("ple_conv_kernel_size", 4),
        ngram_size=keys.positive("ngram_size", 3),
        heads_per_ngram=keys.positive("heads_per_ngram", 8),
        vocab_size_base=keys.positive("ngram_vocab_size_base", 20_000_000),
        vocab_divisor=keys.positive("make_ngram_vocab_size_divisible_by", 128),
        seed=keys.optional("seed", int, 1234),
        split_parts=keys.positive("split_ngram_parts", 512),
        eos_token_id=base.eos_token_ids[0],
    )
    if cfg.ngram_size < 2 or cfg.embed_dim % cfg.num_heads:
        raise keys.error(
            f"{keys.name('ple_embed_dim')} = {cfg.embed_dim} must split over {cfg.num_heads} n-gram heads"
        )
    return cfg


def with_engine_rope_scaling(cfg: Qwen4ExpConfig, rope_scaling: Any) -> Qwen4ExpConfig:
    """``engine.rope_scaling`` (YaRN, opt-in 512K): replaces the checkpoint's RoPE frequencies and raises
    the position limit to ``factor × original_max_position_embeddings``."""
    if rope_scaling is None:
        return cfg
    yarn = YarnScaling(
        factor=rope_scaling.factor,
        original_max_position=rope_scaling.original_max_position_embeddings,
        beta_fast=rope_scaling.beta_fast,
        beta_slow=rope_scaling.beta_slow,
        # attn_factor multiplies YaRN's default magnitude 0.1·ln(factor)+1 (1.0 keeps it)
        attention_factor=rope_scaling.attn_factor * YarnScaling(rope_scaling.factor, 1).magnitude(),
    )
    base = cfg.base
    scaling = RopeScaling(
        theta=base.rope.theta,
        rope_type="yarn",
        factor=yarn.factor,
        original_max_position=yarn.original_max_position,
        yarn=yarn,
    )
    rope = dataclasses.replace(base.rope, scaling=scaling)
    max_position = max(
        base.max_position, int(rope_scaling.factor * rope_scaling.original_max_position_embeddings)
    )
    return dataclasses.replace(cfg, base=dataclasses.replace(base, rope=rope, max_position=max_position))
