"""The QSA block indexer: which earlier tokens each query of a Qwen Sparse Attention layer may attend to.

Every token writes one raw index key (``index_qk_proj``'s last head, before any norm or RoPE) into the
engine's pool (a ``PagedKV`` entry with no V). For a query at position ``p`` the visible tokens
``0..p`` are cut into complete blocks of ``compress_ratio`` tokens and a tail of at most
``compress_ratio - 1``. A block's key is the fp32 mean of its raw keys (rounded to the activation dtype),
zero-centred RMSNorm'd and rotated at the block's first token's rotary position. The query's ``n_heads`` index heads
(normed, rotated at ``p``) score each block as ``Σ_h relu(q_h · c) / √head_dim``; the best
``budget / compress_ratio`` blocks (ties to the lower block index) plus the tail are selected. While
``p + 1 < (block_topk + 1) · compress_ratio`` every block is kept, i.e. the attention is dense.

Each complete block's key is also kept, computed once, in a ``CompressedKV`` entry (``blocks_cache_name``): the
row at a block's last position writes it (``store_block_keys``), with the same ops as ``_block_keys``, so the
per-row device path (``qsa_rows.py``) reads keys bit-identical to the ones the other paths recompute.
"""

from __future__ import annotations

import math
from typing import NamedTuple

import torch
from torch import nn

from dgpp.kernels.masked_rows import store_rows
from dgpp.kernels.window_attention import row_sequences
from dgpp.nn.attention import gather_context, scatter_rows
from dgpp.nn.batch_invariant import batch_invariant_linear
from dgpp.nn.linear import Linear
from dgpp.nn.norm import RMSNorm
from dgpp.nn.rotary import RotaryEmbedding
from dgpp.plugin_api import CompressedKV, ForwardBatch, PagedKV
from dgpp_qwen.qwen4_exp_config import IndexerConfig


class BlockWrites(NamedTuple):
    """A step's block-key writes: each row's block's raw-key rows ``[T·ratio]`` (a padding row reads block 0), the
    block-key row it would write ``[T]``, whether it completes its block ``[T]`` (only those write), and the
    rotation ``(cos, sin)`` of the block's first token."""

    token_rows: torch.Tensor
    entry: torch.Tensor
    done: torch.Tensor
    angles: tuple[torch.Tensor, torch.Tensor]


Selection = list[
    torch.Tensor | None
]  # per sequence: a [q_len, seq_len] key mask, or None when all rows are dense


