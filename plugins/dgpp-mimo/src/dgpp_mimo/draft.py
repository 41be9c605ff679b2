"""MiMo-V2.6's multi-token-prediction (MTP) layers: the drafter behind ``dgpp_build_draft``.

Checkpoint layout (transformers drops all of it): layer ``K`` is ``model.mtp.layers.K.*``: ``enorm``, ``hnorm``,
``eh_proj [H, 2H]`` (BF16), a pre-norm block (``input_layernorm``, a sliding-window attention ``self_attn``
shaped like the main model's sliding layers, ``pre_mlp_layernorm``, a dense SwiGLU ``mlp``) and
``final_layernorm``; the embedding and the head are the main model's. Its attention is stored like the main
layers' (a fused FP8 ``qkv_proj``, read through ``dgpp_mimo.v26_checkpoint``).

Row ``r`` at position ``p`` takes the main model's post-final-norm hidden of ``p`` and the token at ``p + 1``:
``x = eh_proj([enorm(embed(tok)) | hnorm(h)])``, runs the block, and predicts the token at ``p + 2`` with
``lm_head(final_layernorm(x))``; the normed row is what a deeper draft is fed. The attention keeps its K/V in
the paged pool (a drafter's cache is paged, so speculative rollback needs no state snapshot) and reads the
window (``sliding_window`` keys, the current token included) through ``dgpp.kernels.window_attention``.

The release ships 3 layers; ``engine.mtp_depth`` of them are loaded (the shipped template drafts one token from
layer 0), and draft step ``s`` runs layer ``s % loaded``.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from dgpp.kernels.window_attention import window_attention
from dgpp.nn.attention import store_kv
from dgpp.nn.decoder import PreNormBlock
from dgpp.nn.embedding import LMHead, VocabEmbedding
from dgpp.nn.linear import Linear
from dgpp.nn.mlp import SwiGLUMLP
from dgpp.nn.norm import RMSNorm
from dgpp.nn.sliding_attention import SinkAttention
from dgpp.plugin_api import (
    CacheSpec,
    ConfigError,
    ForwardBatch,
    LoadContext,
    PagedKV,
    collect_cache_entries,
    load_family_weights,
)
from dgpp_mimo.config import MimoArchConfig
from dgpp_mimo.model import MimoAttention, MimoV2FlashForCausalLM

MTP_PREFIX = "model.mtp."
SLIDING = "sliding_attention"


def mtp_cache_name(layer: int) -> str:
    return f"mtp.{layer}.self_attn"


class PagedWindowAttention(SinkAttention):
    """``SinkAttention`` over a sliding window whose K/V stay in the paged pool (every position kept, the window
    applied when reading) rather than in a per-request ring: a drafter's cache is paged."""

    def cache_spec(self, dtype: torch.dtype) -> PagedKV:
        return PagedKV(self.num_kv_heads, self.head_dim, dtype, v_head_dim=self.v_head_dim, fp8_rows=True)

    def forward(
        self,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        batch: ForwardBatch,
        sinks: torch.Tensor | None,
    ) -> torch.Tensor:
        k_cache, v_cache = batch.cache.kv[self.cache_name]
        scales = store_kv(batch, self.cache_name, k, v)  # e4m3 rows and their scales under kv_dtype fp8
        out = window_attention(
            q,
            None,
            None,
            k_cache,
            v_cache,
            batch.block_tables,
            batch.query_start_loc,
            batch.context_lens,
            batch.seq_lens,
            sinks,
            self.scale,
            self.window,
            True,
            scales,
        )
        return out.flatten(1)


def mtp_config(cfg: MimoArchConfig) -> MimoArchConfig:
    """``cfg`` as seen by an MTP layer: one sliding-window layer with a dense MLP."""
    if SLIDING not in cfg.attention:
        raise ConfigError("the MTP layers attend like the sliding-window layers, and this config has none")
    return dataclasses.replace(cfg, num_hidden_layers=1, layer_types=(SLIDING,), mlp_layer_types=("dense",))


