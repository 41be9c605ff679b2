"""Compressed-layer decode attention (Triton interpreter, fp32) against its torch form: window ring + this row +
all complete entries (HCA) or the indexer's picks (CSA) + per-head sinks in one softmax, with padding rows,
partial windows and selections, and rows cut into several splits; rows keep their bits alone or batched, and
changing what a row must not see (its sink, entries past its complete windows, entries it did not pick) is
checked to matter or not."""

from __future__ import annotations

import pytest
import torch

from dgpp.kernels.compressed_decode_attention import (
    compressed_decode_attention_ref,
    compressed_decode_attention_triton,
)
from dgpp.nn.compressed_decode import entry_table
from dgpp.nn.window_compressor import gather_entries

HEADS, DIM, CAP, BS = 4, 32, 7, 8
SPLIT_KEYS = 32  # the smallest cut: long rows here use several splits


def _case(ratio: int, positions: list[int], seed: int, picks: int | None = None, heads: int = HEADS):
    g = torch.Generator().manual_seed(seed)
    rows = len(positions)
    per_block = max(1, BS // ratio)
    num_blocks = 64 * rows
    blocks = torch.randperm(num_blocks, generator=g)[: rows * 64].view(rows, 64).int()
    tables = entry_table(blocks, ratio, BS)
    pos = torch.tensor(positions)
    args = dict(
        q=torch.randn(rows, heads, DIM, generator=g),
        kv=torch.randn(rows, DIM, generator=g),
        ring=torch.randn(rows + 2, CAP, 1, DIM, generator=g),
        pool=torch.randn(num_blocks, per_block, 1, DIM, generator=g),
        tables=tables,
        slots=torch.arange(rows) + 1,
        positions=pos,
        seq_lens=(pos + 1).int(),
        sinks=torch.randn(heads, generator=g),
        scale=0.3,
        ratio=ratio,
        picks=None,
    )
    if picks is not None:  # any order; rows with fewer complete entries read only their first ones
        width = tables.shape[1] * per_block
        args["picks"] = torch.stack([torch.randperm(width, generator=g)[:picks] for _ in positions]).int()
        for r, p in enumerate(positions):
            complete = (p + 1) // ratio
            chosen = torch.randperm(max(complete, 1), generator=g)[: min(picks, complete)]
            args["picks"][r, : chosen.numel()] = chosen.int()
    return args


def _run(args: dict, **kw) -> torch.Tensor:
    return compressed_decode_attention_triton(**args, splits=8, min_split_keys=SPLIT_KEYS, **kw)


@pytest.mark.parametrize(
    ("ratio", "picks", "heads"),
    [(16, None, HEADS), (2, None, HEADS), (2, 12, HEADS), (2, 12, 20)],
    ids=["hca-wide", "all-entries", "selected", "selected-two-head-blocks"],
)
def test_kernel_matches_torch_form(ratio: int, picks: int | None, heads: int) -> None:
    # a first row, a partly filled window, a padding row (slot -1), rows of one split and of several
    positions = [0, 3, 40, 200, 511, 97]
    args = _case(ratio, positions, seed=ratio + (picks or 0), picks=picks, heads=heads)
    args["slots"][2] = -1
    args["seq_lens"][5] = 0
    out = _run(args)
    torch.testing.assert_close(out, compressed_decode_attention_ref(**args), rtol=1e-5, atol=1e-5)
    assert float(out[2].abs().max()) == 0.0 and float(out[5].abs().max()) == 0.0
    # one split per row: the same softmax summed in another order
    torch.testing.assert_close(
        compressed_decode_attention_triton(**args, splits=1), out, rtol=1e-5, atol=1e-5
    )


def test_entry_table_reads_the_entries_the_compressor_wrote() -> None:
    """Entry ``e`` through ``entry_table`` is where ``dgpp.nn.window_compressor`` stores it (ratio below and
    above the block size): attending through it equals attending the compressor's entries laid out in order."""
    for ratio in (2, 16):
        args = _case(ratio, [300], seed=5)
        blocks = torch.randperm(64, generator=torch.Generator().manual_seed(ratio)).int()[None]
        args["tables"] = entry_table(blocks, ratio, BS)
        in_order = gather_entries(args["pool"][:, :, 0], blocks[0], 301 // ratio, ratio, BS)
        laid_out = {"pool": in_order[:, None, None], "tables": torch.arange(in_order.shape[0]).int()[None]}
        torch.testing.assert_close(_run(args), _run({**args, **laid_out}), rtol=1e-5, atol=1e-5)


def test_a_row_is_the_same_bits_alone_or_in_a_batch() -> None:
    for picks in (None, 12):
        args = _case(2, [5, 300, 511, 60, 150], seed=9, picks=picks)
        together = _run(args)
        shared = ("ring", "pool", "sinks", "scale", "ratio")
        for r in range(5):
            alone = {k: v if k in shared or v is None else v[r : r + 1] for k, v in args.items()}
            assert torch.equal(_run(alone)[0], together[r])


def test_sinks_masking_and_selection_decide_the_output() -> None:
    args = _case(2, [40, 300], seed=11, picks=12)
    out = _run(args)
    # the sink joins the softmax: dropping it changes every head
    no_sink = compressed_decode_attention_ref(**{**args, "sinks": torch.full((HEADS,), float("-inf"))})
    assert (out - no_sink).abs().amax(dim=-1).min() > 1e-4
    # entries a row did not pick, or past its complete windows, are never read
    pool = args["pool"].clone()
    per_block = pool.shape[1]
    for r, p in enumerate((40, 300)):
        picked = set(args["picks"][r, : min(12, (p + 1) // 2)].tolist())
        for e in range(args["tables"].shape[1] * per_block):
            if e not in picked:
                pool[args["tables"][r, e // per_block], e % per_block] = 1e3
    assert torch.equal(_run({**args, "pool": pool}), out)
    # ... and the picks are what a row attends: all of its complete entries give another answer
    assert not torch.allclose(_run({**args, "picks": None}), out, atol=1e-3)
    # a picked entry is read
    e = int(args["picks"][1, 0])
    pool = args["pool"].clone()
    pool[args["tables"][1, e // per_block], e % per_block] *= 3
    assert not torch.allclose(_run({**args, "pool": pool})[1], out[1], atol=1e-4)


def test_window_reads_only_the_rows_before_the_row() -> None:
    """A row at position 3 sees ring rows 0..2 and itself; the ring's other slots (stale) are never read."""
    args = _case(16, [3, 100], seed=13)
    out = _run(args)
    ring = args["ring"].clone()
    slot = int(args["slots"][0])
    ring[slot, 3:] = 1e3  # positions 3..6 of the ring: not yet written for this sequence
    assert torch.equal(_run({**args, "ring": ring}), out)
    ring[slot, 1] = 1e3
    assert not torch.allclose(_run({**args, "ring": ring})[0], out[0], atol=1e-3)
