"""Paged decode over e4m3 rows with the row scales folded out of the tile (``dgpp.kernels.kv_fp8.load_e4m3_lanes``):
every finite code is placed exactly as ``code * 2^-120`` (bf16 lanes and fp32), and the decode kernel stays within
the fp32 reference at many contexts, GQA groups, split counts and with sinks, reads each row's own K and V scale,
and gives a row the same bits alone or in a batch (Triton interpreter, fp32 compute)."""

from __future__ import annotations

import pytest
import torch

from dgpp.kernels._triton import tl, triton
from dgpp.kernels.kv_fp8 import e4m3_words, load_e4m3_lanes, quantize_rows, tiles_in_columns
from dgpp.kernels.paged_attention import decode_attention_with_splits, paged_decode_attention_ref
from dgpp.kernels.window_attention import window_attention_ref

GEN = torch.Generator()


@pytest.fixture(autouse=True)
def _seeded() -> None:
    """Each test draws the same data whichever tests ran before it."""
    GEN.manual_seed(5)


@triton.jit
def _codes_kernel(
    words_ptr, out_ptr, width, N: tl.constexpr, BLOCK_W: tl.constexpr, TRANSPOSED: tl.constexpr
):
    """The rows' four code tiles stored as ``out [N, 4 * BLOCK_W]`` (out's dtype) with code ``4w + i`` in column
    ``4w + i``, whichever way they were loaded."""
    n = tl.arange(0, N)
    cols = tl.arange(0, 4 * BLOCK_W)
    live = n < N - 1  # the last row is masked off
    dtype: tl.constexpr = out_ptr.dtype.element_ty
    c0, c1, c2, c3 = load_e4m3_lanes(words_ptr + n * width, live, width, dtype, BLOCK_W, TRANSPOSED)
    if TRANSPOSED:  # [BLOCK_W, N] tiles
        tile = tiles_in_columns(tl.trans(c0), tl.trans(c1), tl.trans(c2), tl.trans(c3))
    else:
        tile = tiles_in_columns(c0, c1, c2, c3)
    tl.store(out_ptr + n[:, None] * (4 * BLOCK_W) + cols[None, :], tile)


def _finite_codes() -> torch.Tensor:
    codes = torch.arange(256, dtype=torch.uint8)
    return codes[~codes.view(torch.float8_e4m3fn).float().isnan()]


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32, torch.float16])
@pytest.mark.parametrize("transposed", [False, True])
def test_every_finite_code_is_placed_exactly(dtype: torch.dtype, transposed: bool) -> None:
    finite = _finite_codes()
    rows, width = 8, 64  # 256 codes a row: each row every finite code (and two zeros) in its own order
    picks = torch.zeros(rows, 4 * width, dtype=torch.uint8)
    for r in range(rows):
        picks[r, : len(finite)] = finite[torch.randperm(len(finite), generator=GEN)]
    codes = picks.view(torch.float8_e4m3fn)
    out = torch.full((rows, 4 * width), float("nan"), dtype=dtype)
    _codes_kernel[(1,)](e4m3_words(codes), out, width, rows, width, transposed)
    # bf16 lanes stored as they are (their bits, subnormals included), read back exactly by torch
    unit = 2.0**-8 if dtype == torch.float16 else 2.0**-120  # fp16 lanes: fp16's exponent range
    want = (codes.double() * unit).float()
    got = out.float()
    assert torch.equal(got[:-1], want[:-1])
    assert torch.equal(got[-1], torch.zeros(4 * width))  # the masked row
    assert bool((want[:-1] != 0).sum() >= 252 * (rows - 1))  # the subnormal codes are not all zeros
    # the four codes of each word differ: a decode that swapped two lanes of a word would not match
    swapped = want.view(rows, width, 4)[:, :, [0, 2, 1, 3]].reshape(rows, -1)
    assert not torch.equal(got[:-1], swapped[:-1])


def _pool(blocks: int, block_size: int, hk: int, dim: int, v_dim: int, row_spread: float):
    """Codes and scales of random rows whose amax spans ``10^-row_spread .. 10^row_spread`` (per row)."""

    def rows(width: int) -> torch.Tensor:
        x = torch.randn(blocks, block_size, hk, width, generator=GEN)
        levels = torch.logspace(-row_spread, row_spread, blocks * block_size * hk)
        return x * levels[torch.randperm(levels.numel(), generator=GEN)].view(blocks, block_size, hk, 1)

    (kc, ks), (vc, vs) = quantize_rows(rows(dim)), quantize_rows(rows(v_dim))
    return kc, vc, (ks, vs)


def _tables(lens: list[int], block_size: int, blocks: int) -> torch.Tensor:
    width = blocks // len(lens)
    return torch.randperm(blocks, generator=GEN)[: len(lens) * width].view(len(lens), width).int()


def _sink_ref(q, kc, vc, tables, lens, sinks, scale, scales):
    seq_lens = torch.tensor(lens, dtype=torch.int32)
    starts = torch.arange(len(lens) + 1, dtype=torch.int32)
    ctx = (seq_lens - 1).clamp(min=0)
    return window_attention_ref(
        q, None, None, kc, vc, tables, starts, ctx, seq_lens, sinks, scale, 0, True, scales
    )


