"""GLM-5.3-Flash as released: which module each shipped checkpoint stores in which format.

Both releases keep transformers' ``glm5_next`` names (``model.language_model.layers.N.*``, ``lm_head``; the MTP
layer is ``layers.{num_hidden_layers}``). ``unsloth/GLM-5.3-Flash-FP8`` (``quant_method: fp8``) stores E4M3 with
an F32 ``weight_scale_inv`` per 128 x 128 block (a ceil grid) for the DSA attention's ``q_a_proj``, ``q_b_proj``,
``kv_a_proj_with_mqa`` and ``o_proj``, the dense MLPs, the shared experts and the routed experts (the MTP layer's
included); BF16 for the KDA projections and convolutions, ``kv_b_proj``, the indexer, the routers, the
hyper-connection ``fn``, the norms, ``eh_proj``, the embedding, the head and the vision tower; F32 for ``A_log``,
``dt_bias``, the correction bias and the hyper-connection ``base`` / ``scale``.
``HawkBearPig/GLM-5.3-Flash-NVFP4-FP8`` (``quant_method: dgpp_mixed``) holds the same bytes but for the main stack's
routed experts, which are compressed-tensors NVFP4 triples (``weight_packed`` U8 ``[N, K/2]``, ``weight_scale``
E4M3 ``[N, K/16]``, ``weight_global_scale`` F32 ``[1]``; core's ``dgpp.quant.scheme`` reads that config).

Which Linear stays dense is read from the checkpoint when its tensor names are at hand (a ``.weight`` with no
``.weight_scale_inv`` beside it), else from the list above (``release_dense_modules``: the memory plan, which reads
no tensor); either list joins ``quantization_config.modules_to_not_convert``.
"""

from __future__ import annotations

import dataclasses
import re
from collections.abc import Iterable, Mapping
from typing import Any

from dgpp.plugin_api import ConfigError, LoadContext, Model, checkpoint_tensor_names, load_family_weights
from dgpp_glm.glm5_next_config import Glm5NextArchConfig

KEY = "quantization_config"
FP8_SCALE = "weight_scale_inv"
# the Linears of a KDA layer's mixer, of a DSA layer's MLA and indexer that the releases keep in BF16
KDA_PROJECTIONS = (
    "q_proj",
    "k_proj",
    "v_proj",
    "f_a_proj",
    "f_b_proj",
    "g_a_proj",
    "g_b_proj",
    "b_proj",
    "o_proj",
)
DSA_DENSE = ("kv_b_proj", "indexer.wq_b", "indexer.wk", "indexer.weights_proj")
# the vision tower's Linears (``model.visual.``), per block and in the merger
VISION_BLOCK_DENSE = ("attn.qkv", "attn.proj", "mlp.gate_proj", "mlp.up_proj", "mlp.down_proj")
VISION_MERGER_DENSE = ("proj", "gate_proj", "up_proj", "down_proj")


def release_dense_modules(cfg: Glm5NextArchConfig) -> list[str]:
    """The Linear modules (checkpoint names) both releases store in BF16: per KDA layer its projections, per DSA
    layer (and MTP layer) ``kv_b_proj`` and the indexer's, per MoE layer its router, the MTP layer's ``eh_proj``,
    the head and every Linear of the vision tower."""
    out = ["lm_head"]
    if cfg.vision is not None:
        blocks = range(cfg.vision.depth)
        out += [f"model.visual.blocks.{b}.{p}" for b in blocks for p in VISION_BLOCK_DENSE]
        out += [f"model.visual.merger.{p}" for p in VISION_MERGER_DENSE]
    for i in range(cfg.num_hidden_layers + cfg.num_mtp_layers):
        layer = f"{cfg.weight_prefix}layers.{i}."
        mtp = i >= cfg.num_hidden_layers
        if not mtp and cfg.is_linear(i):
            out += [f"{layer}self_attn.{p}" for p in KDA_PROJECTIONS]
        else:
            out += [f"{layer}self_attn.{p}" for p in DSA_DENSE]
        if mtp or cfg.is_moe_layer(i):
            out.append(f"{layer}mlp.gate")
        if mtp:
            out.append(f"{layer}eh_proj")
    return out


def stored_dense_modules(tensor_names: Iterable[str]) -> list[str]:
    """The modules a checkpoint stores dense: the owner of a ``.weight`` with no ``.weight_scale_inv`` beside it."""
    names = set(tensor_names)
    return sorted(
        n[: -len(".weight")]
        for n in names
        if n.endswith(".weight") and n[: -len(".weight")] + "." + FP8_SCALE not in names
    )


def release_hf_config(hf_config: Mapping[str, Any], dense: Iterable[str]) -> dict[str, Any]:
    """``hf_config`` with the modules ``dense`` names added to ``quantization_config.modules_to_not_convert`` (one
    anchored alternation, tried once per module); a config without ``quantization_config`` is returned as is."""
    out = dict(hf_config)
    qc = out.get(KEY)
    if qc is None:
        return out
    if not isinstance(qc, dict):
        raise ConfigError(f"{KEY}: expected an object, got {type(qc).__name__}")
    ignore = list(qc.get("modules_to_not_convert") or [])
    modules = sorted(set(dense))
    if modules:
        ignore.append("re:^(" + "|".join(re.escape(m) for m in modules) + ")$")
    out[KEY] = {**qc, "modules_to_not_convert": ignore}
    return out


def check_expert_layers(hf_config: Mapping[str, Any], cfg: Glm5NextArchConfig) -> None:
    """A ``dgpp_mixed`` config's NVFP4 layers must be exactly the main stack's MoE layers (the MTP layer's experts are
    the FP8 release's): another list describes a checkpoint that is not this release."""
    qc = hf_config.get(KEY)
    if not isinstance(qc, dict) or qc.get("quant_method") != "dgpp_mixed":
        return
    routed = qc.get("routed_experts")
    listed = routed.get("layers") if isinstance(routed, dict) else None
    want = [i for i in range(cfg.num_hidden_layers) if cfg.is_moe_layer(i)]
    if listed != want:
        raise ConfigError(
            f"{KEY}.routed_experts.layers: must list exactly the main stack's MoE layers {want}, got {listed!r}"
        )


def plan_hf_config(hf_config: Mapping[str, Any], cfg: Glm5NextArchConfig) -> dict[str, Any]:
    """The config the memory plan resolves formats from (no tensor read): the release's BF16 modules dense."""
    check_expert_layers(hf_config, cfg)
    return release_hf_config(hf_config, release_dense_modules(cfg))


def release_context(ctx: LoadContext, cfg: Glm5NextArchConfig) -> LoadContext:
    """``ctx`` with the ``quantization_config`` the loader resolves: what the checkpoint stores dense stays dense."""
    check_expert_layers(ctx.hf_config, cfg)
    dense = stored_dense_modules(checkpoint_tensor_names(ctx.checkpoint_dir))
    return dataclasses.replace(ctx, hf_config=release_hf_config(ctx.hf_config, dense))


def load_model(ctx: LoadContext) -> Model:
    """GLM-5.3-Flash's own load (a model hook): core's pipeline with the formats the checkpoint's names resolve."""
    from dgpp_glm.glm5_next import Glm5NextForCausalLM, checkpoint_name

    cfg = Glm5NextArchConfig.from_hf_config(ctx.hf_config)
    ctx = release_context(ctx, cfg)
    dtype = ctx.dtype or cfg.dtype
    return load_family_weights(
        ctx, lambda: Glm5NextForCausalLM(cfg, dtype=dtype, world=ctx.world, group=ctx.group), checkpoint_name
    )
