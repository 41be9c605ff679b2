"""HF ``config.json`` of a ``deepseek_v4`` checkpoint -> a typed architecture config.

DeepSeek-V4 (transformers' ``DeepseekV4Config``): per layer an attention kind (``layer_types``: sliding only,
CSA ``compressed_sparse_attention``, HCA ``heavily_compressed_attention``, or the release's per-layer
``compress_ratios`` 0 / 4 / 128) and an MoE kind (``mlp_layer_types``: ``hash_moe`` on the first
``num_hash_layers``, else ``moe``). Sliding layers rotate with ``rope_theta``; compressed layers, their
compressors and indexers with ``compress_rope_theta`` and the YaRN parameters of ``rope_scaling`` /
``rope_parameters`` (cos/sin unscaled: the attention factor is 1). Values this family does not compute are
refused by key name.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any, Literal

from dgpp.nn.rotary import ROPE_TYPES, YarnScaling
from dgpp.plugin_api import CausalLMFields, ConfigError, ConfigKeys

SLIDING, CSA, HCA = "sliding_attention", "compressed_sparse_attention", "heavily_compressed_attention"
_RATIO_TO_TYPE = {0: SLIDING, 4: CSA, 128: HCA}
_MLP_TYPES = ("hash_moe", "moe")
_WHERE = "deepseek_v4 config.json"


@dataclass(frozen=True, kw_only=True)
class LatentMoEFields(CausalLMFields):
    """What V4 and V4.1 share: low-rank queries over one shared latent K/V head, the grouped low-rank output, the
    sliding window, the indexer, the MoE and the hyper-connections (``latent_moe_values`` reads them)."""

    vocab_size: int
    hidden_size: int
    moe_intermediate_size: int
    num_hidden_layers: int
    num_attention_heads: int
    head_dim: int
    rope_head_dim: int
    q_lora_rank: int
    o_groups: int
    o_lora_rank: int
    sliding_window: int
    index_n_heads: int
    index_head_dim: int
    index_topk: int
    rope_theta: float
    compress_rope_theta: float
    compress_yarn: YarnScaling | None
    n_routed_experts: int
    n_shared_experts: int
    num_experts_per_tok: int
    norm_topk_prob: bool
    routed_scaling_factor: float
    swiglu_limit: float
    hc_mult: int
    hc_sinkhorn_iters: int
    hc_eps: float
    rms_norm_eps: float
    num_nextn_predict_layers: int


@dataclass(frozen=True, kw_only=True)
class DeepseekV4ArchConfig(LatentMoEFields):
    layer_types: tuple[str, ...]
    compress_rates: dict[str, int]
    mlp_layer_types: tuple[str, ...]
    scoring_func: Literal["sqrtsoftplus", "softmax", "sigmoid"]

    def ratio(self, layer_idx: int) -> int:
        """Compression ratio of a layer (0: sliding only)."""
        kind = self.layer_types[layer_idx]
        return 0 if kind == SLIDING else self.compress_rates[kind]

    @classmethod
    def from_hf_config(cls, hf_config: Mapping[str, Any]) -> DeepseekV4ArchConfig:
        """Validate config.json (as a dict) and return the typed config; ConfigError names the key."""
        cfg = dict(hf_config)
        f = ConfigKeys(cfg, _WHERE)
        f.only("hidden_act", "silu")
        for key in ("attention_bias", "mlp_bias"):
            if cfg.get(key):
                raise ConfigError(
                    f"{_WHERE}: {key!r}=true is not supported (DeepSeek-V4 projections carry no bias)"
                )
        if f.optional("num_key_value_heads", int, 1) != 1:
            raise ConfigError(f"{_WHERE}: 'num_key_value_heads' must be 1 (one shared latent K/V head)")
        layers = f.positive("num_hidden_layers")
        heads = f.positive("num_attention_heads")
        head_dim = f.positive("head_dim", 512)
        rope_dim = cfg.get("qk_rope_head_dim")
        if rope_dim is None:
            rope_dim = int(head_dim * float(cfg.get("partial_rotary_factor") or 64 / 512))
        if not isinstance(rope_dim, int) or rope_dim <= 0 or rope_dim % 2 or rope_dim > head_dim:
            raise ConfigError(
                f"{_WHERE}: 'qk_rope_head_dim' must be even and at most head_dim, got {rope_dim!r}"
            )
        scoring = f.optional("scoring_func", str, "sqrtsoftplus")
        if scoring not in ("sqrtsoftplus", "softmax", "sigmoid"):
            raise ConfigError(f"{_WHERE}: 'scoring_func'={scoring!r} is not supported")
        shared = latent_moe_values(
            f,
            layers,
            heads,
            head_dim,
            rope_dim,
            experts=256,
            low_rank=1024,
            index_heads=64,
            rms_norm_eps=1e-6,
        )
        return cls(
            **shared,
            layer_types=_layer_types(cfg, layers),
            compress_rates=_compress_rates(cfg),
            mlp_layer_types=_mlp_types(cfg, layers),
            scoring_func=scoring,
            **f.causal_lm_fields(max_position=1048576),
        )


def latent_moe_values(
    f: ConfigKeys,
    layers: int,
    heads: int,
    head_dim: int,
    rope_dim: int,
    *,
    experts: int,
    low_rank: int | None,
    index_heads: int,
    rms_norm_eps: float,
) -> dict[str, Any]:
    """``LatentMoEFields``' values (not ``CausalLMFields``'), checked: heads a multiple of ``o_groups``, the
    index head wide enough for the rope dims, top-k within the experts, a window of at least 2. The defaults
    that differ between releases are passed: ``experts`` (``n_routed_experts``), ``low_rank`` (``q_lora_rank``
    and ``o_lora_rank``; None: required), ``index_heads`` (``index_n_heads``) and ``rms_norm_eps``."""
    groups = f.positive("o_groups", 8)
    if heads % groups:
        raise f.error(f"{f.name('num_attention_heads')}={heads} is not a multiple of 'o_groups'={groups}")
    index_head_dim = f.positive("index_head_dim", 128)
    if rope_dim > index_head_dim:
        raise f.error(f"{f.name('index_head_dim')}={index_head_dim} is smaller than the rope dims {rope_dim}")
    routed = f.positive("n_routed_experts", experts)
    top_k = f.positive("num_experts_per_tok", 6)
    if top_k > routed:
        raise f.error(f"{f.name('num_experts_per_tok')}={top_k} exceeds 'n_routed_experts'={routed}")
    window = f.positive("sliding_window", 128)
    if window < 2:
        raise f.error(f"{f.name('sliding_window')}={window} must cover at least 2 tokens")
    index_topk = f.positive("index_topk", 512)
    theta, compress_theta, yarn = _rope(f)
    return {
        "vocab_size": f.positive("vocab_size"),
        "hidden_size": f.positive("hidden_size"),
        "moe_intermediate_size": f.positive("moe_intermediate_size"),
        "num_hidden_layers": layers,
        "num_attention_heads": heads,
        "head_dim": head_dim,
        "rope_head_dim": rope_dim,
        "q_lora_rank": f.positive("q_lora_rank", low_rank),
        "o_groups": groups,
        "o_lora_rank": f.positive("o_lora_rank", low_rank),
        "sliding_window": window,
        "index_n_heads": f.positive("index_n_heads", index_heads),
        "index_head_dim": index_head_dim,
        "index_topk": index_topk,
        "rope_theta": theta,
        "compress_rope_theta": compress_theta,
        "compress_yarn": yarn,
        "n_routed_experts": routed,
        "n_shared_experts": f.optional("n_shared_experts", int, 1),
        "num_experts_per_tok": top_k,
        "norm_topk_prob": f.optional("norm_topk_prob", bool, True),
        "routed_scaling_factor": f.optional("routed_scaling_factor", float, 1.5),
        "swiglu_limit": f.optional("swiglu_limit", float, 10.0),
        "hc_mult": f.positive("hc_mult", 4),
        "hc_sinkhorn_iters": f.positive("hc_sinkhorn_iters", 20),
        "hc_eps": f.optional("hc_eps", float, 1e-6),
        "rms_norm_eps": f.optional("rms_norm_eps", float, rms_norm_eps),
        "num_nextn_predict_layers": f.optional("num_nextn_predict_layers", int, 0),
    }


def _layer_types(cfg: dict[str, Any], layers: int) -> tuple[str, ...]:
    """``layer_types``, else the release's ``compress_ratios``, else transformers' default (2 HCA, then CSA /
    HCA alternating)."""
    types = cfg.get("layer_types")
    if types is None and cfg.get("compress_ratios") is not None:
        ratios = cfg["compress_ratios"]
        bad = [r for r in ratios if r not in _RATIO_TO_TYPE] if isinstance(ratios, list) else ratios
        if bad:
            raise ConfigError(f"{_WHERE}: 'compress_ratios' entries must be 0, 4 or 128, got {bad!r}")
        types = [_RATIO_TO_TYPE[r] for r in ratios]
    if types is None:
        types = [HCA] * min(layers, 2) + [CSA if i % 2 else HCA for i in range(max(layers - 2, 0))]
    if not isinstance(types, list) or len(types) < layers:
        raise ConfigError(f"{_WHERE}: 'layer_types' must list one type per layer ({layers}), got {types!r}")
    for t in types[:layers]:
        if t not in (SLIDING, CSA, HCA):
            raise ConfigError(
                f"{_WHERE}: 'layer_types' entry {t!r} is not supported ({SLIDING}, {CSA}, {HCA})"
            )
    return tuple(types[:layers])


def _mlp_types(cfg: dict[str, Any], layers: int) -> tuple[str, ...]:
    types = cfg.get("mlp_layer_types")
    if types is None:
        n_hash = ConfigKeys(cfg, _WHERE).optional("num_hash_layers", int, 3)
        types = ["hash_moe"] * min(layers, n_hash) + ["moe"] * max(0, layers - n_hash)
    if not isinstance(types, list) or len(types) < layers or any(t not in _MLP_TYPES for t in types[:layers]):
        raise ConfigError(
            f"{_WHERE}: 'mlp_layer_types' must list 'hash_moe' or 'moe' per layer, got {types!r}"
        )
    return tuple(types[:layers])


def _compress_rates(cfg: dict[str, Any]) -> dict[str, int]:
    rates = dict(cfg.get("compress_rates") or {CSA: 4, HCA: 128})
    for key, kind in (("compress_rate_csa", CSA), ("compress_rate_hca", HCA)):
        if cfg.get(key) is not None:
            rates[kind] = cfg[key]
    for kind in (CSA, HCA):
        if not isinstance(rates.get(kind), int) or rates[kind] < 1:
            raise ConfigError(
                f"{_WHERE}: 'compress_rates.{kind}' must be a positive integer, got {rates.get(kind)!r}"
            )
    return rates


def _rope(keys: ConfigKeys) -> tuple[float, float, YarnScaling | None]:
    """(sliding theta, compressed theta, compressed YaRN) from nested ``rope_parameters`` (main / compress) or
    the flat form (``rope_scaling`` / ``rope_parameters`` holding the YaRN keys, the thetas at the top level)."""
    params = keys.cfg.get("rope_parameters")
    if params is not None and not isinstance(params, dict):
        raise ConfigError(f"{_WHERE}: 'rope_parameters' must be an object, got {params!r}")
    top_theta = keys.optional("rope_theta", float, 10000.0)
    compress_theta = keys.optional("compress_rope_theta", float, 160000.0)
    supported = ("default", "yarn")
    if isinstance(params, dict) and isinstance(params.get("compress"), dict):
        # the main entry's type is not read: sliding layers rotate with plain RoPE
        main = params.get("main")
        theta = keys.rope(supported=ROPE_TYPES, section="main").theta if isinstance(main, dict) else top_theta
        compress = keys.rope(
            supported, section="compress", default_theta=compress_theta, original_fallback=False
        )
    else:
        theta = top_theta
        compress = dataclasses.replace(keys.rope(supported, original_fallback=False), theta=compress_theta)
    yarn = compress.yarn
    if yarn is not None and yarn.attention_factor is None:
        yarn = dataclasses.replace(
            yarn, attention_factor=1.0
        )  # cos/sin unscaled unless the block says otherwise
    return theta, compress.theta, yarn