CASES = [  # (query heads, KV heads, head dim, value dim, splits, sinks)
    (4, 4, 32, 32, 1, False),
    (8, 2, 64, 32, 4, False),
    (6, 1, 48, 48, 3, True),
    (16, 2, 32, 64, 8, True),
]


@pytest.mark.parametrize(("hq", "hk", "dim", "v_dim", "splits", "sinks"), CASES)
def test_folded_decode_matches_the_fp32_reference(
    hq: int, hk: int, dim: int, v_dim: int, splits: int, sinks: bool
) -> None:
    lens, bs = [1, 63, 64, 65, 200, 0, 321], 16
    blocks = len(lens) * 21
    kc, vc, scales = _pool(blocks, bs, hk, dim, v_dim, row_spread=1.5)
    tables = _tables(lens, bs, blocks)
    q = torch.randn(len(lens), hq, dim, generator=GEN) * 0.5
    seq_lens = torch.tensor(lens, dtype=torch.int32)
    sink = torch.randn(hq, generator=GEN) + 1 if sinks else None
    out = decode_attention_with_splits(q, kc, vc, tables, seq_lens, 0.2, 0, splits, scales=scales, sinks=sink)
    if sinks:
        ref = _sink_ref(q, kc, vc, tables, lens, sink, 0.2, scales)
    else:
        ref = paged_decode_attention_ref(q, kc, vc, tables, seq_lens, 0.2, scales=scales)
    torch.testing.assert_close(out, ref, rtol=1e-4, atol=1e-5)
    assert float(out[5].abs().max()) == 0.0  # the padding row


def test_each_row_reads_its_own_key_and_value_scale() -> None:
    """Row amaxes spread over 10^-4 .. 10^4: a kernel that dropped, shared or misplaced either scale is far off."""
    hq, hk, dim, bs = 8, 2, 32, 8
    lens = [90, 37]
    kc, vc, (ks, vs) = _pool(24, bs, hk, dim, dim, row_spread=4.0)
    tables = _tables(lens, bs, 24)
    q = torch.randn(len(lens), hq, dim, generator=GEN) * 0.05
    seq_lens = torch.tensor(lens, dtype=torch.int32)
    out = decode_attention_with_splits(q, kc, vc, tables, seq_lens, 0.5, 0, 2, scales=(ks, vs))
    ref = paged_decode_attention_ref(q, kc, vc, tables, seq_lens, 0.5, scales=(ks, vs))
    torch.testing.assert_close(out, ref, rtol=1e-5, atol=1e-5)
    # what a read with one shared K scale, or one shared V scale, would give is nowhere near
    for wrong in ((ks.mean().expand_as(ks), vs), (ks, vs.mean().expand_as(vs))):
        off = paged_decode_attention_ref(q, kc, vc, tables, seq_lens, 0.5, scales=wrong)
        assert not torch.allclose(off, ref, rtol=1e-2, atol=1e-2)


def test_a_row_has_the_same_bits_alone_and_in_a_batch() -> None:
    hq, hk, dim, bs = 8, 2, 32, 16
    lens = [150, 7, 300, 64]
    kc, vc, scales = _pool(80, bs, hk, dim, dim, row_spread=1.0)
    tables = _tables(lens, bs, 80)
    q = torch.randn(len(lens), hq, dim, generator=GEN)
    seq_lens = torch.tensor(lens, dtype=torch.int32)
    sinks = torch.randn(hq, generator=GEN)
    batched = decode_attention_with_splits(
        q, kc, vc, tables, seq_lens, 0.3, 0, 4, 4, scales=scales, sinks=sinks
    )
    for b in range(len(lens)):
        one = slice(b, b + 1)
        # one program per split alone, several splits per program in the batch: the same bits either way
        alone = decode_attention_with_splits(
            q[one], kc, vc, tables[one], seq_lens[one], 0.3, 0, 4, 1, scales=scales, sinks=sinks
        )
        assert torch.equal(alone, batched[one])


def test_folded_decode_in_fp16_matches_the_fp32_reference() -> None:
    """fp16 compute takes fp16 lanes and its own powers of two: rows with amax up to fp16's 65504 stay finite."""
    hq, hk, dim, bs = 8, 2, 64, 16
    lens = [150, 7, 64]
    kc, vc, scales = _pool(40, bs, hk, dim, dim, row_spread=4.0)
    tables = _tables(lens, bs, 40)
    q = torch.randn(len(lens), hq, dim, generator=GEN).half()
    seq_lens = torch.tensor(lens, dtype=torch.int32)
    out = decode_attention_with_splits(q, kc, vc, tables, seq_lens, 0.3, 0, 2, scales=scales)
    ref = paged_decode_attention_ref(q.float(), kc, vc, tables, seq_lens, 0.3, scales=scales)
    assert out.dtype == torch.float16 and bool(out.isfinite().all())
    torch.testing.assert_close(out.float(), ref, rtol=2e-3, atol=2e-3)
