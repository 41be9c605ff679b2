"""HF ``config.json`` of a ``deepseek_v41`` checkpoint (DeepSeek-V4.1-Flash) -> a typed architecture config.

The root (``model_type`` ``deepseek_v41``, ``DeepseekV41ForCausalLM``) holds the quantization and, under
``text_config`` (``deepseek_v41_text``), the backbone. Per layer ``compress_ratios`` gives the compressed main
KV: 0 (the 128-token window only), 1 (one entry per token) or 2 (each pair of tokens pooled, gated). Only the
``kv_source_layer_ids`` own a compressor; every later layer of the same ratio reads that source's entries (a
layer group shares one compressed cache). Only the ``index_source_layer_ids`` run the indexer; a layer that is
no index source attends its group's last selection. ``candidate_source_layer_id`` builds the pool of
``candidate_topk_blocks`` blocks of ``candidate_block_size`` entries that every later index source selects
inside. Layers from the last kv source on are the decoder of the causal-encoder / decoder split (what the
bounded prefill runs over the last window only). Values this family does not compute are refused by key.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from dgpp.plugin_api import ConfigError, ConfigKeys
from dgpp_deepseek.config import LatentMoEFields, latent_moe_values

_WHERE = "deepseek_v41 config.json"


@dataclass(frozen=True, kw_only=True)
class DeepseekV41ArchConfig(LatentMoEFields):
    compress_ratios: tuple[int, ...]
    kv_source_layer_ids: tuple[int, ...]
    index_source_layer_ids: tuple[int, ...]
    candidate_source_layer_id: int
    candidate_topk_blocks: int
    candidate_block_size: int
    engram_layer_ids: tuple[int, ...]
    engram_num_embeddings: tuple[int, ...]
    engram_max_ngram_size: int
    engram_n_heads: int
    engram_head_dim: int
    engram_vocab_size: int
    engram_pad_token_id: int
    engram_compressed_vocab_size: int

    def ratio(self, layer: int) -> int:
        return self.compress_ratios[layer]

    def kv_source_of(self, layer: int) -> int:
        """The kv source whose compressed entries ``layer`` attends (-1: window only)."""
        if self.ratio(layer) == 0:
            return -1
        owners = [s for s in self.kv_source_layer_ids if s <= layer]
        return owners[-1] if owners else -1

    def is_index_source(self, layer: int) -> bool:
        return layer in self.index_source_layer_ids

    def uses_candidates(self, layer: int) -> bool:
        """An index source after the candidate source: its selection is restricted to the candidate pool."""
        return 0 <= self.candidate_source_layer_id < layer and self.is_index_source(layer)

    @property
    def decoder_first_layer(self) -> int:
        """The first decoder layer: the last kv source (the decoder reads it at ratio 1)."""
        return self.kv_source_layer_ids[-1] if self.kv_source_layer_ids else self.num_hidden_layers

    @property
    def engram_rows_per_token(self) -> int:
        """Table rows an Engram layer looks up per token: a head per n-gram size 2..max."""
        return (self.engram_max_ngram_size - 1) * self.engram_n_heads

    @classmethod
    def from_hf_config(cls, hf_config: Mapping[str, Any]) -> DeepseekV41ArchConfig:
        """Validate config.json (as a dict, the root or its ``text_config``) and return the typed config;
        ConfigError names the key."""
        root = dict(hf_config)
        text = root.get("text_config")
        if text is None and root.get("model_type") == "deepseek_v41":
            raise ConfigError(f"{_WHERE}: required key 'text_config' is missing")
        cfg = dict(text) if isinstance(text, dict) else root
        prefix = "text_config." if isinstance(text, dict) else ""
        for key in ("torch_dtype", "dtype", "eos_token_id", "bos_token_id", "tie_word_embeddings"):
            if key not in cfg and key in root:
                cfg[key] = root[key]
        f = ConfigKeys(cfg, _WHERE, prefix=prefix)
        f.only("hidden_act", "silu")
        f.only("scoring_func", "sqrtsoftplus")
        f.only("topk_method", "noaux_tc")
        if f.optional("num_key_value_heads", int, 1) != 1:
            raise f.error(f"{f.name('num_key_value_heads')} must be 1 (one shared latent K/V head)")
        layers = f.positive("num_hidden_layers")
        heads = f.positive("num_attention_heads")
        head_dim = f.positive("head_dim", 512)
        rope_dim = f.positive("qk_rope_head_dim", 64)
        if rope_dim % 2 or rope_dim > head_dim:
            raise f.error(f"{f.name('qk_rope_head_dim')} must be even and at most head_dim, got {rope_dim}")
        shared = latent_moe_values(
            f,
            layers,
            heads,
            head_dim,
            rope_dim,
            experts=384,
            low_rank=None,
            index_heads=32,
            rms_norm_eps=1e-20,
        )
        ratios = _int_list(f, "compress_ratios", required=True)
        if len(ratios) < layers:
            raise f.error(f"{f.name('compress_ratios')} lists {len(ratios)} layers, the model has {layers}")
        if any(r not in (0, 1, 2) for r in ratios):
            raise f.error(f"{f.name('compress_ratios')} entries must be 0, 1 or 2, got {ratios}")
        engram_ids = _int_list(f, "engram_layer_ids")
        built = cls(
            **shared,
            compress_ratios=tuple(ratios[:layers]),
            kv_source_layer_ids=tuple(_int_list(f, "kv_source_layer_ids")),
            index_source_layer_ids=tuple(_int_list(f, "index_source_layer_ids")),
            candidate_source_layer_id=f.optional("candidate_source_layer_id", int, -1),
            candidate_topk_blocks=f.positive("candidate_topk_blocks", 2048),
            candidate_block_size=f.positive("candidate_block_size", 8),
            engram_layer_ids=tuple(engram_ids),
            engram_num_embeddings=tuple(_int_list(f, "engram_num_embeddings")),
            engram_max_ngram_size=f.optional("engram_max_ngram_size", int, 1),
            engram_n_heads=f.optional("engram_n_heads", int, 0),
            engram_head_dim=f.optional("engram_head_dim", int, 0),
            engram_vocab_size=f.optional("engram_vocab_size", int, 0),
            engram_pad_token_id=f.optional("engram_pad_token_id", int, 2),
            engram_compressed_vocab_size=f.optional("engram_compressed_vocab_size", int, 0),
            **f.causal_lm_fields(max_position=1048576, bos_token_id=0),
        )
        _check_roles(built, f)
        return built


def _int_list(f: ConfigKeys, key: str, *, required: bool = False) -> list[int]:
    value = f.cfg.get(key)
    if value is None and not required:
        return []
    if not isinstance(value, list) or any(isinstance(v, bool) or not isinstance(v, int) for v in value):
        raise f.error(f"{f.name(key)} must be a list of integers, got {value!r}")
    return list(value)


def _check_roles(cfg: DeepseekV41ArchConfig, f: ConfigKeys) -> None:
    """Every compressed layer has a kv source of its ratio and an index source in its group; the candidate
    source is an index source after which no kv source starts a foreign group."""
    n = cfg.num_hidden_layers
    for key, ids in (
        ("kv_source_layer_ids", cfg.kv_source_layer_ids),
        ("index_source_layer_ids", cfg.index_source_layer_ids),
    ):
        for layer in ids:
            if not 0 <= layer < n or cfg.ratio(layer) == 0:
                raise f.error(f"{f.name(key)}: layer {layer} is not a compressed layer of the {n}")
    for layer in range(n):
        if cfg.ratio(layer) == 0:
            continue
        source = cfg.kv_source_of(layer)
        if source < 0 or cfg.ratio(source) != cfg.ratio(layer):
            raise f.error(
                f"{f.name('kv_source_layer_ids')}: layer {layer} (ratio {cfg.ratio(layer)}) has no kv source of "
                "its ratio at or before it"
            )
        if not any(source <= s <= layer for s in cfg.index_source_layer_ids):
            raise f.error(
                f"{f.name('index_source_layer_ids')}: layer {layer}'s group has no index source before it"
            )
    cand = cfg.candidate_source_layer_id
    if cand >= 0:
        if not cfg.is_index_source(cand):
            raise f.error(f"{f.name('candidate_source_layer_id')}: layer {cand} is not an index source")
        if any(s > cand for s in cfg.kv_source_layer_ids):
            raise f.error(
                f"{f.name('candidate_source_layer_id')}: a kv source after layer {cand} starts another pool"
            )
    if cfg.index_topk > 2048 or cfg.index_topk & (cfg.index_topk - 1):
        raise f.error(f"{f.name('index_topk')} must be a power of 2 up to 2048, got {cfg.index_topk}")
    if cfg.head_dim % 32 or cfg.index_head_dim % 32:
        raise f.error("'head_dim' and 'index_head_dim' must be multiples of 32 (the stored formats' blocks)")
    if cfg.engram_layer_ids:
        if len(cfg.engram_num_embeddings) != len(cfg.engram_layer_ids):
            raise f.error(f"{f.name('engram_num_embeddings')} needs one entry per 'engram_layer_ids' entry")
        if cfg.engram_max_ngram_size < 2 or cfg.engram_n_heads < 1 or cfg.engram_head_dim < 1:
            raise f.error(
                "'engram_max_ngram_size' >= 2, 'engram_n_heads' and 'engram_head_dim' >= 1 are needed for Engram"
            )
        if any(not 0 <= layer < n for layer in cfg.engram_layer_ids):
            raise f.error(f"{f.name('engram_layer_ids')}: a layer is out of range")
