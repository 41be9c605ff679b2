"""DeepSeek-V4.1-Flash's decode-only steps on Triton devices: the attention reads the packed rings and entries.

A layer's row attends its window ring, this step's latent row, its group's selected entries (none on a window-only
layer) and its head's sink in ONE softmax (``dgpp.kernels.compressed_decode_attention`` with ``packed`` forms): the
ring's FP8 codes + E8M0 scales and the entries' FP4 nibbles + E4M3 scales are decoded in registers, tile by tile,
to exactly the values ``v41_packed_entries``' ``decode`` gives, so nothing is decoded into the compute dtype
beforehand. The step's rows then join the rings in one launch that quantizes them
(``dgpp.kernels.block_scaled_ring_write``). Both launches read no host value and give a row the same bits alone or
batched. The index sources score the step's rows in one kernel over the packed index keys (``index_key_forms``,
``IndexerV41``); the compressor, the candidate blocks and the top-k run batched on the device
(``dgpp_deepseek.v41_decode_rows``), whose ``DecodePicks`` are the kernel's pick table and per-row counts as they
are (a per-row selection, the per-sequence forms', becomes one on the host: ``pick_table``).
"""

from __future__ import annotations

from typing import Protocol

import torch

from dgpp.kernels.block_scaled_ring_write import ring_write_fp8_blocks_triton
from dgpp.kernels.block_scaled_tiles import PackedKeyForms
from dgpp.kernels.compressed_decode_attention import (
    CompressedDecodeInputs,
    compressed_decode_attention_triton,
)
from dgpp.nn.compressed_decode import entry_table
from dgpp.nn.window_compressor import live_sequences
from dgpp.plugin_api import ForwardBatch
from dgpp_deepseek.v41_decode_rows import DecodePicks
from dgpp_deepseek.v41_indexer import Selection
from dgpp_deepseek.v41_packed_entries import EntryFormats, PackedFP4, PackedFP8


class DecodeLayer(Protocol):
    """What the decode path reads of a ``DeepseekV41Attention``: its ring's and group pool's names, sinks and
    shape."""

    @property
    def cache_name(self) -> str: ...

    @property
    def source_name(self) -> str: ...

    @property
    def ratio(self) -> int: ...

    @property
    def head_dim(self) -> int: ...

    @property
    def attn_sink(self) -> torch.Tensor: ...


def packed_forms(formats: EntryFormats) -> PackedKeyForms | None:
    """The kernel's view of the rings' and main entries' forms; None when a pool holds them otherwise."""
    ring, main = formats.window, formats.main
    if not (isinstance(ring, PackedFP8) and isinstance(main, PackedFP4)):
        return None
    return PackedKeyForms(ring.block, main.block, main.scale_kind == "e8m0")


def index_key_forms(formats: EntryFormats) -> PackedKeyForms | None:
    """The index keys' form for the indexer's scoring kernel; None when the pool holds them otherwise."""
    index = formats.index
    if not isinstance(index, PackedFP4):
        return None
    return PackedKeyForms(entry_block=index.block, entry_e8m0=index.scale_kind == "e8m0")


def pick_table(selection: Selection, batch: ForwardBatch, ratio: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(picks ``[R, K]`` int32, counts ``[R]`` int32) of a decode step's rows: each row's selected entries (every
    visible one where it has no selection), padded; a padding row counts 0."""
    rows = batch.positions.shape[0]
    device = batch.positions.device
    chosen: list[torch.Tensor] = [torch.zeros(0, dtype=torch.int32, device=device)] * rows
    for _b, start, _q_len, _ctx, end, _slot in live_sequences(batch):
        row = selection[start]
        every = torch.arange(end // ratio, device=device)
        chosen[start] = (every if row is None else row).to(torch.int32)
    lengths = [t.numel() for t in chosen]
    counts = torch.tensor(lengths, dtype=torch.int32, device=device)
    width = max(1, *lengths)
    picks = torch.zeros(rows, width, dtype=torch.int32, device=device)
    for r, t in enumerate(chosen):
        picks[r, : t.numel()] = t
    return picks, counts


def per_row_selection(selection: Selection | DecodePicks, batch: ForwardBatch) -> Selection:
    """A decode step's picks as the per-row list the torch attention reads (host reads: the reference path)."""
    if not isinstance(selection, DecodePicks):
        return selection
    counts = selection.counts.tolist()
    out: Selection = [None] * len(counts)
    for _b, start, _q_len, _ctx, _end, _slot in live_sequences(batch):
        out[start] = selection.picks[start, : counts[start]].long()
    return out


def packed_decode_attention(
    layer: DecodeLayer,
    q: torch.Tensor,
    kv: torch.Tensor,
    batch: ForwardBatch,
    selection: Selection | DecodePicks,
    forms: PackedKeyForms,
) -> torch.Tensor:
    """``[R, H, D]`` attention of a decode step over the layer's packed ring and its group's packed pool, then the
    rows' packed ring write."""
    ring = batch.cache.state[layer.cache_name]["k"]
    rows = q.shape[0]
    if layer.ratio:
        pool = batch.cache.kv[f"{layer.source_name}.compressor"][0]
        table = entry_table(batch.block_tables, layer.ratio, batch.cache.block_size)
        if isinstance(selection, DecodePicks):  # the batched decode form: already the kernel's table
            picks, counts = selection
        else:
            picks, counts = pick_table(selection, batch, layer.ratio)
        ratio = layer.ratio
    else:  # a window-only layer: no entries, an empty pool the kernel never reads
        width = layer.head_dim // 2 + layer.head_dim // forms.entry_block
        pool = torch.zeros(1, 1, 1, width, dtype=torch.uint8, device=q.device)
        table, ratio = batch.block_tables, 1
        picks = torch.zeros(rows, 1, dtype=torch.int32, device=q.device)
        counts = torch.zeros(rows, dtype=torch.int32, device=q.device)
    step = CompressedDecodeInputs(
        q,
        kv,
        ring,
        pool,
        table,
        batch.state_slots,
        batch.positions,
        batch.seq_lens,
        layer.attn_sink,
        layer.head_dim**-0.5,
        ratio,
        picks,
        counts,
    )
    out = compressed_decode_attention_triton(step, packed=forms)
    # after the attention: the new row takes the ring index of the oldest window row it read
    ring_write_fp8_blocks_triton(
        kv, ring, batch.state_slots, batch.positions, batch.seq_lens, forms.ring_block
    )
    return out
