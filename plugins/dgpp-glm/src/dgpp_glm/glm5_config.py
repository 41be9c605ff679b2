"""HF ``config.json`` of a ``glm_moe_dsa`` checkpoint (full GLM-5.3) -> a typed architecture config.

The indexer schedule is read as transformers reads it: an explicit ``indexer_types`` list, else an
``index_topk_pattern`` string of ``F``/``S``, else ``full`` iff ``max(i - offset + 1, 0) % freq == 0``
with ``index_topk_freq`` (default 1) and ``index_skip_topk_offset`` (default 2). Release GLM-5.3 ships
freq 4 / offset 3 (21 full layers); a config without them runs the indexer on every layer.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

from dgpp.nn.rotary import YarnScaling
from dgpp.plugin_api import COMPUTE_DTYPES, ConfigError
from dgpp_glm.config import _eos, _opt, _positive, _quant_method, _req

_WHAT = "glm_moe_dsa config.json"


@dataclass(frozen=True)
class GlmMoeDsaArchConfig:
    """Architecture of ``GlmMoeDsaForCausalLM``: MLA with a DSA indexer (``full`` layers select, ``shared``
    layers reuse), ``mlp_layer_types`` dense MLPs then GLM's sigmoid-routed MoE."""

    vocab_size: int
    hidden_size: int
    intermediate_size: int
    moe_intermediate_size: int
    num_hidden_layers: int
    num_attention_heads: int
    q_lora_rank: int
    kv_lora_rank: int
    qk_nope_head_dim: int
    qk_rope_head_dim: int
    v_head_dim: int
    rope_theta: float
    yarn: YarnScaling | None
    rms_norm_eps: float
    attention_bias: bool
    max_position_embeddings: int
    mlp_layer_types: tuple[str, ...]
    indexer_types: tuple[str, ...]
    index_n_heads: int
    index_head_dim: int
    index_topk: int
    n_routed_experts: int
    n_shared_experts: int
    num_experts_per_tok: int
    n_group: int
    topk_group: int
    norm_topk_prob: bool
    routed_scaling_factor: float
    num_mtp_layers: int
    tie_word_embeddings: bool
    dtype: torch.dtype
    eos_token_ids: tuple[int, ...] = ()
    bos_token_id: int | None = None
    quant_method: str | None = None

    def is_moe_layer(self, layer_idx: int) -> bool:
        return self.mlp_layer_types[layer_idx] == "sparse"

    def runs_indexer(self, layer_idx: int) -> bool:
        return self.indexer_types[layer_idx] == "full"


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
        freq = max(_opt(cfg, "index_topk_freq", int, 1), 1)
        offset = _opt(cfg, "index_skip_topk_offset", int, 2)
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


def _rope(cfg: dict[str, Any]) -> tuple[float, YarnScaling | None]:
    params = cfg.get("rope_parameters") or cfg.get("rope_scaling") or {}
    theta = params.get("rope_theta", cfg.get("rope_theta", 10000.0))
    if not isinstance(theta, (int, float)) or theta <= 0:
        raise _err(f"'rope_theta' must be a positive number, got {theta!r}")
    rope_type = params.get("rope_type", params.get("type", "default"))
    if rope_type == "default":
        return float(theta), None
    if rope_type != "yarn":
        raise _err(f"rope_parameters.rope_type={rope_type!r} is not supported (only 'default' and 'yarn')")
    try:
        yarn = YarnScaling(
            factor=float(params["factor"]),
            original_max_position=int(params["original_max_position_embeddings"]),
            beta_fast=float(params.get("beta_fast") or 32.0),
            beta_slow=float(params.get("beta_slow") or 1.0),
            attention_factor=params.get("attention_factor"),
            mscale=params.get("mscale"),
            mscale_all_dim=params.get("mscale_all_dim"),
            truncate=bool(params.get("truncate", True)),
        )
    except KeyError as missing:
        raise _err(f"rope_parameters: yarn needs {missing.args[0]!r}") from None
    return float(theta), yarn


