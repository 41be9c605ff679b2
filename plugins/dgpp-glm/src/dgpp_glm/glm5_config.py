"""HF ``config.json`` of a ``glm_moe_dsa`` checkpoint (full GLM-5.3) -> a typed architecture config.

The indexer schedule is read as transformers reads it: an explicit ``indexer_types`` list, else an
``index_topk_pattern`` string of ``F``/``S``, else ``full`` iff ``max(i - offset + 1, 0) % freq == 0``
with ``index_topk_freq`` (default 1) and ``index_skip_topk_offset`` (default 2). Release GLM-5.3 ships
freq 4 / offset 3 (21 full layers); a config without them runs the indexer on every layer.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from dgpp.nn.rotary import RopeScaling, YarnScaling
from dgpp.plugin_api import ConfigError, ConfigKeys
from dgpp_glm.config import GlmMoeFields, shared_fields

_WHAT = "glm_moe_dsa config.json"


@dataclass(frozen=True, kw_only=True)
class GlmMoeDsaArchConfig(GlmMoeFields):
    """Architecture of ``GlmMoeDsaForCausalLM``: MLA with a DSA indexer (``full`` layers select, ``shared``
    layers reuse), ``mlp_layer_types`` dense MLPs then GLM's sigmoid-routed MoE."""

    q_lora_rank: int
    kv_lora_rank: int
    qk_nope_head_dim: int
    qk_rope_head_dim: int
    v_head_dim: int
    rope: RopeScaling  # rope_theta (GlmMoeFields) is its theta
    mlp_layer_types: tuple[str, ...]
    indexer_types: tuple[str, ...]
    index_n_heads: int
    index_head_dim: int
    index_topk: int

    @property
    def yarn(self) -> YarnScaling | None:
        return self.rope.yarn

    def is_moe_layer(self, layer_idx: int) -> bool:
        return self.mlp_layer_types[layer_idx] == "sparse"

    def runs_indexer(self, layer_idx: int) -> bool:
        return self.indexer_types[layer_idx] == "full"

    @classmethod
    def from_hf_config(cls, hf_config: Mapping[str, Any]) -> GlmMoeDsaArchConfig:
        """Validate config.json (as a dict) and return the typed config; ConfigError names the key."""
        cfg = dict(hf_config)
        keys = ConfigKeys(cfg, _WHAT)
        shared = shared_fields(keys, max_position=202752)
        layers = keys.positive("num_hidden_layers")
        heads = keys.positive("num_attention_heads")
        if keys.optional("num_key_value_heads", int, heads) != heads:
            raise _err(
                f"'num_key_value_heads' must equal 'num_attention_heads'={heads} (kv_b_proj expands every head)"
            )
        if cfg.get("q_lora_rank") is None:
            raise _err("'q_lora_rank' is required (the indexer reads the low-rank q)")
        rope_dim = keys.positive("qk_rope_head_dim")
        index_dim = keys.positive("index_head_dim", 128)
        if rope_dim % 2 or rope_dim > index_dim:
            raise _err(f"'qk_rope_head_dim'={rope_dim} must be even and at most 'index_head_dim'={index_dim}")
        experts = keys.positive("n_routed_experts")
        n_group = keys.positive("n_group", 1)
        topk_group = keys.optional("topk_group", int, 1)
        if experts % n_group or topk_group > n_group:
            raise _err(
                f"'n_routed_experts'={experts} / 'n_group'={n_group} / 'topk_group' do not form expert groups"
            )
        first_dense = keys.optional("first_k_dense_replace", int, 3)
        mlp_types = tuple(
            cfg.get("mlp_layer_types")
            or ["dense"] * min(first_dense, layers) + ["sparse"] * max(layers - first_dense, 0)
        )
        if len(mlp_types) != layers or not set(mlp_types) <= {"dense", "sparse"}:
            raise _err(f"'mlp_layer_types' must list 'dense'/'sparse' for each of the {layers} layers")
        rope = keys.rope(supported=("default", "yarn"))
        return cls(
            **shared,
            num_hidden_layers=layers,
            num_attention_heads=heads,
            q_lora_rank=keys.positive("q_lora_rank"),
            kv_lora_rank=keys.positive("kv_lora_rank"),
            qk_nope_head_dim=keys.positive("qk_nope_head_dim"),
            qk_rope_head_dim=rope_dim,
            v_head_dim=keys.positive("v_head_dim"),
            rope_theta=rope.theta,
            rope=rope,
            mlp_layer_types=mlp_types,
            indexer_types=indexer_types(cfg, layers),
            index_n_heads=keys.positive("index_n_heads", 32),
            index_head_dim=index_dim,
            index_topk=keys.positive("index_topk", 2048),
            n_routed_experts=experts,
            num_experts_per_tok=keys.positive("num_experts_per_tok"),
            n_group=n_group,
            topk_group=topk_group,
            num_mtp_layers=keys.optional("num_nextn_predict_layers", int, 0),
        )


def _err(msg: str) -> ConfigError:
    return ConfigError(f"{_WHAT}: {msg}")


def indexer_types(cfg: dict[str, Any], layers: int) -> tuple[str, ...]:
    explicit = cfg.get("indexer_types")
    pattern = cfg.get("index_topk_pattern")
    if explicit is None and pattern is not None:
        codes = {"F": "full", "S": "shared"}
        if isinstance(pattern, str) and set(pattern) <= set(codes):
            explicit = [codes[c] for c in pattern]
        else:
            explicit = pattern
    if explicit is None:
        keys = ConfigKeys(cfg, _WHAT)
        freq = max(keys.optional("index_topk_freq", int, 1), 1)
        offset = keys.optional("index_skip_topk_offset", int, 2)
        explicit = ["full" if max(i - offset + 1, 0) % freq == 0 else "shared" for i in range(layers)]
    kinds = tuple(explicit)
    if len(kinds) != layers or not set(kinds) <= {"full", "shared"}:
        raise _err(
            f"'indexer_types' must list 'full'/'shared' for each of the {layers} layers, got {list(kinds)!r}"
        )
    if kinds[0] != "full":
        raise _err(
            "'indexer_types'[0] must be 'full': a 'shared' layer reuses the previous layer's selection"
        )
    return kinds
