"""DeepSeek-V4.1-Flash's DSpark draft stages (``mtp.<s>.*``), built from the config so that the memory plan counts
them without a checkpoint and the loader fills them by the release's names.

The release (``num_nextn_predict_layers`` 3, ``dspark_*`` keys in ``text_config``) ships three stages after the
40 layers. Each is a V4.1 decoder block (``DeepseekV41Block``: single-pass hyper-connections, CSA2 attention,
a MoE) on a window-only layer (``compress_ratios`` lists the stages after the layers; only 0 is read) whose
MoE has ``dspark_n_routed_experts`` experts of which ``dspark_num_experts_per_tok`` route (the release: 128,
top-3), with the main layers' intermediate size and shared expert. Stage 0 also holds ``main_proj``
(``len(dspark_target_layer_ids) x hidden -> hidden``) and ``main_norm``; the last stage ``norm``, the Markov
head (``markov_head.markov_w1`` / ``markov_w2``, ``[vocab, dspark_markov_rank]`` each) and the confidence head
(``confidence_head.proj``, ``[1, hidden + rank]``). The stages run as a block drafter
(``dgpp_deepseek.v41_dspark``) and are built only with ``engine.mtp`` on.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from dgpp.nn.linear import Linear
from dgpp.nn.window_compressor import FP32WeightRMSNorm
from dgpp.plugin_api import CheckpointError, World
from dgpp_deepseek.draft_blocks import DraftStages
from dgpp_deepseek.dspark import DSparkConfig
from dgpp_deepseek.v41_config import DeepseekV41ArchConfig
from dgpp_deepseek.v41_model import DeepseekV41Block
from dgpp_deepseek.v41_packed_entries import EntryFormats


@dataclass(frozen=True)
class DSparkV41Config:
    """V4.1's ``dspark_*`` keys (the ones V4 shares, then the Markov rank and the stages' routing) and the stage
    count (``num_nextn_predict_layers``)."""

    common: DSparkConfig
    stages: int
    markov_rank: int
    experts: int
    experts_per_tok: int

    @classmethod
    def from_text_config(cls, text: Mapping[str, Any], cfg: DeepseekV41ArchConfig) -> DSparkV41Config | None:
        """None for a checkpoint without DSpark stages; a ``CheckpointError`` names a key out of range."""
        stages = text.get("num_nextn_predict_layers") or 0
        common = DSparkConfig.from_hf_config(text, cfg)
        if common is None or not stages:
            return None
        if not isinstance(stages, int) or stages < 0:
            raise CheckpointError(f"config.json: 'num_nextn_predict_layers' must be a count, got {stages!r}")
        ratios = list(text.get("compress_ratios") or [])[cfg.num_hidden_layers :]
        if any(r != 0 for r in ratios[:stages]):
            raise CheckpointError(
                f"config.json: 'compress_ratios' gives the DSpark stages {ratios[:stages]}; they are window-only (0)"
            )
        values = []
        for key, default in (
            ("dspark_markov_rank", 256),
            ("dspark_n_routed_experts", cfg.n_routed_experts),
            ("dspark_num_experts_per_tok", cfg.num_experts_per_tok),
        ):
            value = text.get(key, default)
            if not isinstance(value, int) or value < 1:
                raise CheckpointError(f"config.json: {key!r} must be a positive integer, got {value!r}")
            values.append(value)
        rank, experts, top_k = values
        if top_k > experts:
            raise CheckpointError(
                f"config.json: 'dspark_num_experts_per_tok' {top_k} exceeds 'dspark_n_routed_experts' {experts}"
            )
        return cls(common, stages, rank, experts, top_k)


def stage_config(cfg: DeepseekV41ArchConfig, dspark: DSparkV41Config) -> DeepseekV41ArchConfig:
    """The main config with the stages appended as window-only layers and the stages' routing."""
    return dataclasses.replace(
        cfg,
        compress_ratios=cfg.compress_ratios + (0,) * dspark.stages,
        n_routed_experts=dspark.experts,
        num_experts_per_tok=dspark.experts_per_tok,
    )


def _submodule(parent: nn.Module, name: str, module: nn.Module) -> None:
    holder, leaf = name.split(".")
    if not hasattr(parent, holder):
        parent.add_module(holder, nn.Module())
    getattr(parent, holder).add_module(leaf, module)


def build_stages(
    cfg: DeepseekV41ArchConfig,
    dspark: DSparkV41Config,
    formats: EntryFormats,
    *,
    dtype: torch.dtype,
    world: World,
) -> DraftStages:
    """``mtp.0 .. mtp.<stages - 1>`` with their own tensors (see the module docstring)."""
    scfg = stage_config(cfg, dspark)
    hidden, eps, rank = cfg.hidden_size, cfg.rms_norm_eps, dspark.markov_rank
    stages = DraftStages()
    for s in range(dspark.stages):
        stage = DeepseekV41Block(
            scfg, cfg.num_hidden_layers + s, formats, dtype=dtype, world=world, index_topk=cfg.index_topk
        )
        if s == 0:
            width = len(dspark.common.target_layer_ids) * hidden
            stage.main_proj = Linear(width, hidden, dtype=dtype)
            stage.main_norm = FP32WeightRMSNorm(hidden, eps)
        if s == dspark.stages - 1:
            stage.norm = FP32WeightRMSNorm(hidden, eps)
            _submodule(stage, "markov_head.markov_w1", Linear(rank, cfg.vocab_size, dtype=dtype))
            _submodule(stage, "markov_head.markov_w2", Linear(rank, cfg.vocab_size, dtype=dtype))
            _submodule(stage, "confidence_head.proj", Linear(hidden + rank, 1, dtype=dtype))
        stages.append(stage)
    return stages
