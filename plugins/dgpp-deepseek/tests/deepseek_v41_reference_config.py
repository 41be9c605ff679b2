"""The DeepSeek-V4.1-Flash text config as the float64 reference reads it (``config.json``: root ``model_type``
``deepseek_v41`` with the backbone under ``text_config``), and the layer roles it implies.

Layer roles (CSA2): ``compress_ratios[l]`` is 0 (sliding window only), 1 (one compressed entry per token) or
r > 1 (r tokens pooled into one entry). Only the ``kv_source_layer_ids`` own a compressor; every other layer
with a nonzero ratio reads the compressed KV of the last kv source at or before it (its group). Only the
``index_source_layer_ids`` run the indexer; a layer that is not an index source reuses the selection of the
last index source of its group. The candidate source builds the candidate block pool that every later index
source's selection is restricted to.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any


class ReferenceConfigError(ValueError):
    """A config the reference cannot run, naming the key."""


@dataclass(frozen=True)
class V41Config:
    vocab_size: int
    hidden_size: int
    num_hidden_layers: int
    num_attention_heads: int
    head_dim: int
    qk_rope_head_dim: int
    q_lora_rank: int
    o_groups: int
    o_lora_rank: int
    sliding_window: int
    rope_theta: float
    compress_rope_theta: float
    rope_factor: float
    original_max_position_embeddings: int
    beta_fast: float
    beta_slow: float
    compress_ratios: tuple[int, ...]
    kv_source_layer_ids: tuple[int, ...]
    index_source_layer_ids: tuple[int, ...]
    candidate_source_layer_id: int
    candidate_topk_blocks: int
    candidate_block_size: int
    index_n_heads: int
    index_head_dim: int
    index_topk: int
    n_routed_experts: int
    num_experts_per_tok: int
    scoring_func: str
    gate_temp: float
    norm_topk_prob: bool
    routed_scaling_factor: float
    swiglu_limit: float
    hc_mult: int
    hc_sinkhorn_iters: int
    hc_eps: float
    rms_norm_eps: float
    engram_layer_ids: tuple[int, ...]
    engram_num_embeddings: tuple[int, ...]
    engram_max_ngram_size: int
    engram_n_heads: int
    engram_head_dim: int
    engram_vocab_size: int
    engram_pad_token_id: int
    engram_compressed_vocab_size: int

    # ---- the layer roles ----------------------------------------------------------------------------------
    def ratio(self, layer: int) -> int:
        return self.compress_ratios[layer]

    def kv_source_of(self, layer: int) -> int:
        """The kv source whose compressed KV ``layer`` reads (-1: a window-only layer)."""
        if self.ratio(layer) == 0:
            return -1
        owners = [s for s in self.kv_source_layer_ids if s <= layer]
        return owners[-1] if owners else -1

    def index_source_of(self, layer: int) -> int:
        """The index source whose selection ``layer`` attends (-1: a window-only layer)."""
        source = self.kv_source_of(layer)
        if source < 0:
            return -1
        indexers = [s for s in self.index_source_layer_ids if source <= s <= layer]
        return indexers[-1] if indexers else -1

    def uses_candidates(self, layer: int) -> bool:
        return 0 <= self.candidate_source_layer_id < layer and layer in self.index_source_layer_ids

    def validate(self) -> None:
        n = self.num_hidden_layers
        if len(self.compress_ratios) < n:
            raise ReferenceConfigError(f"compress_ratios: {len(self.compress_ratios)} entries for {n} layers")
        for layer in range(n):
            r = self.ratio(layer)
            if r < 0:
                raise ReferenceConfigError(f"compress_ratios[{layer}] = {r} is negative")
            if r == 0:
                continue
            source = self.kv_source_of(layer)
            if source < 0 or self.ratio(source) != r:
                raise ReferenceConfigError(
                    f"kv_source_layer_ids: layer {layer} (ratio {r}) has no kv source of the same ratio before it"
                )
            if self.index_source_of(layer) < 0:
                raise ReferenceConfigError(
                    f"index_source_layer_ids: layer {layer}'s group has no index source"
                )
        for key, ids in (
            ("kv_source_layer_ids", self.kv_source_layer_ids),
            ("index_source_layer_ids", self.index_source_layer_ids),
        ):
            for layer in ids:
                if not 0 <= layer < n or self.ratio(layer) == 0:
                    raise ReferenceConfigError(f"{key}: layer {layer} is not a compressed backbone layer")
        cand = self.candidate_source_layer_id
        if cand >= 0:
            if cand not in self.index_source_layer_ids:
                raise ReferenceConfigError(f"candidate_source_layer_id: layer {cand} is not an index source")
            later = [s for s in self.kv_source_layer_ids if s > cand]
            if later:
                raise ReferenceConfigError(
                    f"candidate_source_layer_id: kv sources {later} after it would read a foreign pool"
                )
        if self.head_dim % 32 or self.index_head_dim % 32 or self.qk_rope_head_dim % 2:
            raise ReferenceConfigError("head_dim / index_head_dim must be multiples of 32 (the cache blocks)")
        if len(self.engram_num_embeddings) != len(self.engram_layer_ids):
            raise ReferenceConfigError("engram_num_embeddings: one entry per engram_layer_ids entry")


def _ids(text: dict[str, Any], key: str) -> tuple[int, ...]:
    return tuple(int(x) for x in text.get(key) or ())


def parse_config(config: dict[str, Any]) -> V41Config:
    """A ``config.json`` object (root with ``text_config``, or the text config itself) -> ``V41Config``."""
    text = config.get("text_config") or config
    rope = text.get("rope_scaling") or {}

    def need(key: str) -> Any:
        if key not in text:
            raise ReferenceConfigError(f"text_config.{key} is missing")
        return text[key]

    cfg = V41Config(
        vocab_size=int(need("vocab_size")),
        hidden_size=int(need("hidden_size")),
        num_hidden_layers=int(need("num_hidden_layers")),
        num_attention_heads=int(need("num_attention_heads")),
        head_dim=int(need("head_dim")),
        qk_rope_head_dim=int(need("qk_rope_head_dim")),
        q_lora_rank=int(need("q_lora_rank")),
        o_groups=int(need("o_groups")),
        o_lora_rank=int(need("o_lora_rank")),
        sliding_window=int(need("sliding_window")),
        rope_theta=float(text.get("rope_theta", 10000.0)),
        compress_rope_theta=float(text.get("compress_rope_theta", 160000.0)),
        rope_factor=float(rope.get("factor", 1.0)),
        original_max_position_embeddings=int(rope.get("original_max_position_embeddings", 0)),
        beta_fast=float(rope.get("beta_fast", 32.0)),
        beta_slow=float(rope.get("beta_slow", 1.0)),
        compress_ratios=_ids(text, "compress_ratios"),
        kv_source_layer_ids=_ids(text, "kv_source_layer_ids"),
        index_source_layer_ids=_ids(text, "index_source_layer_ids"),
        candidate_source_layer_id=int(text.get("candidate_source_layer_id", -1)),
        candidate_topk_blocks=int(text.get("candidate_topk_blocks", 2048)),
        candidate_block_size=int(text.get("candidate_block_size", 8)),
        index_n_heads=int(need("index_n_heads")),
        index_head_dim=int(need("index_head_dim")),
        index_topk=int(need("index_topk")),
        n_routed_experts=int(need("n_routed_experts")),
        num_experts_per_tok=int(need("num_experts_per_tok")),
        scoring_func=str(text.get("scoring_func", "sqrtsoftplus")),
        gate_temp=float(text.get("gate_temp", 1.0)),
        norm_topk_prob=bool(text.get("norm_topk_prob", True)),
        routed_scaling_factor=float(text.get("routed_scaling_factor", 1.0)),
        swiglu_limit=float(text.get("swiglu_limit", 0.0)),
        hc_mult=int(text.get("hc_mult", 4)),
        hc_sinkhorn_iters=int(text.get("hc_sinkhorn_iters", 20)),
        hc_eps=float(text.get("hc_eps", 1e-6)),
        rms_norm_eps=float(text.get("rms_norm_eps", 1e-20)),
        engram_layer_ids=_ids(text, "engram_layer_ids"),
        engram_num_embeddings=_ids(text, "engram_num_embeddings"),
        engram_max_ngram_size=int(text.get("engram_max_ngram_size", 1)),
        engram_n_heads=int(text.get("engram_n_heads", 0)),
        engram_head_dim=int(text.get("engram_head_dim", 0)),
        engram_vocab_size=int(text.get("engram_vocab_size", 0)),
        engram_pad_token_id=int(text.get("engram_pad_token_id", text.get("engram_pad_id", 2))),
        engram_compressed_vocab_size=int(text.get("engram_compressed_vocab_size", 0)),
    )
    if cfg.scoring_func not in ("sqrtsoftplus", "sigmoid", "softmax"):
        raise ReferenceConfigError(f"text_config.scoring_func: {cfg.scoring_func!r} is not known")
    cfg.validate()
    return cfg


def load_config(checkpoint_dir: str | Path) -> V41Config:
    root = json.loads((Path(checkpoint_dir) / "config.json").read_text())
    if root.get("model_type") != "deepseek_v41":
        raise ReferenceConfigError(f"config.json: model_type {root.get('model_type')!r} is not deepseek_v41")
    return parse_config(root)
