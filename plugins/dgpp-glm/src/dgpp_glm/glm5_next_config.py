"""HF ``config.json`` of a ``glm5_next`` checkpoint (GLM-5.3-Flash) -> a typed architecture config.

The text model's keys sit under ``text_config`` (``Glm5NextForConditionalGeneration``, tensors under
``model.language_model.``) or at the top level (a flat, text-only config, tensors under ``model.``). Layers
follow ``layer_types``: ``linear_attention`` (Kimi delta attention, KDA) or ``indexed_attention`` (NoPE MLA with
the k-pooled DSA indexer; the release's ``deepseek_sparse_attention`` and an older ``full_attention`` mean the
same); absent, every fourth layer (``idx % 4 == 3``) is indexed. Keys only the release's own parser reads
(``mla_use_nope``, ``scoring_func``, ``topk_method``, ``mhc`` ...) are accepted where they describe what this
model computes and refused by name where they do not. A nested config's ``vision_config`` describes the vision
tower (``dgpp_glm.glm5_next_vision``), built beside the text model.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from dgpp.plugin_api import ConfigKeys
from dgpp_glm.config import GlmMoeFields, shared_fields
from dgpp_glm.glm5_config import indexer_types
from dgpp_glm.glm5_next_vision import Glm5NextVisionConfig

_WHAT = "glm5_next config.json"
LINEAR = "linear_attention"
INDEXED = "indexed_attention"
_INDEXED_ALIASES = {"indexed_attention", "full_attention", "deepseek_sparse_attention"}
# top-level keys a nested config keeps outside text_config that the text model reads
_TOP_LEVEL = (
    "dtype",
    "torch_dtype",
    "eos_token_id",
    "bos_token_id",
    "tie_word_embeddings",
    "quantization_config",
)
# release keys whose only served value is the one named (anything else computes another model)
_RELEASE_ONLY = {
    "scoring_func": "sigmoid",
    "topk_method": "noaux_tc",
    "moe_router_dtype": "float32",
    "mla_use_nope": True,
    "index_kpool_compress": True,
    "mhc": True,
}


@dataclass(frozen=True, kw_only=True)
class Glm5NextArchConfig(GlmMoeFields):
    """Architecture of ``Glm5NextForCausalLM``: KDA and NoPE MLA/DSA layers by ``layer_types``, mHC residual
    streams, dense MLPs then GLM's sigmoid-routed MoE, SwiGLU clamped at ``swiglu_limit`` everywhere."""

    layer_types: tuple[str, ...]
    mlp_layer_types: tuple[str, ...]
    indexer_types: tuple[str, ...]
    q_lora_rank: int
    kv_lora_rank: int
    qk_nope_head_dim: int
    v_head_dim: int
    index_n_heads: int
    index_head_dim: int
    index_topk: int
    index_kpool: int
    linear_num_heads: int
    linear_head_dim: int
    linear_conv_kernel: int
    linear_lower_bound: float | None  # None: the softplus decay form
    hc_mult: int
    hc_eps: float
    hc_sinkhorn_iters: int
    swiglu_limit: float | None
    weight_prefix: str = "model."  # where the text model's tensors live in the checkpoint
    vision: Glm5NextVisionConfig | None = None  # the vision tower (``model.visual.``) of a nested config

    def is_moe_layer(self, layer_idx: int) -> bool:
        return self.mlp_layer_types[layer_idx] == "sparse"

    def is_linear(self, layer_idx: int) -> bool:
        return self.layer_types[layer_idx] == LINEAR

    def runs_indexer(self, layer_idx: int) -> bool:
        return self.indexer_types[layer_idx] == "full"

    @classmethod
    def from_hf_config(cls, hf_config: Mapping[str, Any]) -> Glm5NextArchConfig:
        """Validate config.json (as a dict) and return the typed config; ConfigError names the key."""
        top = dict(hf_config)
        nested = isinstance(top.get("text_config"), dict)
        if nested:
            text = {k: top[k] for k in _TOP_LEVEL if top.get(k) is not None}
            text.update({k: v for k, v in top["text_config"].items() if v is not None})
            keys, prefix = ConfigKeys(text, _WHAT, prefix="text_config."), "model.language_model."
        else:
            keys, prefix = ConfigKeys(top, _WHAT), "model."
        cfg = keys.cfg
        for key, served in _RELEASE_ONLY.items():
            if cfg.get(key) is not None and cfg[key] != served:
                raise keys.error(f"{keys.name(key)}={cfg[key]!r} is not supported (only {served!r})")
        shared = shared_fields(keys, max_position=1048576)
        layers = keys.positive("num_hidden_layers")
        heads = keys.positive("num_attention_heads")
        if keys.optional("num_key_value_heads", int, heads) != heads:
            raise keys.error(
                f"{keys.name('num_key_value_heads')} must equal 'num_attention_heads'={heads} "
                "(kv_b_proj expands every head)"
            )
        if keys.optional("qk_rope_head_dim", int, 0) != 0:
            raise keys.error(f"{keys.name('qk_rope_head_dim')} must be 0: GLM-5.3-Flash's MLA has no RoPE")
        if cfg.get("q_lora_rank") is None:
            raise keys.error(f"{keys.name('q_lora_rank')} is required (the indexer reads the low-rank q)")
        experts = keys.positive("n_routed_experts")
        n_group = keys.positive("n_group", 1)
        topk_group = keys.optional("topk_group", int, 1)
        if experts % n_group or topk_group > n_group:
            raise keys.error(
                f"'n_routed_experts'={experts} / 'n_group'={n_group} / 'topk_group' do not form expert groups"
            )
        layer_kinds = _layer_types(keys, layers)
        first_dense = keys.optional("first_k_dense_replace", int, 3)
        mlp_types = tuple(
            cfg.get("mlp_layer_types")
            or ["dense"] * min(first_dense, layers) + ["sparse"] * max(layers - first_dense, 0)
        )
        if len(mlp_types) != layers or not set(mlp_types) <= {"dense", "sparse"}:
            raise keys.error(f"'mlp_layer_types' must list 'dense'/'sparse' for each of the {layers} layers")
        index_types = _indexer_types(keys, layers, layer_kinds)
        topk, kpool = keys.positive("index_topk", 2048), keys.positive("index_kpool", 16)
        if topk % kpool:
            raise keys.error(f"'index_topk'={topk} must be a multiple of 'index_kpool'={kpool}")
        if not keys.optional("index_kpool_always_select_tail", bool, True):
            raise keys.error(
                f"{keys.name('index_kpool_always_select_tail')}=false is not supported (the open pool's tokens "
                "are always attended)"
            )
        linear = _linear_attention(keys)
        vision = None
        if nested and isinstance(top.get("vision_config"), dict):
            vision = Glm5NextVisionConfig.from_hf_config(top["vision_config"])
            if vision.out_hidden_size != shared["hidden_size"]:
                raise keys.error(
                    f"vision_config.out_hidden_size = {vision.out_hidden_size} must equal "
                    f"{keys.name('hidden_size')} = {shared['hidden_size']} (image rows replace token embeddings)"
                )
        hc_mult = keys.positive("hc_mult", 4)
        return cls(
            **shared,
            num_hidden_layers=layers,
            num_attention_heads=heads,
            rope_theta=0.0,  # no RoPE anywhere in the text model
            layer_types=layer_kinds,
            mlp_layer_types=mlp_types,
            indexer_types=index_types,
            q_lora_rank=keys.positive("q_lora_rank"),
            kv_lora_rank=keys.positive("kv_lora_rank"),
            qk_nope_head_dim=keys.positive("qk_nope_head_dim"),
            v_head_dim=keys.positive("v_head_dim"),
            index_n_heads=keys.positive("index_n_heads", 32),
            index_head_dim=keys.positive("index_head_dim", 128),
            index_topk=topk,
            index_kpool=kpool,
            **linear,
            hc_mult=hc_mult,
            hc_eps=keys.optional("hc_eps", float, 1e-6),
            hc_sinkhorn_iters=keys.positive("hc_sinkhorn_iters", 20),
            swiglu_limit=keys.optional("swiglu_limit", float, 10.0),
            n_routed_experts=experts,
            num_experts_per_tok=keys.positive("num_experts_per_tok"),
            n_group=n_group,
            topk_group=topk_group,
            num_mtp_layers=keys.optional("num_nextn_predict_layers", int, 0),
            weight_prefix=prefix,
            vision=vision,
        )