class QSAIndexer(nn.Module):
    """Parameter names follow the checkpoint (``index_qk_proj``, ``q_layernorm``, ``k_layernorm``).
    Replicated under TP: every rank selects the same tokens for its own attention heads."""

    def __init__(
        self,
        hidden_size: int,
        cfg: IndexerConfig,
        rotary: RotaryEmbedding,
        cache_name: str,
        eps: float,
        *,
        dtype: torch.dtype,
    ) -> None:
        super().__init__()
        if rotary.rotary_dim > cfg.head_dim:
            raise ValueError(f"indexer head dim {cfg.head_dim} is below the rotary dim {rotary.rotary_dim}")
        self.cfg = cfg
        self.cache_name = cache_name
        self.blocks_cache_name = f"{cache_name}.blocks"
        self.rotary = rotary
        self.dtype = dtype
        self.index_qk_proj = Linear(hidden_size, (cfg.n_heads + 1) * cfg.head_dim, dtype=dtype)
        self.q_layernorm = RMSNorm(cfg.head_dim, eps, zero_centered=True, dtype=dtype)
        self.k_layernorm = RMSNorm(cfg.head_dim, eps, zero_centered=True, dtype=dtype)
        self.vectorized: bool | None = None  # None: all rows at once on CUDA, row by row on the CPU

    def cache_specs(self) -> dict[str, PagedKV]:
        """The raw index keys (one per token) and the block keys (one per ``compress_ratio`` tokens)."""
        cfg = self.cfg
        return {
            self.cache_name: PagedKV(num_kv_heads=1, head_dim=cfg.head_dim, dtype=self.dtype, v_head_dim=0),
            self.blocks_cache_name: CompressedKV.of(cfg.compress_ratio, cfg.head_dim, self.dtype),
        }

    def dense_limit(self) -> int:
        """The longest visible span (tokens) that is still attended densely."""
        return (self.cfg.block_topk + 1) * self.cfg.compress_ratio - 1

    def _block_keys(self, raw_keys: torch.Tensor, rotary_positions: torch.Tensor) -> torch.Tensor:
        """Compressed keys ``[blocks, head_dim]`` of every complete block of ``raw_keys`` ``[L, head_dim]``, each
        rotated at its first token's rotary position (``rotary_positions``: the tokens', ``[L]`` or ``[axes, L]``)."""
        ratio = self.cfg.compress_ratio
        blocks = raw_keys.shape[0] // ratio
        starts = torch.arange(blocks, device=raw_keys.device) * ratio
        grouped = raw_keys[: blocks * ratio].view(blocks, ratio, -1)
        return self._pool_rotated(grouped, *self.rotary.cos_sin(rotary_positions[..., starts], grouped.dtype))

    def _pool_rotated(self, grouped: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        """Block keys ``[n, head_dim]`` of ``grouped`` ``[n, ratio, head_dim]`` raw keys, each rotated by its
        ``(cos, sin)``: row by row, whatever else shares the call."""
        pooled = grouped.float().mean(dim=1).to(grouped.dtype)
        return self.rotary.rotate(self.k_layernorm(pooled).unsqueeze(1), cos, sin).squeeze(1)

    def store_block_keys(self, k_cache: torch.Tensor, batch: ForwardBatch) -> None:
        """Write the key of every block a row of this step completes (a row at position ``p`` with
        ``(p + 1) % compress_ratio == 0``) into the block-key entry, from the raw keys already in ``k_cache``.
        Fixed shapes and a masked store: a decode step reads no host value here (text rows)."""
        pool = batch.cache.kv[self.blocks_cache_name][0]
        key = ("qsa_block_writes", self.cfg.compress_ratio, pool.shape[1], id(self.rotary), k_cache.dtype)
        writes = batch.step_memo(key, lambda: self._block_writes(batch, pool.shape[1], k_cache.dtype))
        grouped = k_cache.flatten(0, 1).index_select(0, writes.token_rows)
        keys = self._pool_rotated(
            grouped.view(writes.done.shape[0], self.cfg.compress_ratio, -1), *writes.angles
        )
        store_rows(pool.view(-1, pool.shape[-1]), writes.entry, keys, writes.done)

    def _block_writes(self, batch: ForwardBatch, per_block: int, dtype: torch.dtype) -> BlockWrites:
        """Where each row's block is read and written, and the rotation of its first token: the same for every
        QSA layer of a step, so computed once a step."""
        ratio, block_size = self.cfg.compress_ratio, batch.cache.block_size
        positions, rows = batch.positions, batch.positions.shape[0]
        tables = batch.block_tables
        seq = None if batch.is_decode_only else row_sequences(batch.query_start_loc, rows).long()
        start = (positions + 1 - ratio).clamp(min=0)
        tokens = start[:, None] + torch.arange(ratio, device=positions.device)  # [T, ratio]
        columns = (tokens // block_size).clamp(max=tables.shape[1] - 1)
        blocks = (tables.gather(1, columns) if seq is None else tables[seq[:, None], columns]).long()
        token_rows = blocks.clamp(min=0) * block_size + tokens % block_size  # padding rows read block 0
        entry = blocks[:, -1] * per_block + (positions % block_size) // ratio  # in the last token's block
        done = ((positions + 1) % ratio == 0) & (batch.slot_mapping >= 0) & (blocks[:, -1] >= 0)
        angles = self.rotary.cos_sin(self._start_rotary_positions(batch, start), dtype)
        return BlockWrites(token_rows.flatten(), entry.clamp(min=0), done, angles)

    def _start_rotary_positions(self, batch: ForwardBatch, start: torch.Tensor) -> torch.Tensor:
        """The rotary positions of tokens ``start`` (one per row): themselves for text, the prompt's multimodal
        positions when the step has images (read from host-side lengths: such steps run eager)."""
        if batch.rope_positions is None:
            return start
        axes = batch.rope_positions.shape[0]
        parts = []
        for i, q_len in enumerate(batch.q_lens_cpu):
            context, length = batch.context_lens_cpu[i], batch.seq_lens_cpu[i]
            starts = [max(0, context + j + 1 - self.cfg.compress_ratio) for j in range(q_len)]
            index = torch.tensor(starts, dtype=torch.int64, device=start.device)
            positions = batch.sequence_rotary_positions(i, max(length, 1))[..., index]
            parts.append(positions if positions.dim() == 2 else positions.expand(axes, -1))
        return torch.cat(parts, dim=-1)

    def _select(self, query: torch.Tensor, block_keys: torch.Tensor, position: int) -> torch.Tensor:
        """Sorted key positions for one query ``[n_heads, head_dim]`` at ``position`` (sparse case)."""
        ratio, topk = self.cfg.compress_ratio, self.cfg.block_topk
        blocks = (position + 1) // ratio
        per_head = batch_invariant_linear(query.float(), block_keys[:blocks].float())  # [heads, blocks]
        scores = torch.relu(per_head.t()).sum(dim=-1) / math.sqrt(self.cfg.head_dim)
        # a stable descending sort keeps equal scores in index order: ties go to the lower block
        best = torch.sort(scores, descending=True, stable=True).indices[:topk]
        tokens = (best[:, None] * ratio + torch.arange(ratio, device=best.device)).flatten()
        tail = torch.arange(blocks * ratio, position + 1, device=best.device)
        return torch.sort(torch.cat([tokens, tail])).values

    def _select_all(
        self, q: torch.Tensor, block_keys: torch.Tensor, positions: torch.Tensor, length: int
    ) -> torch.Tensor:
        """The selection mask ``[n, length]`` of query rows ``q`` ``[n, n_heads, head_dim]`` at ``positions``, all
        at once (one product, one sort): the CUDA path. Same rule as ``_select``; its products are not
        row-independent on the CPU, so the CPU keeps the per-row form."""
        ratio, topk = self.cfg.compress_ratio, self.cfg.block_topk
        num_blocks = block_keys.shape[0]
        per_head = torch.einsum("nhd,bd->nbh", q.float(), block_keys.float())
        scores = torch.relu(per_head).sum(dim=-1) / math.sqrt(self.cfg.head_dim)
        complete = (positions + 1) // ratio  # complete blocks each row sees
        visible = torch.arange(num_blocks, device=q.device)[None, :] < complete[:, None]
        order = torch.sort(
            scores.masked_fill(~visible, float("-inf")), dim=1, descending=True, stable=True
        ).indices
        picked = torch.zeros_like(visible).scatter_(1, order[:, : min(topk, num_blocks)], True) & visible
        tokens = torch.arange(length, device=q.device)
        block_of = (tokens // ratio).clamp(max=max(num_blocks - 1, 0))
        in_picked = (tokens < num_blocks * ratio)[None, :] & picked.gather(1, block_of.expand(q.shape[0], -1))
        tail = (tokens[None, :] >= complete[:, None] * ratio) & (tokens[None, :] <= positions[:, None])
        return in_picked | tail

    def _select_rows(
        self, q: torch.Tensor, block_keys: torch.Tensor, context: int, length: int
    ) -> torch.Tensor:
        """The selection mask ``[n, length]`` row by row (CPU: row-independent products)."""
        mask = torch.zeros(q.shape[0], length, dtype=torch.bool, device=q.device)
        for j in range(q.shape[0]):
            position = context + j
            if position + 1 > self.dense_limit():
                mask[j, self._select(q[j], block_keys, position)] = True
            else:
                mask[j, : position + 1] = True
        return mask

    def forward(self, x: torch.Tensor, batch: ForwardBatch) -> torch.Tensor:
        """Store this step's raw index keys and the keys of the blocks it completes; the rows' index queries
        ``[T, n_heads, head_dim]`` (normed and rotated), which ``select`` or the decode path score with."""
        rows, cfg = x.shape[0], self.cfg
        q, raw_k = self.index_qk_proj(x).split([cfg.n_heads * cfg.head_dim, cfg.head_dim], dim=-1)
        cos, sin = self.rotary.cos_sin(batch.rotary_positions, x.dtype)
        q = self.rotary.rotate(self.q_layernorm(q.reshape(rows, cfg.n_heads, cfg.head_dim)), cos, sin)
        k_cache, empty_v = batch.cache.kv[self.cache_name]  # the entry's V part is empty
        raw_k = raw_k.unsqueeze(1)
        scatter_rows(batch, k_cache, empty_v, raw_k, raw_k[..., :0])  # slot -1: a padding row writes nothing
        self.store_block_keys(k_cache, batch)
        return q

    def select(self, q: torch.Tensor, batch: ForwardBatch) -> Selection:
        """Per sequence: the selection mask of its rows ``[q_len, seq_len]``, or None when all of them are dense
        (block keys recomputed from the raw keys, row lengths read on the host)."""
        vectorized = q.is_cuda if self.vectorized is None else self.vectorized
        k_cache = batch.cache.kv[self.cache_name][0]
        selection: Selection = []
        start = 0
        for i, q_len in enumerate(batch.q_lens_cpu):
            context, length = batch.context_lens_cpu[i], batch.seq_lens_cpu[i]
            mask = None
            if q_len and length > self.dense_limit():
                block_keys = self._block_keys(
                    gather_context(k_cache, batch.block_tables[i], length)[:, 0],
                    batch.sequence_rotary_positions(i, length),
                )
                rows_q = q[start : start + q_len]
                if vectorized:
                    mask = self._select_all(
                        rows_q, block_keys, batch.positions[start : start + q_len], length
                    )
                else:
                    mask = self._select_rows(rows_q, block_keys, context, length)
            selection.append(mask)
            start += q_len
        return selection
