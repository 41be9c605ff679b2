"""CSA2's compressor and indexer (DeepSeek-V4.1-Flash), the parts of a layer group that the other layers share.

A kv source's ``CompressorV41`` turns its layer's input rows into the group's compressed entries: at ratio 1
``norm(wkv(x))`` per token, at ratio 2 each pair of tokens pooled per channel with the softmax of the pair's
``wgate(x)`` before the norm; at ratio 2 both projections and the open pair's row stay fp32 and the pooled
latent is rounded once, to the activation dtype, before the norm (the original engine's order). Entry ``j`` covers positions ``j r .. j r + r - 1`` and is rotated at
``j r``; the pool keeps it in its trained FP4 form, packed (``dgpp_deepseek.v41_packed_entries``: E2M1 nibbles
and an E4M3 scale per 16). From the same pre-rotation latent the source's ``indexer.wk`` and ``k_norm`` make the
entry's index key, rotated and kept as FP4 with E8M0 scales per 32, packed likewise. Both go to paged pools
(``CompressedKV`` of bytes: entry ``j`` in the block of its last token); the odd row of an open pair waits in a
per-request ``WindowBuffer``.

Every index source (``IndexerV41``) scores the entries a row at position ``p`` sees (``j < (p + 1) / r``):
``sum_h w_h relu(q_h . k_j)``, ``q = rope(wq_b(q_resid))`` rounded to FP4 like the keys,
``w = weights_proj(x) / sqrt(head_dim * heads)``, and keeps the ``index_topk`` best (exact ties to the lower
entry). The candidate source also keeps, per row, the ``candidate_topk_blocks`` best blocks of
``candidate_block_size`` entries (a block scores its best entry; the block of the row's newest entry is always
kept); index sources after it select inside those blocks only.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

import torch
from torch import nn

from dgpp.kernels.block_scaled_tiles import PackedKeyForms
from dgpp.kernels.dsa_index import index_scores_triton
from dgpp.nn.batch_invariant import batch_invariant_rows
from dgpp.nn.compressed_decode import entry_table
from dgpp.nn.linear import Linear
from dgpp.nn.rotary import TrailingRotary
from dgpp.nn.window_compressor import FP32WeightRMSNorm, entry_slots, gather_entries, live_sequences
from dgpp.plugin_api import CacheSpec, CompressedKV, ForwardBatch, WindowBuffer
from dgpp_deepseek.v41_decode_rows import (
    DecodePicks,
    ascending_picks,
    compress_decode_rows,
    decode_scores,
    kernel_picks,
    mask_unseen,
    visible_entries,
)
from dgpp_deepseek.v41_latent_formats import round_fp4_e8m0
from dgpp_deepseek.v41_packed_entries import EntryFormats

Selection = list[torch.Tensor | None]  # per row: the entries it attends (None: every visible one)


@dataclass
class GroupFlow:
    """What passes between the layers of one forward: the last index source's selection (per row, or a decode
    step's ``DecodePicks``), and the candidate source's kept entries per sequence (bool ``[q_len, entries]``; a
    decode step's per row in ``candidate_rows``, bool ``[R, entries]``)."""

    selection: Selection | DecodePicks = field(default_factory=list)
    candidates: dict[int, torch.Tensor] = field(default_factory=dict)
    candidate_rows: torch.Tensor | None = None
    window_floor: dict[int, int] = field(default_factory=dict)  # the bounded decoder's, per sequence index


class CompressorV41(nn.Module):
    """``compressor.{wkv, wgate, norm}`` and ``indexer.{wk, k_norm}`` of a kv source (release names)."""

    def __init__(
        self,
        hidden_size: int,
        head_dim: int,
        index_head_dim: int,
        ratio: int,
        rotary: TrailingRotary,
        cache_name: str,
        formats: EntryFormats,
        *,
        dtype: torch.dtype,
        eps: float,
    ) -> None:
        super().__init__()
        self.head_dim, self.ratio, self.dtype, self.rotary = head_dim, ratio, dtype, rotary
        self.formats = formats
        self.cache_name, self.index_name = f"{cache_name}.compressor", f"{cache_name}.indexer"
        # a pooling compressor projects in fp32 (its BF16 checkpoint weights widened once at load, exactly)
        proj_dtype = torch.float32 if ratio > 1 else dtype
        self.wkv = Linear(hidden_size, head_dim, dtype=proj_dtype)
        self.wgate = Linear(hidden_size, head_dim, dtype=proj_dtype) if ratio > 1 else None
        self.norm = FP32WeightRMSNorm(head_dim, eps)
        self.wk = Linear(head_dim, index_head_dim, dtype=dtype)
        self.k_norm = FP32WeightRMSNorm(index_head_dim, eps)
        self.index_head_dim = index_head_dim
        # decode steps take the batched device form (False: the per-sequence form, the reference it matches)
        self.batched_decode = True

    @property
    def buffer_name(self) -> str:
        return f"{self.cache_name}.buffer"

    def cache_spec(self) -> dict[str, CacheSpec]:
        spec: dict[str, CacheSpec] = {
            self.cache_name: CompressedKV.of(self.ratio, self.formats.main.width, self.formats.main.dtype),
            self.index_name: CompressedKV.of(self.ratio, self.formats.index.width, self.formats.index.dtype),
        }
        if self.ratio > 1:
            spec[self.buffer_name] = WindowBuffer(rows=self.ratio, width=self.head_dim, dtype=torch.float32)
        return spec

    def pool_groups(self, kv: torch.Tensor, gate: torch.Tensor | None) -> torch.Tensor:
        """``[n, r, D]`` rows (and gates) of complete groups -> the normed latents ``[n, D]``."""
        if gate is None:
            return self.norm(kv[:, 0])
        n, r, d = gate.shape  # the softmax over each group's r rows, per channel, row-count independent
        weights = (
            batch_invariant_rows(lambda g: g.softmax(dim=-1), gate.float().transpose(1, 2).reshape(n * d, r))
            .reshape(n, d, r)
            .transpose(1, 2)
        )
        return self.norm((kv.float() * weights).sum(dim=1).to(self.dtype))

    def entry_rows(self, latent: torch.Tensor, entries: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """The stored rows (main entry, index key) of entries ``entries [n]`` from their pooled latents."""
        at = entries * self.ratio
        keys = self.rotary.rotate(self.k_norm(self.wk(latent))[:, None, :], at)[:, 0]
        main = self.rotary.rotate(latent[:, None, :], at)[:, 0]
        return self.formats.main.encode(main), self.formats.index.encode(keys)

    def forward(self, x: torch.Tensor, batch: ForwardBatch, fused: bool = False) -> None:
        """Publish the entries (and index keys) of every group this step completes; buffer the open pair. A decode
        step takes the batched form (``dgpp_deepseek.v41_decode_rows``; ``fused``: its stores in Triton)."""
        if self.wgate is None:
            kv, gate = self.wkv(x), None
        else:  # fp32 projections of the bf16 rows: pooled in fp32, rounded once
            kv, gate = self.wkv(x.float()), self.wgate(x.float())
        if self.batched_decode and batch.is_decode_only:
            compress_decode_rows(self, kv, gate, batch, fused)
            return
        r, block_size = self.ratio, batch.cache.block_size
        pool, index_pool = batch.cache.kv[self.cache_name][0], batch.cache.kv[self.index_name][0]
        for seq in live_sequences(batch):
            b, start, q_len, ctx, end, slot = seq
            rows_kv = kv[start : start + q_len]
            rows_gate = gate[start : start + q_len] if gate is not None else None
            lo = ctx - ctx % r  # the open group's first position: its earlier rows are buffered
            if r > 1:
                assert rows_gate is not None
                ring = batch.cache.state[self.buffer_name]
                old = torch.arange(lo, ctx, device=x.device) % r
                rows_kv = torch.cat([ring["kv"][slot, old], rows_kv.to(ring["kv"].dtype)])
                rows_gate = torch.cat([ring["gate"][slot, old], rows_gate.to(ring["gate"].dtype)])
                keep = end - end % r  # the rows of the group still open after this step
                idx = torch.arange(keep, end, device=x.device) % r
                ring["kv"][slot, idx] = rows_kv[keep - lo :]
                ring["gate"][slot, idx] = rows_gate[keep - lo :]
            done = end // r - lo // r
            if done <= 0:
                continue
            grouped_kv = rows_kv[: done * r].unflatten(0, (done, r))
            grouped_gate = rows_gate[: done * r].unflatten(0, (done, r)) if rows_gate is not None else None
            latent = self.pool_groups(grouped_kv, grouped_gate)
            entries = torch.arange(lo // r, end // r, device=x.device)
            main, keys = self.entry_rows(latent, entries)
            for target, rows in ((pool, main), (index_pool, keys)):
                slots = entry_slots(batch.block_tables[b], entries, r, block_size, target.shape[1])
                flat = target.view(-1, target.shape[-1])
                flat.index_copy_(0, slots, rows.to(flat.dtype))


def candidate_blocks(
    scores: torch.Tensor, visible: torch.Tensor, block_size: int, topk_blocks: int
) -> torch.Tensor:
    """bool ``[rows, n]``: the entries of each row's kept blocks. ``scores [rows, n]`` are -inf past the row's
    ``visible`` entries; a block scores its best entry; the block of the newest visible entry is always kept."""
    rows, n = scores.shape
    nblocks = -(-n // block_size)
    padded = torch.full((rows, nblocks * block_size), -math.inf, dtype=scores.dtype, device=scores.device)
    padded[:, :n] = scores
    block_score = padded.unflatten(-1, (nblocks, block_size)).amax(-1)
    newest = (visible - 1).clamp_min(0) // block_size
    ids = torch.arange(nblocks, device=scores.device)
    block_score = torch.where((ids[None] == newest[:, None]) & (visible[:, None] > 0), math.inf, block_score)
    keep = top_mask(block_score, topk_blocks)
    # each block's flag over its entries (an expand: no repeat count for the device to size)
    return keep[:, :, None].expand(rows, nblocks, block_size).flatten(1)[:, :n]


def top_mask(scores: torch.Tensor, k: int) -> torch.Tensor:
    """bool mask of each row's ``k`` best scores above -inf; exact ties go to the lower index."""
    order = torch.sort(scores, dim=-1, descending=True, stable=True).indices[:, :k]
    mask = torch.zeros_like(scores, dtype=torch.bool)
    mask.scatter_(-1, order, True)
    return mask & (scores > -math.inf)


class IndexerV41(nn.Module):
    """``indexer.{wq_b, weights_proj}`` of an index source; scores its group's entries (see the module doc)."""

    def __init__(
        self,
        hidden_size: int,
        q_lora_rank: int,
        heads: int,
        head_dim: int,
        topk: int,
        rotary: TrailingRotary,
        formats: EntryFormats,
        *,
        dtype: torch.dtype,
    ) -> None:
        super().__init__()
        self.heads, self.head_dim, self.topk, self.rotary = heads, head_dim, topk, rotary
        self.formats = formats
        self.wq_b = Linear(q_lora_rank, heads * head_dim, dtype=dtype)
        self.weights_proj = Linear(hidden_size, heads, dtype=dtype)
        self.candidates: tuple[int, int] | None = None  # (block_size, topk_blocks) on the candidate source
        self.restricted = False  # selects inside the candidate source's blocks
        # decode steps take the batched device form (False: the per-sequence form, the reference it matches)
        self.batched_decode = True

    def forward(
        self,
        x: torch.Tensor,
        q_resid: torch.Tensor,
        batch: ForwardBatch,
        keys_name: str,
        ratio: int,
        flow: GroupFlow,
        packed_keys: PackedKeyForms | None = None,
    ) -> Selection | DecodePicks:
        """Each row's selection. ``packed_keys`` (a decode step where Triton runs): every row's scores in one
        kernel that reads the packed index keys (``dgpp.kernels.dsa_index``), else row by row over decoded keys.
        A decode step selects in batched form (``DecodePicks``)."""
        rows = x.shape[0]
        q = self.rotary.rotate(self.wq_b(q_resid).view(rows, self.heads, self.head_dim), batch.positions)
        q = round_fp4_e8m0(q).float()
        weights = self.weights_proj(x).float() * (self.head_dim * self.heads) ** -0.5
        pool = batch.cache.kv[keys_name][0]
        if self.batched_decode and batch.is_decode_only:
            return self._decode_picks(q, weights, pool, batch, ratio, flow, packed_keys)
        selection: Selection = [None] * rows
        every = None
        if packed_keys is not None:
            table = entry_table(batch.block_tables, ratio, batch.cache.block_size)
            live = (batch.state_slots >= 0) & (batch.seq_lens > 0)
            seen = torch.where(live, (batch.positions + 1) // ratio, 0)
            every = index_scores_triton(q, weights, pool, table, seen, 1.0, packed=packed_keys)
        for b, start, q_len, ctx, end, _ in live_sequences(batch):
            count = end // ratio
            visible = (torch.arange(ctx, end, device=x.device) + 1) // ratio
            if every is not None:
                scores = every[start : start + q_len, :count]
            else:
                stored = gather_entries(pool, batch.block_tables[b], count, ratio, batch.cache.block_size)
                keys = self.formats.index.decode(stored, torch.float32)
                # row by row: a row's scores have the same bits however the step batched or chunked it
                scores = torch.stack(
                    [
                        (weights[row, :, None] * (q[row] @ keys.t()).clamp_min(0)).sum(0)
                        for row in range(start, start + q_len)
                    ]
                )
            scores = scores.masked_fill(
                torch.arange(count, device=x.device)[None] >= visible[:, None], -math.inf
            )
            if self.candidates is not None:
                block_size, topk_blocks = self.candidates
                flow.candidates[b] = candidate_blocks(scores, visible, block_size, topk_blocks)
            elif self.restricted and b in flow.candidates:
                scores = scores.masked_fill(~flow.candidates[b], -math.inf)
            chosen = top_mask(scores, self.topk)
            for i in range(q_len):
                selection[start + i] = chosen[i].nonzero()[:, 0]
        return selection

    def _decode_picks(
        self,
        q: torch.Tensor,
        weights: torch.Tensor,
        pool: torch.Tensor,
        batch: ForwardBatch,
        ratio: int,
        flow: GroupFlow,
        packed_keys: PackedKeyForms | None,
    ) -> DecodePicks:
        """``forward`` of a decode step: every row over its whole entry table at once, nothing read on the host."""
        visible = visible_entries(batch, ratio)
        if packed_keys is not None:
            table = entry_table(batch.block_tables, ratio, batch.cache.block_size)
            scores = index_scores_triton(q, weights, pool, table, visible, 1.0, packed=packed_keys)
        else:
            scores = decode_scores(
                q, weights, pool, batch, ratio, lambda rows: self.formats.index.decode(rows, torch.float32)
            )
        scores = mask_unseen(scores, visible)
        if self.candidates is not None:
            block_size, topk_blocks = self.candidates
            flow.candidate_rows = candidate_blocks(scores, visible, block_size, topk_blocks)
        elif self.restricted and flow.candidate_rows is not None:
            scores = scores.masked_fill(~flow.candidate_rows, -math.inf)
        if packed_keys is not None:  # the fused path: the top-k in one kernel
            return kernel_picks(scores, visible, self.topk)
        return ascending_picks(top_mask(scores, self.topk), self.topk)
