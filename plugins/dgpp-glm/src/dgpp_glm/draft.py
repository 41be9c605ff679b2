"""GLM-4.x multi-token prediction (MTP) layers: the drafter a speculative step will run.

Checkpoint layout: MTP layer ``i`` is ``model.layers.{num_hidden_layers + i}.*``: a full decoder block
(``self_attn``, ``mlp`` (MoE), ``input_layernorm``, ``post_attention_layernorm``) plus ``enorm``,
``hnorm``, ``eh_proj`` ``[H, 2H]`` and ``shared_head.norm``. Some releases repeat the embedding
(``embed_tokens``) and head (``shared_head.head``) inside the layer; others leave them out, and the
layer then uses the main model's. transformers drops all of it when loading the main model.

Row ``r`` at position ``p`` takes the main model's post-final-norm hidden of position ``p`` and the
token at ``p + 1``: ``x = eh_proj([enorm(embed(tok)) | hnorm(h)])``, runs the block over its own paged
KV (positions as the main model's), and predicts the token at ``p + 2`` with
``shared_head.head(shared_head.norm(x))``.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from dgpp.nn.embedding import LMHead, VocabEmbedding
from dgpp.nn.linear import Linear
from dgpp.nn.norm import RMSNorm
from dgpp.plugin_api import (
    CacheSpec,
    CheckpointError,
    ForwardBatch,
    LoadContext,
    World,
    checkpoint_tensor_names,
    collect_cache_entries,
    load_family_weights,
)
from dgpp_glm.config import Glm4MoeArchConfig
from dgpp_glm.model import Glm4MoeDecoderLayer, Glm4MoeForCausalLM, checkpoint_name


def mtp_cache_name(step: int) -> str:
    return f"mtp.{step}.self_attn"


class SharedHead(nn.Module):
    """``shared_head.norm`` (always the layer's own) and ``shared_head.head`` (when the layer has one)."""

    def __init__(
        self,
        cfg: Glm4MoeArchConfig,
        dtype: torch.dtype,
        own_head: bool,
        world: World | None = None,
        group: Any = None,
    ) -> None:
        super().__init__()
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, dtype=dtype)
        # vocab-parallel under TP like the main head: a rank loads only its rows of the copy
        self.head = (
            LMHead(cfg.vocab_size, cfg.hidden_size, dtype=dtype, world=world, group=group)
            if own_head
            else None
        )


def add_mtp_parts(
    layer: nn.Module, cfg, *, dtype: torch.dtype, world, group, own_embed: bool, own_head: bool
) -> None:
    """Give a decoder block the MTP-only modules, named as in the checkpoint (any GLM config: the same fields)."""
    layer.enorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, dtype=dtype)
    layer.hnorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, dtype=dtype)
    # replicated: 2H x H is small next to the experts, and it keeps the hidden replicated
    layer.eh_proj = Linear(2 * cfg.hidden_size, cfg.hidden_size, dtype=dtype)
    layer.embed_tokens = VocabEmbedding(cfg.vocab_size, cfg.hidden_size, dtype=dtype) if own_embed else None
    layer.shared_head = SharedHead(cfg, dtype, own_head, world, group)


class Glm4MoeMTPLayer(Glm4MoeDecoderLayer):
    """One MTP layer: the decoder block's modules plus the MTP-only ones, named as in the checkpoint."""

    def __init__(
        self,
        cfg: Glm4MoeArchConfig,
        step: int,
        *,
        dtype: torch.dtype,
        world,
        own_embed: bool,
        own_head: bool,
        group: Any = None,
    ):
        # layer index past the stack: is_moe_layer() is true there, as the release's MTP block is MoE
        super().__init__(cfg, cfg.num_hidden_layers + step, mtp_cache_name(step), dtype=dtype, world=world)
        add_mtp_parts(
            self, cfg, dtype=dtype, world=world, group=group, own_embed=own_embed, own_head=own_head
        )


def mtp_layer_prefix(cfg, step: int = 0) -> str:
    """Where MTP layer ``step`` lives in the checkpoint: ``model.layers.{num_hidden_layers + step}.`` (GLM-5.3-Flash's
    multimodal wrapper: under ``model.language_model.``, its config's ``weight_prefix``)."""
    return f"{getattr(cfg, 'weight_prefix', 'model.')}layers.{cfg.num_hidden_layers + step}."


def mtp_checkpoint_name(cfg: Glm4MoeArchConfig, name: str) -> str:
    """``layers.{i}.x`` in the drafter is ``model.layers.{num_hidden_layers + i}.x`` in the checkpoint."""
    parts = name.split(".", 2)
    if len(parts) < 3 or parts[0] != "layers":  # the quantizer also asks about container modules
        return name
    return checkpoint_name(mtp_layer_prefix(cfg, int(parts[1])) + parts[2])


@dataclass
class _MainVocab:
    """The main model's embedding and head, held without registering them as submodules (so the
    drafter's load neither looks for nor reloads them)."""

    embed: VocabEmbedding
    head: LMHead


