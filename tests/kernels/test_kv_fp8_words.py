"""e4m3 K/V rows read as int32 words of four codes: every code of a word lands in its own column with the value
``dequantize_rows`` gives (``dgpp.kernels.kv_fp8.load_e4m3_rows``), the window kernel reading words (pool and ring)
gives the bits of the same kernel over the dequantized cache, the paged decode (scales folded out of its tiles)
matches the reference over it, and neither reads a cache with two columns of each word swapped (Triton
interpreter, fp32 compute)."""

from __future__ import annotations

import pytest
import torch

from dgpp.kernels._triton import tl, triton
from dgpp.kernels.kv_fp8 import dequantize_rows, e4m3_words, load_e4m3_rows, quantize_rows
from dgpp.kernels.paged_attention import paged_decode_attention_ref, paged_decode_attention_triton
from dgpp.kernels.window_attention import window_attention_triton

GEN = torch.Generator().manual_seed(11)


@triton.jit
def _rows_kernel(
    words_ptr,
    scale_ptr,
    out_ptr,
    row_stride,
    width,
    N: tl.constexpr,
    BLOCK_W: tl.constexpr,
    TRANSPOSED: tl.constexpr,
):
    """The rows' tile stored as ``out [N, 4 * BLOCK_W]`` whichever way it was loaded."""
    n = tl.arange(0, N)
    cols = tl.arange(0, 4 * BLOCK_W)
    live = n < N - 1  # the last row is masked off
    tile = load_e4m3_rows(
        words_ptr + n * row_stride, scale_ptr, n, live, width, tl.float32, BLOCK_W, TRANSPOSED
    )
    if TRANSPOSED:
        tl.store(out_ptr + n[None, :] * (4 * BLOCK_W) + cols[:, None], tile)
    else:
        tl.store(out_ptr + n[:, None] * (4 * BLOCK_W) + cols[None, :], tile)


def _finite_codes() -> torch.Tensor:
    """The 254 e4m3 codes that are not NaN (0x7F, 0xFF), as bytes."""
    codes = torch.arange(256, dtype=torch.uint8)
    return codes[~codes.view(torch.float8_e4m3fn).float().isnan()]


@pytest.mark.parametrize("transposed", [False, True])
def test_each_code_of_a_word_lands_in_its_column(transposed: bool) -> None:
    rows, block_w, width = 8, 16, 12  # 12 words (48 codes) of a row are read, the tile is 64 wide
    finite = _finite_codes()
    # every row a different shuffle of the codes, so the four codes of each word differ from one another
    picks = torch.stack(
        [finite[torch.randperm(len(finite), generator=GEN)[: 4 * width]] for _ in range(rows)]
    )
    codes = picks.view(torch.float8_e4m3fn)
    # scales of all sizes: 0 (an all-zero row's), subnormal ones and products, up to a bf16 row near fp32's top
    scales = torch.tensor([1.0, 0.0, 3e-39, 1e-30, 0.0173, 300.0, 6.2e35, 2.0])[:, None]
    out = torch.full((rows, 4 * block_w), float("nan"))
    _rows_kernel[(1,)](e4m3_words(codes), scales, out, width, width, rows, block_w, transposed)
    want = dequantize_rows(codes, scales, torch.float32)
    assert torch.equal(out[:-1, : 4 * width], want[:-1])
    assert torch.equal(out[:, 4 * width :], torch.zeros(rows, 4 * (block_w - width)))
    assert torch.equal(out[-1], torch.zeros(4 * block_w))  # the masked row
    # the codes do differ within each word: a decode that swapped two columns of a word would not match
    swapped = want.view(rows, width, 4)[:, :, [0, 2, 1, 3]].reshape(rows, -1)
    assert not torch.equal(out[:-1, : 4 * width], swapped[:-1])


def _codes_and_seen(shape: tuple[int, ...]) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    codes, scale = quantize_rows(torch.randn(*shape, generator=GEN) * 2)
    return codes, scale, dequantize_rows(codes, scale, torch.float32)