def _layer_types(keys: ConfigKeys, layers: int) -> tuple[str, ...]:
    given = keys.cfg.get("layer_types")
    if given is None:
        return tuple(INDEXED if i % 4 == 3 else LINEAR for i in range(layers))
    if not isinstance(given, list) or len(given) != layers or not set(given) <= {LINEAR, *_INDEXED_ALIASES}:
        raise keys.error(
            f"{keys.name('layer_types')} must list 'linear_attention'/'indexed_attention' for each of the "
            f"{layers} layers, got {given!r}"
        )
    return tuple(LINEAR if t == LINEAR else INDEXED for t in given)


def _indexer_types(keys: ConfigKeys, layers: int, kinds: tuple[str, ...]) -> tuple[str, ...]:
    """Per layer ``full``/``shared`` (read as for full GLM-5.3). A ``shared`` indexed layer reuses the selection
    of the layer right before it, which must then be an indexed layer running its own indexer."""
    index_types = list(indexer_types(dict(keys.cfg, indexer_types=keys.cfg.get("indexer_types")), layers))
    for i, kind in enumerate(kinds):
        if kind == INDEXED and index_types[i] == "shared":
            if i == 0 or kinds[i - 1] != INDEXED or index_types[i - 1] != "full":
                raise keys.error(
                    f"{keys.name('indexer_types')}[{i}]='shared' needs layer {i - 1} to be an indexed layer "
                    "running its own indexer (a 'shared' layer reuses the selection of the layer before it)"
                )
    return tuple(index_types)


def _linear_attention(keys: ConfigKeys) -> dict[str, Any]:
    """KDA's sizes: the flat ``linear_*`` keys, overridden by a ``linear_attn_config`` block where it has them."""
    block = keys.cfg.get("linear_attn_config") or {}
    if not isinstance(block, dict):
        raise keys.error(f"{keys.name('linear_attn_config')} must be an object")
    sub = ConfigKeys(block, _WHAT, prefix=f"{keys.prefix}linear_attn_config.")
    lower = block.get("gate_lower_bound", keys.cfg.get("linear_lower_bound", -5.0))
    if lower is None and sub.optional("safe_gate", bool, True):
        lower = -5.0
    if lower is not None and (isinstance(lower, bool) or not isinstance(lower, (int, float)) or lower >= 0):
        raise keys.error(f"the KDA gate lower bound must be a negative number, got {lower!r}")
    return {
        "linear_num_heads": sub.positive("num_heads", keys.positive("linear_num_heads", 64)),
        "linear_head_dim": sub.positive("head_dim", keys.positive("linear_head_dim", 128)),
        "linear_conv_kernel": sub.positive(
            "short_conv_kernel_size", keys.positive("linear_conv_kernel_dim", 4)
        ),
        "linear_lower_bound": None if lower is None else float(lower),
    }
