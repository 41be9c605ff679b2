"""The release's draft blocks (``mtp.<s>.*``: V4-Flash's MTP, the 0731 release's three DSpark stages), loaded
and named, so that every tensor of the release has a home under its own name (the memory plan counts them),
sliced for TP like the main layers. The DSpark stages run as ``engine.mtp``'s block drafter
(``dgpp_deepseek.dspark``); the base release's single MTP block is held, not run.

A stage is a decoder block like the main ones (``DeepseekV4Block``: hyper-connections, attention, a learned
top-k MoE: drafter routers ship ``gate.bias``, never ``tid2eid``) plus the stage's own tensors, found by name
in the checkpoint and kept as shipped: 2-D ``X.weight`` as a replicated ``Linear`` (packed when a ``.scale``
sits beside it), 1-D ``X.weight`` as an fp32 ``RMSNorm`` weight, ``hc_head_{fn,base,scale}`` as the stage's
``HyperHead``, anything else (e.g. DSpark's ``markov_head.markov_w1``) as a parameter of its stored dtype. The
stage's attention kind follows its tensors: a compressor with an indexer is CSA, without one HCA, none sliding.
"""

from __future__ import annotations

import dataclasses
import re
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import torch
from torch import nn

from dgpp.nn.hyper_connections import HyperHead
from dgpp.nn.linear import Linear
from dgpp.nn.norm import RMSNorm
from dgpp.nn.weights import default_weight_loader, set_weight_attrs
from dgpp.plugin_api import CheckpointError, CheckpointReader, World
from dgpp_deepseek.config import CSA, HCA, SLIDING, DeepseekV4ArchConfig
from dgpp_deepseek.model import DeepseekV4Block, DeepseekV4ForCausalLM

_STAGE = re.compile(r"^mtp\.(\d+)\.(.+)$")
# what the block itself holds (its tensors' names after ``mtp.<s>.``)
_BLOCK = re.compile(r"^(attn|ffn|attn_norm|ffn_norm)\.|^hc_(attn|ffn)_(fn|base|scale)$")
_HC_HEAD = ("hc_head_fn", "hc_head_base", "hc_head_scale")

Shapes = Mapping[str, tuple[tuple[int, ...], torch.dtype]]


def _attention_kind(own: set[str]) -> str:
    if "attn.compressor.wkv.weight" not in own:
        return SLIDING
    return CSA if "attn.indexer.wq_b.weight" in own else HCA


def _child(root: nn.Module, dotted: str) -> tuple[nn.Module, str]:
    """The module that holds ``dotted``'s last part, creating empty containers along the way."""
    *path, leaf = dotted.split(".")
    node = root
    for part in path:
        if not hasattr(node, part):
            node.add_module(part, nn.Module())
        node = getattr(node, part)
    return node, leaf


def _add_extras(
    stage: nn.Module,
    own: dict[str, tuple[tuple[int, ...], torch.dtype]],
    cfg: DeepseekV4ArchConfig,
    dtype: torch.dtype,
) -> None:
    if all(name in own for name in _HC_HEAD):
        stage.hc_head = HyperHead(cfg.hidden_size, cfg.hc_mult, eps=cfg.hc_eps, norm_eps=cfg.rms_norm_eps)
    for name, (shape, stored) in sorted(own.items()):
        if _BLOCK.match(name) or name in _HC_HEAD or name.endswith(".scale"):
            continue
        if name.endswith(".weight") and len(shape) == 2:
            parent, leaf = _child(stage, name.removesuffix(".weight"))
            parent.add_module(leaf, Linear(shape[1], shape[0], dtype=dtype))
        elif name.endswith(".weight") and len(shape) == 1:
            parent, leaf = _child(stage, name.removesuffix(".weight"))
            parent.add_module(leaf, RMSNorm(shape[0], cfg.rms_norm_eps, dtype=torch.float32))
        else:
            parent, leaf = _child(stage, name)
            param = nn.Parameter(torch.empty(shape, dtype=stored), requires_grad=False)
            set_weight_attrs(param, weight_loader=default_weight_loader)
            parent.register_parameter(leaf, param)


def stage_shapes(checkpoint_dir: str | Path) -> dict[str, tuple[tuple[int, ...], torch.dtype]]:
    """(shape, dtype) of every ``mtp.*`` tensor of a checkpoint, from its headers (nothing is read)."""
    reader = CheckpointReader(checkpoint_dir)
    try:
        return {n: (reader.shape(n), reader.dtype(n)) for n in reader.names() if n.startswith("mtp.")}
    finally:
        reader.close()


def attach_draft_blocks(
    model: DeepseekV4ForCausalLM, cfg: DeepseekV4ArchConfig, checkpoint_dir: str | Path, *, world: World
) -> DeepseekV4ForCausalLM:
    """``model`` with the checkpoint's draft stages as ``model.mtp`` (none: unchanged)."""
    stages = build_draft_blocks(cfg, stage_shapes(checkpoint_dir), dtype=model.dtype, world=world)
    if stages is not None:
        model.mtp = stages
    return model


class DraftStages(nn.ModuleList):
    """The release's draft stages (``model.mtp``). They hold no cache of the target's: the DSpark drafter
    declares its own context rows (``dgpp_deepseek.dspark``)."""

    def cache_entries(self, dtype: torch.dtype) -> dict[str, Any]:
        return {}


def build_draft_blocks(
    cfg: DeepseekV4ArchConfig, shapes: Shapes, *, dtype: torch.dtype, world: World
) -> DraftStages | None:
    """The ``mtp`` stages the checkpoint ships (``shapes``: tensor name -> (shape, dtype)), or None."""
    own: dict[int, dict[str, tuple[tuple[int, ...], torch.dtype]]] = {}
    for name, info in shapes.items():
        m = _STAGE.match(name)
        if m:
            own.setdefault(int(m.group(1)), {})[m.group(2)] = info
    if not own:
        return None
    if sorted(own) != list(range(len(own))):
        raise CheckpointError(f"draft blocks: mtp stages {sorted(own)} are not numbered 0..{len(own) - 1}")
    kinds = tuple(_attention_kind(set(own[s])) for s in range(len(own)))
    # the stages' experts may differ from the main layers' (DSpark: fewer, as V4.1's): count them by name
    first = own[0]
    experts = 1 + max((int(n.split(".")[2]) for n in first if n.startswith("ffn.experts.")), default=-1)
    w1 = first.get("ffn.experts.0.w1.weight")
    stage_cfg = dataclasses.replace(
        cfg,
        layer_types=cfg.layer_types + kinds,
        mlp_layer_types=cfg.mlp_layer_types + ("moe",) * len(own),
        n_routed_experts=experts or cfg.n_routed_experts,
        num_experts_per_tok=min(cfg.num_experts_per_tok, experts or cfg.n_routed_experts),
        moe_intermediate_size=w1[0][0] if w1 else cfg.moe_intermediate_size,
    )
    stages = DraftStages()
    for s in range(len(own)):
        stage = DeepseekV4Block(stage_cfg, cfg.num_hidden_layers + s, dtype=dtype, world=world)
        _add_extras(stage, own[s], cfg, dtype)
        stages.append(stage)
    return stages