def parse_glm_moe_dsa_config(cfg: dict[str, Any]) -> GlmMoeDsaArchConfig:
    """Validate ``cfg`` (config.json as a dict) and return the typed config; ConfigError names the key."""
    req = lambda key, kind=int: _req_named(cfg, key, kind)  # noqa: E731
    opt = lambda key, kind, default: _opt_named(cfg, key, kind, default)  # noqa: E731
    if cfg.get("hidden_act", "silu") != "silu":
        raise _err(f"'hidden_act'={cfg['hidden_act']!r} is not supported (only 'silu')")
    layers = _pos("num_hidden_layers", req("num_hidden_layers"))
    heads = _pos("num_attention_heads", req("num_attention_heads"))
    if opt("num_key_value_heads", int, heads) != heads:
        raise _err(
            f"'num_key_value_heads' must equal 'num_attention_heads'={heads} (kv_b_proj expands every head)"
        )
    q_lora = req("q_lora_rank") if cfg.get("q_lora_rank") is not None else None
    if q_lora is None:
        raise _err("'q_lora_rank' is required (the indexer reads the low-rank q)")
    rope_dim = _pos("qk_rope_head_dim", req("qk_rope_head_dim"))
    index_dim = _pos("index_head_dim", opt("index_head_dim", int, 128))
    if rope_dim % 2 or rope_dim > index_dim:
        raise _err(f"'qk_rope_head_dim'={rope_dim} must be even and at most 'index_head_dim'={index_dim}")
    experts = _pos("n_routed_experts", req("n_routed_experts"))
    n_group = _pos("n_group", opt("n_group", int, 1))
    if experts % n_group or opt("topk_group", int, 1) > n_group:
        raise _err(
            f"'n_routed_experts'={experts} / 'n_group'={n_group} / 'topk_group' do not form expert groups"
        )
    first_dense = opt("first_k_dense_replace", int, 3)
    mlp_types = tuple(
        cfg.get("mlp_layer_types")
        or ["dense"] * min(first_dense, layers) + ["sparse"] * max(layers - first_dense, 0)
    )
    if len(mlp_types) != layers or not set(mlp_types) <= {"dense", "sparse"}:
        raise _err(f"'mlp_layer_types' must list 'dense'/'sparse' for each of the {layers} layers")
    dtype_name = cfg.get("dtype", cfg.get("torch_dtype")) or "bfloat16"
    if dtype_name not in COMPUTE_DTYPES:
        raise _err(f"'torch_dtype'={dtype_name!r} is not supported ({', '.join(COMPUTE_DTYPES)})")
    theta, yarn = _rope(cfg)
    return GlmMoeDsaArchConfig(
        vocab_size=_pos("vocab_size", req("vocab_size")),
        hidden_size=_pos("hidden_size", req("hidden_size")),
        intermediate_size=_pos("intermediate_size", req("intermediate_size")),
        moe_intermediate_size=_pos("moe_intermediate_size", req("moe_intermediate_size")),
        num_hidden_layers=layers,
        num_attention_heads=heads,
        q_lora_rank=_pos("q_lora_rank", q_lora),
        kv_lora_rank=_pos("kv_lora_rank", req("kv_lora_rank")),
        qk_nope_head_dim=_pos("qk_nope_head_dim", req("qk_nope_head_dim")),
        qk_rope_head_dim=rope_dim,
        v_head_dim=_pos("v_head_dim", req("v_head_dim")),
        rope_theta=theta,
        yarn=yarn,
        rms_norm_eps=opt("rms_norm_eps", float, 1e-5),
        attention_bias=opt("attention_bias", bool, False),
        max_position_embeddings=_pos("max_position_embeddings", opt("max_position_embeddings", int, 202752)),
        mlp_layer_types=mlp_types,
        indexer_types=indexer_types(cfg, layers),
        index_n_heads=_pos("index_n_heads", opt("index_n_heads", int, 32)),
        index_head_dim=index_dim,
        index_topk=_pos("index_topk", opt("index_topk", int, 2048)),
        n_routed_experts=experts,
        n_shared_experts=opt("n_shared_experts", int, 1),
        num_experts_per_tok=_pos("num_experts_per_tok", req("num_experts_per_tok")),
        n_group=n_group,
        topk_group=opt("topk_group", int, 1),
        norm_topk_prob=opt("norm_topk_prob", bool, True),
        routed_scaling_factor=opt("routed_scaling_factor", float, 1.0),
        num_mtp_layers=opt("num_nextn_predict_layers", int, 0),
        tie_word_embeddings=opt("tie_word_embeddings", bool, False),
        dtype=COMPUTE_DTYPES[dtype_name],
        eos_token_ids=_eos(cfg),
        bos_token_id=cfg.get("bos_token_id"),
        quant_method=_quant_method(cfg),
    )


def _req_named(cfg: dict[str, Any], key: str, kind: type) -> Any:
    try:
        return _req(cfg, key, kind)
    except ConfigError as e:  # the shared checks name glm4_moe; say which config this is
        raise _err(str(e).split(": ", 1)[1]) from None


def _opt_named(cfg: dict[str, Any], key: str, kind: type, default: Any) -> Any:
    return default if cfg.get(key) is None else _req_named(cfg, key, kind)


def _pos(name: str, value: int) -> int:
    try:
        return _positive(name, value)
    except ConfigError as e:
        raise _err(str(e).split(": ", 1)[1]) from None
