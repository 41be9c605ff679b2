"""DeepSeek-V4 attention of one layer (the release's ``attn.*`` names): low-rank queries, one shared latent
K == V head, per-head sinks, a sliding window on every layer plus, on CSA / HCA layers, compressed entries.

``q = rms(wq_b(q_norm(wq_a(x))))`` per head (an unweighted RMSNorm), ``kv = norm(wkv(x))``; both rotate their
last ``rope_head_dim`` dims (interleaved; ``rope_theta`` on sliding layers, ``compress_rope_theta`` + YaRN on
compressed ones). The attention output's rope slice is rotated back at the query position, then the heads go
through the grouped low-rank output: ``wo_a`` block-diagonal over ``o_groups`` groups of heads, then ``wo_b``.
"""

from __future__ import annotations

import torch
from torch import nn

from dgpp.nn.compressed_attention import CompressedSinkAttention, LightningIndexer
from dgpp.nn.linear import Linear, row_block_linear
from dgpp.nn.rotary import RopeScaling, rotary_embedding
from dgpp.nn.sources import Alternatives, Source
from dgpp.nn.weights import default_weight_loader, set_weight_attrs
from dgpp.nn.window_compressor import FP32WeightRMSNorm, WindowCompressor
from dgpp.plugin_api import CacheSpec, ForwardBatch
from dgpp_deepseek.config import CSA, DeepseekV4ArchConfig, LatentMoEFields


class LatentProjections(nn.Module):
    """What V4's and V4.1's attention share, under the release's names: the low-rank query pair with its norm
    (``wq_a``, ``q_norm``, ``wq_b``), the latent K/V projection and norm (``wkv``, ``kv_norm``), the grouped
    low-rank output (``wo_a``, ``wo_b``) and the fp32 per-head sinks (``attn_sink``)."""

    def __init__(self, cfg: LatentMoEFields, *, dtype: torch.dtype) -> None:
        super().__init__()
        heads, dim, eps = cfg.num_attention_heads, cfg.head_dim, cfg.rms_norm_eps
        self.wq_a = Linear(cfg.hidden_size, cfg.q_lora_rank, dtype=dtype)
        self.q_norm = FP32WeightRMSNorm(cfg.q_lora_rank, eps)
        self.wq_b = Linear(cfg.q_lora_rank, heads * dim, dtype=dtype)
        self.wkv = Linear(cfg.hidden_size, dim, dtype=dtype)
        self.kv_norm = FP32WeightRMSNorm(dim, eps)
        self.wo_a = Linear(heads * dim // cfg.o_groups, cfg.o_groups * cfg.o_lora_rank, dtype=dtype)
        self.wo_b = Linear(cfg.o_groups * cfg.o_lora_rank, cfg.hidden_size, dtype=dtype)
        self.attn_sink = nn.Parameter(torch.empty(heads, dtype=torch.float32), requires_grad=False)
        set_weight_attrs(self.attn_sink, weight_loader=default_weight_loader)


class DeepseekV4Attention(LatentProjections):
    """One layer's attention, replicated on every rank (one K/V head: nothing to split by heads)."""

    def __init__(self, cfg: DeepseekV4ArchConfig, layer_idx: int, *, dtype: torch.dtype) -> None:
        super().__init__(cfg, dtype=dtype)
        heads, dim, eps = cfg.num_attention_heads, cfg.head_dim, cfg.rms_norm_eps
        self.num_heads, self.head_dim, self.groups, self.eps = heads, dim, cfg.o_groups, eps
        self.o_lora_rank = cfg.o_lora_rank
        ratio = cfg.ratio(layer_idx)
        name = f"layers.{layer_idx}.attn"  # the layer's cache entries are named from it (cache_entries)
        if ratio:
            rope = RopeScaling(
                theta=cfg.compress_rope_theta,
                rope_type="yarn" if cfg.compress_yarn else "default",
                yarn=cfg.compress_yarn,
            )
            self.rotary = rotary_embedding(rope, dim, cfg.rope_head_dim, style="interleaved", trailing=True)
            self.compressor: WindowCompressor | None = WindowCompressor(
                cfg.hidden_size,
                dim,
                ratio,
                self.rotary,
                f"{name}.compressor",
                overlap=cfg.layer_types[layer_idx] == CSA,
                dtype=dtype,
                eps=eps,
            )
        else:
            self.rotary = rotary_embedding(
                RopeScaling(theta=cfg.rope_theta), dim, cfg.rope_head_dim, style="interleaved", trailing=True
            )
            self.compressor = None
        self.indexer: LightningIndexer | None = None
        if cfg.layer_types[layer_idx] == CSA:
            self.indexer = LightningIndexer(
                cfg.hidden_size,
                cfg.q_lora_rank,
                cfg.index_n_heads,
                cfg.index_head_dim,
                cfg.index_topk,
                ratio,
                self.rotary,
                f"{name}.indexer",
                dtype=dtype,
                eps=eps,
            )
        self.core = CompressedSinkAttention(
            name, heads, dim, cfg.sliding_window, compressor=self.compressor, indexer=self.indexer
        )

    def cache_entries(self, dtype: torch.dtype) -> dict[str, CacheSpec]:
        """The layer's window ring and, on compressed layers, its compressor's and indexer's entries (the
        model's ``cache_spec`` collects them)."""
        return self.core.cache_spec(dtype)

    def checkpoint_sources(self) -> dict[str, Alternatives]:
        """The latent's norm is ``attn.kv_norm`` in DeepSeek's naming; transformers saves it back as ``attn.norm``
        (its mapping reads both): read either."""
        return {"kv_norm.weight": [[Source("kv_norm.weight")], [Source("norm.weight")]]}

    def grouped_output(self, out: torch.Tensor) -> torch.Tensor:
        return grouped_output(self.wo_a, self.wo_b, out, self.groups, self.o_lora_rank)

    def forward(self, x: torch.Tensor, batch: ForwardBatch) -> torch.Tensor:
        rows = x.shape[0]
        q_resid = self.q_norm(self.wq_a(x))
        q = self.wq_b(q_resid).view(rows, self.num_heads, self.head_dim)
        q = self.rotary.rotate(q, batch.positions, head_rms_eps=self.eps)  # per head, unweighted, then RoPE
        kv = self.rotary.rotate(self.kv_norm(self.wkv(x))[:, None, :], batch.positions)[:, 0]
        out = self.core(q, kv, x, q_resid, batch, self.attn_sink)
        out = self.rotary.rotate(out, batch.positions, inverse=True)
        return self.grouped_output(out)


def grouped_output(
    wo_a: Linear, wo_b: Linear, out: torch.Tensor, groups: int, o_lora_rank: int
) -> torch.Tensor:
    """``wo_b(concat_g wo_a[g](heads of group g))``: ``wo_a``'s rows are ``groups`` blocks of ``o_lora_rank``,
    block ``g`` reading only group ``g``'s heads."""
    rows = out.shape[0]
    per_group = out.reshape(rows, groups, -1)
    r = o_lora_rank  # by rows of wo_a, whatever its format (the releases ship it FP8 in blocks)
    mixed = torch.cat(
        [row_block_linear(wo_a, per_group[:, g], g * r, (g + 1) * r) for g in range(groups)], dim=-1
    )
    return wo_b(mixed)