class GlmMTPDrafter(nn.Module):
    """The MTP layers of a GLM checkpoint over the engine's paged caches; a family states its layers, their
    cache entries and how its block runs (``run_block``).

    ``forward(batch, previous_hidden, step)`` returns the pre-head hidden rows at ``batch.logits_indices``
    (``last_hidden`` keeps all rows, for chaining deeper drafts); ``compute_logits`` applies
    ``shared_head.norm`` and the head. ``batch.input_ids`` are the tokens one position ahead of
    ``batch.positions``.
    """

    def __init__(
        self, cfg, main: nn.Module, layers: Iterable[nn.Module], embed: VocabEmbedding | None = None
    ) -> None:
        super().__init__()
        if cfg.num_mtp_layers < 1:
            raise ValueError("config has no MTP layers (num_nextn_predict_layers = 0)")
        self.config = cfg
        self.dtype = main.dtype
        self.world = main.world
        self.group = main.group
        self.layers = nn.ModuleList(layers)
        # ``embed``: the main model's embedding where it is not ``main.model.embed_tokens``
        self._main = _MainVocab(embed or main.model.embed_tokens, main.lm_head)
        self.last_hidden: torch.Tensor | None = None

    def cache_spec(self) -> dict[str, CacheSpec]:
        """The entries the MTP layers' attention declares (under the names the layers were built with)."""
        return collect_cache_entries(self, self.dtype)

    def checkpoint_name(self, name: str) -> str:
        return mtp_checkpoint_name(self.config, name)

    def run_block(self, layer: nn.Module, x: torch.Tensor, batch: ForwardBatch) -> torch.Tensor:
        return layer(x, batch, self.group)

    @torch.no_grad()
    def forward(self, batch: ForwardBatch, previous_hidden: torch.Tensor, step: int = 0) -> torch.Tensor:
        layer = self.layers[step % len(self.layers)]
        embed = self._main.embed if layer.embed_tokens is None else layer.embed_tokens
        e = layer.enorm(embed(batch.input_ids))
        h = layer.hnorm(previous_hidden.to(self.dtype))
        x = layer.eh_proj(torch.cat([e, h], dim=-1))
        x = self.run_block(layer, x, batch)
        self.last_hidden = x
        return x[batch.logits_indices]

    @torch.no_grad()
    def compute_logits(self, hidden: torch.Tensor, step: int = 0) -> torch.Tensor:
        shared = self.layers[step % len(self.layers)].shared_head
        head = self._main.head if shared.head is None else shared.head
        return head(shared.norm(hidden))


class Glm4MoeMTPDrafter(GlmMTPDrafter):
    """GLM-4.x's MTP layers: GQA + MoE blocks, one paged K/V entry per layer."""

    def __init__(
        self, cfg: Glm4MoeArchConfig, main: Glm4MoeForCausalLM, *, own_embed: bool, own_head: bool
    ) -> None:
        layers = [
            Glm4MoeMTPLayer(
                cfg,
                i,
                dtype=main.dtype,
                world=main.world,
                own_embed=own_embed,
                own_head=own_head,
                group=main.group,
            )
            for i in range(cfg.num_mtp_layers)
        ]
        super().__init__(cfg, main, layers)


@dataclass(frozen=True)
class MTPLayout:
    """How a checkpoint stores MTP layer 0: its own embedding / head copies, and packed (quantized) or dense."""

    own_embed: bool
    own_head: bool
    packed: bool
    indexer: bool = False  # a DSA indexer in the block (GLM-5.3)

    @classmethod
    def of(cls, names: Iterable[str], cfg) -> MTPLayout:
        first = mtp_layer_prefix(cfg)
        mtp = [n for n in names if n.startswith(first)]
        if first + "eh_proj.weight" not in mtp:
            raise CheckpointError(
                f"config.json declares num_nextn_predict_layers={cfg.num_mtp_layers} but tensor "
                f"{first + 'eh_proj.weight'!r} is missing from the checkpoint"
            )
        # NVFP4 releases ship the MTP layer in BF16 (or graft it in later), whether or not their
        # exclude list names it: it is packed only if its tensors carry scales (FP8 blocks: ``weight_scale_inv``)
        return cls(
            own_embed=first + "embed_tokens.weight" in mtp,
            own_head=first + "shared_head.head.weight" in mtp,
            packed=any(n.endswith((".weight_scale", ".weight_scale_inv")) for n in mtp),
            indexer=first + "self_attn.indexer.wk.weight" in mtp,
        )


def load_mtp(ctx: LoadContext, cfg, make: Callable[[MTPLayout], GlmMTPDrafter]) -> GlmMTPDrafter | None:
    """The drafter ``make`` builds for the checkpoint's MTP layout, weights loaded; None without an MTP layer."""
    if cfg.num_mtp_layers == 0:
        return None
    names = checkpoint_tensor_names(ctx.checkpoint_dir)
    try:
        layout = MTPLayout.of(names, cfg)
    except CheckpointError as e:
        raise CheckpointError(f"{e} in {ctx.checkpoint_dir}") from None
    return load_family_weights(
        ctx, lambda: make(layout), lambda name: mtp_checkpoint_name(cfg, name), packed=layout.packed
    )


def build_draft(ctx: LoadContext, model: Glm4MoeForCausalLM) -> GlmMTPDrafter | None:
    """The MTP drafter for ``model``'s checkpoint, weights loaded; None when it has no MTP layer."""
    cfg = Glm4MoeArchConfig.from_hf_config(ctx.hf_config)
    return load_mtp(
        ctx,
        cfg,
        lambda layout: Glm4MoeMTPDrafter(cfg, model, own_embed=layout.own_embed, own_head=layout.own_head),
    )
