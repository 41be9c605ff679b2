"""Qwen Sparse Attention (QSA): Qwen3.5's gated full attention (``[q|gate]`` q_proj, per-head zero-centred
q/k RMSNorm, partial rotate-half RoPE, sigmoid output gate) where each query attends only to the tokens
its block indexer selects (``indexer.py``); short contexts select everything and stay dense.

K/V go to the pool entry ``cache_name``; the indexer's raw keys to its own entry. On the CPU (the reference
path) a query's output is the softmax over exactly its selected keys, in position order, with row-independent
products, so a position's result does not depend on batching. On CUDA all rows of a sequence go at once
through a masked score matrix (``attend_masked``): the same selection and the same math, other rounding (the
form ``DGPP_KERNELS=torch`` keeps). With Triton every row selects and attends on its own (``qsa_rows.py``), from
block keys stored once; a decode step so reads nothing on the host and a CUDA graph can replay it.
"""

from __future__ import annotations

import torch

from dgpp.nn.attention import context_token_rows, gated_output, gather_rows, scatter_rows
from dgpp.nn.batch_invariant import batch_invariant_linear
from dgpp.nn.gqa import norm_and_rotate
from dgpp.nn.rotary import RotaryEmbedding
from dgpp.plugin_api import CacheSpec, ForwardBatch, PagedKV, World
from dgpp_qwen.layers.attention import QwenAttention
from dgpp_qwen.layers.indexer import QSAIndexer
from dgpp_qwen.layers.qsa_rows import row_attention, takes_row_path
from dgpp_qwen.qwen4_exp_config import Qwen4ExpConfig


