"""Attention over a sliding window plus compressed entries, with one shared K == V head and per-head sinks
(DeepSeek-V4's sliding, CSA and HCA layers), and the lightning indexer that picks CSA's entries.

A row at position ``p`` attends, in ONE softmax with its head's sink logit, to the window's latent rows
``p - W + 1 .. p`` (a ``WindowKV`` ring holding K only: K is V) and to compressed entries
(``dgpp.nn.window_compressor``) of complete windows only (entry ``w`` once ``(w + 1)·r <= p + 1``): all of them
(HCA), or the ``topk`` the indexer scores best (CSA, exact ties to the lower entry).

Prefill and mixed steps run batched over the step's rows (``dgpp.nn.compressed_prefill``: ``LightningIndexer.select``
and one ``dgpp.kernels.compressed_attention`` call); decode-only steps on CUDA run ``dgpp.nn.compressed_decode``.
The per-row reference (``LightningIndexer.forward``, ``sparse_window_attention_ref``; ``per_row_prefill`` and the
CPU's decode-only steps) computes rows one at a time over exactly the keys they see (fp32, like
``dgpp.kernels.window_attention``'s reference). Every path gives a row the same bits however the prompt was
chunked, batched or restored.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch import nn

from dgpp.kernels._triton import use_triton
from dgpp.kernels.compressed_attention import compressed_attention
from dgpp.kernels.ring_write import RingWriteInputs, ring_write
from dgpp.kernels.window_attention import window_attention
from dgpp.nn.compressed_prefill import Picks, attention_inputs, every_entry, select_entries
from dgpp.nn.dsa import index_scores, top_k_lowest_on_ties
from dgpp.nn.linear import Linear
from dgpp.nn.rotary import TrailingRotary
from dgpp.nn.sliding_attention import step_row_sequences
from dgpp.nn.window_compressor import WindowCompressor, gather_entries, live_sequences
from dgpp.step.batch import ForwardBatch
from dgpp.step.cache_spec import CacheSpec, WindowKV

Selection = list[torch.Tensor | None]  # per row: the entries it attends (None: every complete one)


class LightningIndexer(nn.Module):
    """``Σ_h w_h · relu(q_h · k_s) · D^-½`` over the compressed indexer keys ``k_s`` (their own compressor, the
    same windows as the layer's), ``w = weights_proj(x) · H^-½`` (fp32), ``q = wq_b(q_resid)`` with RoPE at the
    row's position; each row keeps its ``topk`` best complete entries (all of them when it has no more)."""

    def __init__(
        self,
        hidden_size: int,
        q_lora_rank: int,
        num_heads: int,
        head_dim: int,
        topk: int,
        ratio: int,
        rotary: TrailingRotary,
        cache_name: str,
        *,
        dtype: torch.dtype,
        eps: float,
    ) -> None:
        super().__init__()
        self.num_heads, self.head_dim, self.topk, self.ratio = num_heads, head_dim, topk, ratio
        self.wq_b = Linear(q_lora_rank, num_heads * head_dim, dtype=dtype)
        self.weights_proj = Linear(hidden_size, num_heads, dtype=dtype)
        self.compressor = WindowCompressor(
            hidden_size, head_dim, ratio, rotary, cache_name, overlap=True, dtype=dtype, eps=eps
        )
        self.rotary = rotary

    def cache_spec(self) -> dict[str, CacheSpec]:
        return self.compressor.cache_spec()

    def queries(
        self, x: torch.Tensor, q_resid: torch.Tensor, batch: ForwardBatch
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """(rotated queries ``[T, H, D]``, fp32 head weights ``[T, H]``) of the step's rows."""
        rows = x.shape[0]
        q = self.rotary.rotate(self.wq_b(q_resid).view(rows, self.num_heads, self.head_dim), batch.positions)
        return q, self.weights_proj(x).float() * self.num_heads**-0.5

    def select(self, x: torch.Tensor, q_resid: torch.Tensor, batch: ForwardBatch) -> Picks:
        """Store the step's index entries, then every row's picks at once (``dgpp.nn.compressed_prefill``)."""
        self.compressor(x, batch)
        if max([0, *batch.seq_lens_cpu]) // self.ratio <= self.topk:
            return every_entry(batch, self.ratio)  # no row sees more entries than it keeps
        q, weights = self.queries(x, q_resid, batch)
        pool = batch.cache.kv[self.compressor.cache_name][0]
        return select_entries(q, weights, pool, batch, self.ratio, self.topk)

    def forward(self, x: torch.Tensor, q_resid: torch.Tensor, batch: ForwardBatch) -> Selection:
        """The per-row reference of ``select``."""
        self.compressor(x, batch)
        rows = x.shape[0]
        q, weights = self.queries(x, q_resid, batch)
        pool = batch.cache.kv[self.compressor.cache_name][0]
        selection: Selection = [None] * rows
        for b, start, q_len, ctx, end, _ in live_sequences(batch):
            if end // self.ratio <= self.topk:
                continue  # every row sees at most topk entries: it takes them all
            count = end // self.ratio
            keys = gather_entries(
                pool, batch.block_tables[b], count, self.ratio, batch.cache.block_size
            ).float()
            for i in range(q_len):
                visible = (ctx + i + 1) // self.ratio
                if visible > self.topk:
                    row = start + i
                    scores = index_scores(q[row].float(), keys[:visible], weights[row])
                    selection[row] = top_k_lowest_on_ties(scores, self.topk)
        return selection


def _window_rows(
    ring: torch.Tensor, slot: int, kv: torch.Tensor, start: int, ctx: int, lo: int, pos: int
) -> torch.Tensor:
    """Latent rows of positions ``lo .. pos`` of one sequence: from the ring before ``ctx``, else this step."""
    cap = ring.shape[1]
    old = torch.arange(lo, max(lo, min(ctx, pos + 1)), device=kv.device) % cap
    new = kv[start + max(lo, ctx) - ctx : start + pos + 1 - ctx]
    return torch.cat([ring[slot, old, 0].to(kv.dtype), new])


def sparse_window_attention_ref(
    q: torch.Tensor,
    kv: torch.Tensor,
    ring: torch.Tensor,
    entries_pool: torch.Tensor,
    batch: ForwardBatch,
    sinks: torch.Tensor,
    scale: float,
    window: int,
    ratio: int,
    selection: Selection,
    floors: dict[int, int] | None = None,
    read_entries: Callable[[torch.Tensor], torch.Tensor] | None = None,
) -> torch.Tensor:
    """``q [T, H, D]``, this step's latent rows ``kv [T, D]`` -> ``[T, H, D]`` (fp32 math, one row at a time).
    ``floors``: per sequence index, the earliest position its window may read (default 0). ``read_entries``: the
    values of the pool rows gathered (a pool that holds entries packed decodes them); default the rows as stored."""
    out = torch.zeros_like(q)
    for b, start, q_len, ctx, end, slot in live_sequences(batch):
        entries = gather_entries(
            entries_pool, batch.block_tables[b], end // ratio, ratio, batch.cache.block_size
        )
        if read_entries is not None:
            entries = read_entries(entries)
        for i in range(q_len):
            pos, row = ctx + i, start + i
            lo = max(floors.get(b, 0) if floors else 0, pos - window + 1)
            keys = _window_rows(ring, slot, kv, start, ctx, lo, pos)
            chosen = selection[row]
            visible = entries[: (pos + 1) // ratio] if chosen is None else entries[chosen]
            keys = torch.cat([keys, visible.to(keys.dtype)]).float()
            scores = torch.cat([q[row].float() @ keys.t() * scale, sinks.float()[:, None]], dim=1)
            probs = scores.softmax(dim=-1)[:, :-1]
            out[row] = (probs @ keys).to(q.dtype)
    return out


class CompressedSinkAttention(nn.Module):
    """The attention core of one DeepSeek-V4 layer: ``q [T, H, D]`` and the shared latent rows ``kv [T, D]``
    (normed, rotated) -> ``[T, H, D]``. ``compressor`` None: a sliding layer (core's window kernel, K as V)."""

    def __init__(
        self,
        cache_name: str,
        num_heads: int,
        head_dim: int,
        window: int,
        *,
        compressor: WindowCompressor | None = None,
        indexer: LightningIndexer | None = None,
    ) -> None:
        super().__init__()
        self.cache_name, self.num_heads, self.head_dim, self.window = cache_name, num_heads, head_dim, window
        self.scale = head_dim**-0.5
        self.compressor = compressor
        self.indexer = indexer
        # decode steps of compressed layers: batched (``dgpp.nn.compressed_decode``) or the per-row reference;
        # None: batched on CUDA
        self.batched_decode: bool | None = None
        # batched decode through the fused Triton kernels or their torch forms; None: Triton where it runs
        self.fused_decode: bool | None = None
        # other steps: batched over the chunk's rows (``dgpp.nn.compressed_prefill``), or the per-row reference
        self.per_row_prefill = False

    def cache_spec(self, dtype: torch.dtype) -> dict[str, CacheSpec]:
        # K == V: the ring holds K only (a zero-width V)
        spec: dict[str, CacheSpec] = {
            self.cache_name: WindowKV(
                num_kv_heads=1, head_dim=self.head_dim, dtype=dtype, window=self.window, v_head_dim=0
            )
        }
        for part in (self.compressor, self.indexer):
            if part is not None:
                spec.update(part.cache_spec())
        return spec

    def forward(
        self,
        q: torch.Tensor,
        kv: torch.Tensor,
        x: torch.Tensor,
        q_resid: torch.Tensor,
        batch: ForwardBatch,
        sinks: torch.Tensor,
    ) -> torch.Tensor:
        ring = batch.cache.state[self.cache_name]["k"]
        latent = kv[:, None, :]  # one K/V head, read as both K and V
        lens = (batch.query_start_loc, batch.context_lens, batch.seq_lens)
        row_seq = step_row_sequences(batch, q.shape[0])  # once a step for every layer's window and ring write
        if self.compressor is None:
            out = window_attention(
                q,
                latent,
                latent,
                ring,
                ring,
                batch.state_slots,
                *lens,
                sinks,
                self.scale,
                self.window,
                False,
                row_seq=row_seq,
            )
        elif (q.is_cuda if self.batched_decode is None else self.batched_decode) and batch.is_decode_only:
            # batched over rows, no host sync: CUDA-graph safe
            from dgpp.nn.compressed_decode import compressed_attention_decode

            fused = use_triton(q) if self.fused_decode is None else self.fused_decode
            out = compressed_attention_decode(self, q, kv, x, q_resid, batch, sinks, fused)
        elif not (self.per_row_prefill or batch.is_decode_only):
            self.compressor(x, batch)  # this step's complete windows first: its later rows may attend them
            picks = self.indexer.select(x, q_resid, batch) if self.indexer is not None else None
            pool = batch.cache.kv[self.compressor.cache_name][0]
            out = compressed_attention(
                attention_inputs(
                    q, kv, ring, pool, batch, sinks, self.scale, self.window, self.compressor.ratio, picks
                )
            )
        else:
            self.compressor(x, batch)  # this step's complete windows first: its later rows may attend them
            rows = q.shape[0]
            selection = self.indexer(x, q_resid, batch) if self.indexer is not None else [None] * rows
            pool = batch.cache.kv[self.compressor.cache_name][0]
            out = sparse_window_attention_ref(
                q, kv, ring, pool, batch, sinks, self.scale, self.window, self.compressor.ratio, selection
            )
        ring_write(RingWriteInputs(latent, latent, ring, ring, batch.state_slots, *lens, row_seq))
        return out
