"""The multi-token-prediction (MTP) layer of the Qwen3.5 hybrids (Qwen3.8-27B, Qwen3.5-122B-A10B): a drafter
behind ``dgpp_build_draft``.

Checkpoint layout (``mtp.*``, which transformers drops when it loads the main model): ``pre_fc_norm_embedding``
and ``pre_fc_norm_hidden`` (zero-centred RMSNorms), ``fc`` ``[H, 2H]`` over ``[norm(embedding) | norm(hidden)]``,
``layers.0`` (a full-attention decoder layer with the model's MLP or MoE) and ``norm`` (its final norm). The
embedding and LM head are the main model's.

Row ``r`` at position ``p`` takes the main model's final-normed hidden state at ``p`` (``model.last_hidden``)
and the token at ``p + 1``, runs the layer over the drafter's own paged K/V (pool entry ``mtp.layers.0``,
positions as the main model's), and predicts the token at ``p + 2``. Deeper drafts run the layer again on
its own output (``last_hidden``).
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
from dgpp_qwen.qwen3_5 import DecoderLayer, Qwen35ForCausalLM


@dataclass
class _SharedVocab:
    """The main model's embedding and head, held without registering them (so they are neither reloaded
    nor counted twice)."""

    embed: VocabEmbedding
    head: LMHead


class Qwen35MTPDrafter(nn.Module):
    """One MTP layer. ``forward(batch, previous_hidden, step)`` -> normed hidden rows at ``batch.logits_indices``
    (every row stays in ``last_hidden`` for deeper drafts); ``compute_logits`` applies the main head.
    ``batch.input_ids`` are the tokens one position ahead of ``batch.positions``."""

    def __init__(self, main: Qwen35ForCausalLM) -> None:
        super().__init__()
        cfg = dataclasses.replace(main.cfg, layer_types=("full_attention",), num_layers=1)
        hidden, eps, dtype = cfg.hidden_size, cfg.rms_norm_eps, cfg.dtype
        self.cfg = cfg
        self.pre_fc_norm_embedding = RMSNorm(hidden, eps, zero_centered=True, dtype=dtype)
        self.pre_fc_norm_hidden = RMSNorm(hidden, eps, zero_centered=True, dtype=dtype)
        self.fc = Linear(2 * hidden, hidden, dtype=dtype)  # replicated: the hidden state is replicated
        world, group = main.world, main.group
        self.layers = nn.ModuleList(
            [DecoderLayer(cfg, 0, build_rotary(cfg), world, group, cache_name=f"{MTP_PREFIX}layers.0")]
        )
        self.norm = RMSNorm(hidden, eps, zero_centered=True, dtype=dtype)
        self._vocab = _SharedVocab(main.model.embed_tokens, main.lm_head)
        self.last_hidden: torch.Tensor | None = None

    def cache_spec(self) -> dict[str, CacheSpec]:
        return collect_cache_entries(self, self.cfg.dtype)  # each layer declares its entry

    @torch.no_grad()
    def forward(self, batch: ForwardBatch, previous_hidden: torch.Tensor, step: int = 0) -> torch.Tensor:
        embedded = self.pre_fc_norm_embedding(self._vocab.embed(batch.input_ids))
        hidden = self.pre_fc_norm_hidden(previous_hidden.to(embedded.dtype))
        x = self.fc(torch.cat([embedded, hidden], dim=-1))
        x = self.layers[step % len(self.layers)](x, batch)
        self.last_hidden = self.norm(x)
        return self.last_hidden[batch.logits_indices]

    @torch.no_grad()
    def compute_logits(self, hidden: torch.Tensor, step: int = 0) -> torch.Tensor:
        # every draft depth goes through the main model's head
        return self._vocab.head(hidden)