def _swap_within_words(x: torch.Tensor) -> torch.Tensor:
    """``x`` with columns ``4w + 1`` and ``4w + 2`` exchanged: what a decode into the wrong columns would read."""
    return x.unflatten(-1, (-1, 4))[..., [0, 2, 1, 3]].flatten(-2)


def test_paged_decode_reads_each_code_of_a_word_in_its_column() -> None:
    """The paged decode folds the row scales out of its tiles (so its bits are its own, not those of the kernel
    over the dequantized cache): it matches the reference over the dequantized rows, and not the reference over
    rows with two columns of each word swapped."""
    hq, hk, dim, block_size = 8, 2, 64, 16
    kc, ks, k_seen = _codes_and_seen((24, block_size, hk, dim))
    vc, vs, v_seen = _codes_and_seen((24, block_size, hk, dim))
    tables = torch.randperm(24, generator=GEN).int().view(2, 12)
    lens = torch.tensor([150, 77], dtype=torch.int32)
    q = torch.randn(2, hq, dim, generator=GEN)
    out = paged_decode_attention_triton(q, kc, vc, tables, lens, 0.125, scales=(ks, vs))
    torch.testing.assert_close(out, paged_decode_attention_ref(q, k_seen, v_seen, tables, lens, 0.125))
    for k, v in ((_swap_within_words(k_seen), v_seen), (k_seen, _swap_within_words(v_seen))):
        assert not torch.allclose(out, paged_decode_attention_ref(q, k, v, tables, lens, 0.125), atol=1e-3)


def test_window_kernel_reading_words_gives_the_dequantized_bits() -> None:
    hq, hk, dim, window = 4, 2, 32, 9
    ctx, q_lens = [20, 0], [1, 5]
    starts = torch.tensor([0, 1, 6], dtype=torch.int32)
    context = torch.tensor(ctx, dtype=torch.int32)
    lens = torch.tensor([21, 5], dtype=torch.int32)
    q = torch.randn(sum(q_lens), hq, dim, generator=GEN)
    sinks = torch.randn(hq, generator=GEN)
    # the paged source: the whole context from the pool
    kc, ks, k_seen = _codes_and_seen((12, 4, hk, dim))
    vc, vs, v_seen = _codes_and_seen((12, 4, hk, dim))
    tables = torch.arange(12, dtype=torch.int32).flip(0).view(2, 6)
    paged = (starts, context, lens, sinks, 0.3, 0, True)
    out = window_attention_triton(q, None, None, kc, vc, tables, *paged, scales=(ks, vs))
    assert torch.equal(out, window_attention_triton(q, None, None, k_seen, v_seen, tables, *paged))
    swapped = window_attention_triton(q, None, None, _swap_within_words(k_seen), v_seen, tables, *paged)
    assert not torch.allclose(out, swapped, atol=1e-3)
    # the ring source: window - 1 positions before this step, then the step's own (round-tripped) rows
    kc, ks, k_seen = _codes_and_seen((2, window - 1, hk, dim))
    vc, vs, v_seen = _codes_and_seen((2, window - 1, hk, dim))
    k_new = _codes_and_seen((sum(q_lens), hk, dim))[2]
    v_new = _codes_and_seen((sum(q_lens), hk, dim))[2]
    slots = torch.tensor([1, 0])
    ring = (starts, context, lens, sinks, 0.3, window, False)
    out = window_attention_triton(q, k_new, v_new, kc, vc, slots, *ring, scales=(ks, vs))
    assert torch.equal(out, window_attention_triton(q, k_new, v_new, k_seen, v_seen, slots, *ring))
    swapped = window_attention_triton(q, k_new, v_new, k_seen, _swap_within_words(v_seen), slots, *ring)
    assert not torch.allclose(out[:1], swapped[:1], atol=1e-3)  # row 0 reads the ring
