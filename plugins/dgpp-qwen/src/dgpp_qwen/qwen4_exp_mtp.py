"""Qwen3.8-Flash-Next's multi-token-prediction (MTP) layer: the drafter behind ``dgpp_build_draft``.

Checkpoint layout (``mtp.*``, dropped by transformers when it loads the main model):
``pre_fc_norm_embedding`` and ``pre_fc_norm_hidden`` (zero-centred RMSNorms), ``fc`` ``[H, 2H]`` over
``[norm(embedding) | norm(hidden)]``, ``layers.0`` (a QSA decoder layer with its own gated residuals,
indexer and MoE) and ``hyper_connection_mixer`` (its own final stream mixer). It shares the main model's
embedding and LM head.

Row ``r`` at position ``p`` takes the main model's mixed hidden state at ``p`` (``model.last_hidden``)
and the token at ``p + 1``; ``fc``'s output is copied into every residual stream, runs the layer over the
drafter's own paged K/V and index keys (positions as the main model's), and the mixer's output predicts
the token at ``p + 2``. Deeper drafts run the same layer again on its own output.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

import torch
from torch import nn

from dgpp.nn.embedding import LMHead, VocabEmbedding
from dgpp.nn.linear import Linear
from dgpp.nn.norm import RMSNorm
from dgpp.plugin_api import CacheSpec, ForwardBatch, collect_cache_entries
from dgpp_qwen.config import MTP_PREFIX
from dgpp_qwen.layers.attention import build_rotary
from dgpp_qwen.layers.gated_residual import GatedResidual
from dgpp_qwen.qwen4_exp import Qwen4ExpDecoderLayer, Qwen4ExpForCausalLM


@dataclass
class _MainVocab:
    """The main model's embedding and head, held without registering them (so they are not reloaded)."""

    embed: VocabEmbedding
    head: LMHead


class Qwen4ExpMTPDrafter(nn.Module):
    """One MTP layer over the engine's pools (entries ``mtp.layers.0`` and ``mtp.layers.0.indexer``).

    ``forward(batch, previous_hidden, step)`` returns the mixed hidden rows at ``batch.logits_indices``
    (``last_hidden`` keeps all rows, for chaining deeper drafts); ``compute_logits`` applies the main head.
    ``batch.input_ids`` are the tokens one position ahead of ``batch.positions``.
    """

    def __init__(self, main: Qwen4ExpForCausalLM) -> None:
        super().__init__()
        # the MTP block is a QSA layer and never carries PLE
        cfg = dataclasses.replace(
            main.cfg, base=dataclasses.replace(main.cfg.base, layer_types=("full_attention",)), ngram=None
        )
        base = cfg.base
        self.cfg = cfg
        hidden, eps, dtype = base.hidden_size, base.rms_norm_eps, base.dtype
        self.pre_fc_norm_embedding = RMSNorm(hidden, eps, zero_centered=True, dtype=dtype)
        self.pre_fc_norm_hidden = RMSNorm(hidden, eps, zero_centered=True, dtype=dtype)
        self.fc = Linear(2 * hidden, hidden, dtype=dtype)  # replicated: the hidden stays replicated
        rotary = build_rotary(base)
        self.layers = nn.ModuleList(
            [Qwen4ExpDecoderLayer(cfg, 0, rotary, main.world, main.group, cache_name=f"{MTP_PREFIX}layers.0")]
        )
        self.hyper_connection_mixer = GatedResidual(
            hidden, cfg.hc_count, cfg.hc_lowrank, eps, dtype=dtype, use_combine=False
        )
        self._main = _MainVocab(main.model.embed_tokens, main.lm_head)
        self.last_hidden: torch.Tensor | None = None

    def cache_spec(self) -> dict[str, CacheSpec]:
        return collect_cache_entries(self, self.cfg.base.dtype)  # the layer declares its entries

    @torch.no_grad()
    def forward(self, batch: ForwardBatch, previous_hidden: torch.Tensor, step: int = 0) -> torch.Tensor:
        layer = self.layers[step % len(self.layers)]
        embedded = self.pre_fc_norm_embedding(self._main.embed(batch.input_ids))
        hidden = self.pre_fc_norm_hidden(previous_hidden.to(embedded.dtype))
        x = self.fc(torch.cat([embedded, hidden], dim=-1))
        hyper, normed = layer(x.repeat(1, self.cfg.hc_count), batch, then=self.hyper_connection_mixer)
        self.last_hidden = self.hyper_connection_mixer.mix_only(hyper, normed)
        return self.last_hidden[batch.logits_indices]

    @torch.no_grad()
    def compute_logits(self, hidden: torch.Tensor, step: int = 0) -> torch.Tensor:
        # every draft depth goes through the main model's head
        return self._main.head(hidden)