class MimoMTPLayer(PreNormBlock):
    """One ``model.mtp.layers.K``: the pre-norm block plus ``enorm`` / ``hnorm`` / ``eh_proj`` /
    ``final_layernorm`` (``pre_mlp_layernorm`` is the block's ``post_attention_layernorm``)."""

    def __init__(self, cfg: MimoArchConfig, layer: int, *, dtype: torch.dtype, world) -> None:
        attn = MimoAttention(cfg, 0, dtype=dtype, world=world)
        core = attn.attn
        attn.attn = PagedWindowAttention(
            mtp_cache_name(layer),
            core.num_heads,
            core.num_kv_heads,
            core.head_dim,
            window=cfg.sliding_window,
            v_head_dim=core.v_head_dim,
        )
        super().__init__(
            RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, dtype=dtype),
            attn,
            RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, dtype=dtype),
            SwiGLUMLP(cfg.hidden_size, cfg.intermediate_size, dtype=dtype, world=world),
            world,
        )
        self.enorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, dtype=dtype)
        self.hnorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, dtype=dtype)
        # replicated: 2H x H is small next to the experts, and it keeps the hidden replicated
        self.eh_proj = Linear(2 * cfg.hidden_size, cfg.hidden_size, dtype=dtype)
        self.final_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, dtype=dtype)


def mtp_checkpoint_name(name: str) -> str:
    """``layers.K.x`` in the drafter is ``model.mtp.layers.K.x`` in the checkpoint."""
    return MTP_PREFIX + name.replace(".post_attention_layernorm.", ".pre_mlp_layernorm.")


@dataclass
class _MainVocab:
    """The main model's embedding and head, held without registering them (the drafter's load neither looks
    for nor reloads them)."""

    embed: VocabEmbedding
    head: LMHead


class MimoMTPDrafter(nn.Module):
    """``layers`` MTP layers over the engine's paged pool (one cache entry each); see the module docstring."""

    def __init__(self, cfg: MimoArchConfig, main: MimoV2FlashForCausalLM, layers: int) -> None:
        super().__init__()
        self.config = mtp_config(cfg)
        self.dtype, self.world, self.group = main.dtype, main.world, main.group
        self.layers = nn.ModuleList(
            MimoMTPLayer(self.config, k, dtype=main.dtype, world=main.world) for k in range(layers)
        )
        self._main = _MainVocab(main.model.embed_tokens, main.lm_head)
        self.last_hidden: torch.Tensor | None = None

    def cache_spec(self) -> dict[str, CacheSpec]:
        return collect_cache_entries(self, self.dtype)  # each layer's attention declares its paged entry

    @torch.no_grad()
    def forward(self, batch: ForwardBatch, previous_hidden: torch.Tensor, step: int = 0) -> torch.Tensor:
        layer = self.layers[step % len(self.layers)]
        e = layer.enorm(self._main.embed(batch.input_ids))
        h = layer.hnorm(previous_hidden.to(self.dtype))
        x = layer(layer.eh_proj(torch.cat([e, h], dim=-1)), batch, self.group)
        x = layer.final_layernorm(x)
        self.last_hidden = x
        return x[batch.logits_indices]

    @torch.no_grad()
    def compute_logits(self, hidden: torch.Tensor, step: int = 0) -> torch.Tensor:
        return self._main.head(hidden)


def load_drafter(
    ctx: LoadContext, cfg: MimoArchConfig, model: MimoV2FlashForCausalLM, layers: int, **loading
) -> MimoMTPDrafter:
    """The drafter with ``layers`` MTP layers filled from the checkpoint (``loading``: the reader and scheme of
    ``load_family_weights``); a missing MTP tensor is a ``CheckpointError`` naming it."""
    return load_family_weights(
        ctx, lambda: MimoMTPDrafter(cfg, model, layers), mtp_checkpoint_name, **loading
    )


def drafter_memory(
    cfg: MimoArchConfig,
    model: MimoV2FlashForCausalLM,
    layers: int,
    scheme,
    bf16_weights: str,
    hf_config: dict[str, Any],
) -> tuple[dict[str, CacheSpec], int]:
    """The drafter's cache entries and resident bytes, built on ``meta`` beside ``model`` (the memory plan)."""
    from dgpp.plugin_api import quantize_modules
    from dgpp.quant.resident import resident_bytes

    with torch.device("meta"):
        drafter = MimoMTPDrafter(cfg, model, layers)
        quantize_modules(drafter, hf_config, rename=mtp_checkpoint_name, scheme=scheme)
    return drafter.cache_spec(), resident_bytes(drafter, bf16_weights)