def attend_selected(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, q_offset: int, mask: torch.Tensor | None, scale: float
) -> torch.Tensor:
    """One sequence, row by row (CPU): query row ``i`` (position ``q_offset + i``) attends to the keys ``mask[i]``
    selects, or to all of ``0..q_offset+i`` when ``mask`` is None. ``q`` [n, Hq, D], ``k`` [L, Hkv, D],
    ``v`` [L, Hkv, Dv]; each row over exactly its keys in position order, with row-independent products."""
    n, num_q_heads, _ = q.shape
    num_kv_heads = k.shape[1]
    grouped = q.reshape(n, num_kv_heads, num_q_heads // num_kv_heads, -1)
    k, v = k.to(q.dtype), v.to(q.dtype)
    out = q.new_empty(n, num_kv_heads, num_q_heads // num_kv_heads, v.shape[-1])
    for i in range(n):
        picked = slice(0, q_offset + i + 1) if mask is None else mask[i].nonzero().squeeze(-1)
        keys, values = k[picked], v[picked]
        for h in range(num_kv_heads):
            scores = batch_invariant_linear(grouped[i, h], keys[:, h]) * scale
            probs = torch.softmax(scores, dim=-1, dtype=torch.float32).to(q.dtype)
            out[i, h] = batch_invariant_linear(probs, values[:, h].t())
    return out.reshape(n, num_q_heads, -1)


# the fp32 score matrix of one block of query rows is kept under this size: a 32K-token prompt's rows over its
# whole context at once would need tens of GB
SCORE_BLOCK_BYTES = 1 << 30


def attend_masked(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, q_offset: int, mask: torch.Tensor | None, scale: float
) -> torch.Tensor:
    """The same attention over a masked ``[n, L]`` score matrix (CUDA), in blocks of query rows whose fp32
    scores fit ``SCORE_BLOCK_BYTES``: every row's keys, selection and softmax are its own, so the blocks only
    bound the memory."""
    n, num_q_heads, _ = q.shape
    rows = max(1, SCORE_BLOCK_BYTES // (num_q_heads * k.shape[0] * 4))
    if n <= rows:
        return _attend_masked_rows(q, k, v, q_offset, mask, scale)
    out = q.new_empty(n, num_q_heads, v.shape[-1])
    for start in range(0, n, rows):
        stop = min(n, start + rows)
        block_mask = None if mask is None else mask[start:stop]
        out[start:stop] = _attend_masked_rows(q[start:stop], k, v, q_offset + start, block_mask, scale)
    return out


def _attend_masked_rows(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, q_offset: int, mask: torch.Tensor | None, scale: float
) -> torch.Tensor:
    """One block of query rows (positions ``q_offset ..``) over the whole masked score matrix."""
    n, num_q_heads, _ = q.shape
    length, num_kv_heads = k.shape[:2]
    if mask is None:
        mask = (
            torch.arange(length, device=q.device)[None, :]
            <= q_offset + torch.arange(n, device=q.device)[:, None]
        )
    grouped = q.view(n, num_kv_heads, num_q_heads // num_kv_heads, -1).permute(1, 2, 0, 3)  # [Hkv, g, n, D]
    scores = torch.matmul(grouped, k.to(q.dtype).permute(1, 2, 0).unsqueeze(1)) * scale  # [Hkv, g, n, L]
    probs = torch.softmax(scores.masked_fill(~mask, float("-inf")), dim=-1, dtype=torch.float32).to(q.dtype)
    out = torch.matmul(probs, v.to(q.dtype).permute(1, 0, 2).unsqueeze(1))  # [Hkv, g, n, Dv]
    return out.permute(2, 0, 1, 3).reshape(n, num_q_heads, -1)


class QSAttention(QwenAttention):
    """One QSA layer (checkpoint names: ``q_proj``, ``k_proj``, ``v_proj``, ``o_proj``, ``q_norm``, ``k_norm``,
    ``indexer.*``). Heads split over TP ranks as in ``QwenAttention``; the indexer is replicated."""

    def __init__(
        self,
        cfg: Qwen4ExpConfig,
        cache_name: str,
        index_cache_name: str,
        rotary: RotaryEmbedding,
        world: World | None = None,
    ) -> None:
        super().__init__(cfg.base, cache_name, rotary, output_gate=True, zero_centered_norm=True, world=world)
        base = cfg.base
        self.indexer = QSAIndexer(
            base.hidden_size, cfg.indexer, rotary, index_cache_name, base.rms_norm_eps, dtype=base.dtype
        )

    def cache_specs(self, dtype: torch.dtype) -> dict[str, CacheSpec]:
        return {
            self.attn.cache_name: PagedKV(
                num_kv_heads=self.num_kv_heads, head_dim=self.head_dim, dtype=dtype
            ),
            **self.indexer.cache_specs(),
        }

    def forward(self, x: torch.Tensor, batch: ForwardBatch) -> torch.Tensor:
        rows = x.shape[0]
        q, gate, k, v = self.split_heads(*self.project(x))
        if x.is_cuda and batch.rope_positions is None:  # text rows: norms and rotations in one launch
            q, k = norm_and_rotate(q, k, batch.positions, self.q_norm, self.k_norm, self.rotary)
        else:
            cos, sin = self.rotary.cos_sin(batch.rotary_positions, x.dtype)
            q, k = self.rotary.rotate(self.q_norm(q), cos, sin), self.rotary.rotate(self.k_norm(k), cos, sin)
        k_cache, v_cache = batch.cache.kv[self.attn.cache_name]
        scatter_rows(batch, k_cache, v_cache, k, v)
        index_q = self.indexer(x, batch)
        if takes_row_path(x):
            out = row_attention(self.indexer, q, index_q, (k_cache, v_cache), batch, self.attn.scale)
            return self.o_proj(gated_output(out.flatten(1), gate))
        selection = self.indexer.select(index_q, batch)

        all_rows = x.is_cuda if self.indexer.vectorized is None else self.indexer.vectorized
        attend = attend_masked if all_rows else attend_selected
        out = q.new_empty(rows, self.num_heads, self.head_dim)
        start = 0
        for i, q_len in enumerate(batch.q_lens_cpu):
            if q_len:
                length = batch.seq_lens_cpu[i]
                token_rows = context_token_rows(batch.block_tables[i], length, k_cache.shape[1])
                keys, values = gather_rows(k_cache, token_rows), gather_rows(v_cache, token_rows)
                out[start : start + q_len] = attend(
                    q[start : start + q_len],
                    keys,
                    values,
                    batch.context_lens_cpu[i],
                    selection[i],
                    self.attn.scale,
                )
            start += q_len
        return self.o_proj(gated_output(out.flatten(1), gate))
