"""e4m3 K/V rows (``engine.kv_dtype: fp8``): the row form's round trip, and every attention kernel reading e4m3 tiles
with their scales (Triton interpreter, fp32 compute) against the same kernel over the dequantized cache and against
its torch reference reading the codes."""

from __future__ import annotations

import pytest
import torch

from dgpp.kernels.kv_fp8 import E4M3_MAX, dequantize_rows, quantize_rows, round_trip
from dgpp.kernels.paged_attention import paged_decode_attention_ref, paged_decode_attention_triton
from dgpp.kernels.prefill_attention import prefill_attention_ref, prefill_attention_triton
from dgpp.kernels.ring_write import RingWriteInputs, ring_write_ref, ring_write_triton
from dgpp.kernels.window_attention import window_attention_ref, window_attention_triton
from dgpp.nn.exact.attention import paged_decode_attention_fixed

GEN = torch.Generator().manual_seed(0)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_rows_round_trip_within_e4m3_error(dtype: torch.dtype) -> None:
    x = (torch.randn(64, 4, 48, generator=GEN) * torch.logspace(-3, 3, 64)[:, None, None]).to(dtype)
    x[5, 2] = 0  # an all-zero row keeps scale 0 and zero codes
    codes, scales = quantize_rows(x)
    assert codes.dtype == torch.float8_e4m3fn and codes.element_size() == 1
    assert scales.dtype == torch.float32 and scales.shape == (64, 4, 1)
    assert float(codes.float().abs().amax()) <= E4M3_MAX
    back = dequantize_rows(codes, scales, torch.float32)
    wide = x.float()
    # e4m3 keeps 3 mantissa bits: relative error 2^-4 of each value, floored at half its smallest normal step
    # (2^-7 of the row's scale) for the row's small values
    bound = wide.abs() * 2**-4 + scales * 2**-9 * 1.0001
    assert bool(((back - wide).abs() <= bound).all())
    assert torch.equal(back[5, 2], torch.zeros(48))
    assert not torch.equal(back, wide)  # the form is lossy: it does change values
    assert torch.equal(round_trip(x), dequantize_rows(codes, scales, dtype))


def _quantized_cache(num_blocks: int, block_size: int, hk: int, dim: int, v_dim: int, seed: int):
    g = torch.Generator().manual_seed(seed)
    k = torch.randn(num_blocks, block_size, hk, dim, generator=g) * 3
    v = torch.randn(num_blocks, block_size, hk, v_dim, generator=g)
    (kc, ks), (vc, vs) = quantize_rows(k), quantize_rows(v)
    return kc, vc, (ks, vs), dequantize_rows(kc, ks, torch.float32), dequantize_rows(vc, vs, torch.float32)


def _tables(seq_lens: list[int], block_size: int, num_blocks: int, seed: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    width = num_blocks // len(seq_lens)
    perm = torch.randperm(num_blocks, generator=g)
    tables = torch.full((len(seq_lens), width), -1, dtype=torch.int32)
    for b, n in enumerate(seq_lens):
        used = -(-n // block_size)
        tables[b, :used] = perm[b * width : b * width + used].int()
    return tables


@pytest.mark.parametrize(("hq", "hk", "dim", "v_dim"), [(4, 2, 32, 32), (6, 1, 48, 32)])
def test_decode_kernel_reads_e4m3_tiles(hq: int, hk: int, dim: int, v_dim: int) -> None:
    seq_lens = [1, 37, 300, 0]
    kc, vc, scales, k_seen, v_seen = _quantized_cache(256, 8, hk, dim, v_dim, seed=hq)
    tables = _tables(seq_lens, 8, 256, seed=1)
    q = torch.randn(len(seq_lens), hq, dim, generator=GEN)
    lens = torch.tensor(seq_lens, dtype=torch.int32)
    out = paged_decode_attention_triton(q, kc, vc, tables, lens, 0.2, scales=scales)
    torch.testing.assert_close(out, paged_decode_attention_triton(q, k_seen, v_seen, tables, lens, 0.2))
    ref = paged_decode_attention_ref(q, kc, vc, tables, lens, 0.2, scales=scales)
    torch.testing.assert_close(out, ref, rtol=1e-4, atol=1e-5)
    fixed = paged_decode_attention_fixed(q, kc, vc, tables, lens, 0.2, splits=4, scales=scales)
    torch.testing.assert_close(fixed, ref, rtol=1e-4, atol=1e-5)
    assert float(out[-1].abs().max()) == 0.0  # the padding row


def test_prefill_kernel_reads_e4m3_tiles() -> None:
    hq, hk, dim, bs = 4, 2, 32, 8
    ctx, q_lens = [0, 21, 5], [19, 7, 1]
    kc, vc, scales, k_seen, v_seen = _quantized_cache(48, bs, hk, dim, dim, seed=3)
    tables = _tables([c + n for c, n in zip(ctx, q_lens, strict=True)], bs, 48, seed=2)
    q = torch.randn(sum(q_lens), hq, dim, generator=GEN)
    starts = torch.tensor([0, *torch.tensor(q_lens).cumsum(0).tolist()], dtype=torch.int32)
    ctx_t = torch.tensor(ctx, dtype=torch.int32)
    out = prefill_attention_triton(q, kc, vc, tables, starts, ctx_t, 0.25, block_m=16, scales=scales)
    seen = prefill_attention_triton(q, k_seen, v_seen, tables, starts, ctx_t, 0.25, block_m=16)
    torch.testing.assert_close(out, seen)
    ref = prefill_attention_ref(q, kc, vc, tables, starts, ctx_t, 0.25, scales=scales)
    torch.testing.assert_close(out, ref, rtol=1e-4, atol=1e-5)


def _window_step(ctx: list[int], q_lens: list[int], hq: int, hk: int, dim: int):
    rows = sum(q_lens)
    starts = torch.tensor([0, *torch.tensor(q_lens).cumsum(0).tolist()], dtype=torch.int32)
    lens = torch.tensor([c + n for c, n in zip(ctx, q_lens, strict=True)], dtype=torch.int32)
    q = torch.randn(rows, hq, dim, generator=GEN)
    k = round_trip(torch.randn(rows, hk, dim, generator=GEN))  # a ring layer hands its rows round-tripped
    v = round_trip(torch.randn(rows, hk, dim, generator=GEN))
    return q, k, v, starts, torch.tensor(ctx, dtype=torch.int32), lens


@pytest.mark.parametrize("sinks", [True, False])
def test_window_kernel_reads_e4m3_ring_and_pool(sinks: bool) -> None:
    hq, hk, dim, window = 4, 2, 16, 7
    q, k, v, starts, ctx, lens = _window_step([30, 3, 0], [1, 9, 12], hq, hk, dim)
    sink = torch.randn(hq, generator=GEN) if sinks else None
    # the ring source: slots x (window - 1) rows
    kc, vc, scales, k_seen, v_seen = _quantized_cache(4, window - 1, hk, dim, dim, seed=5)
    slots = torch.tensor([3, 0, 2])
    common = (starts, ctx, lens, sink, 0.3, window, False)
    out = window_attention_triton(q, k, v, kc, vc, slots, *common, scales=scales)
    torch.testing.assert_close(out, window_attention_triton(q, k, v, k_seen, v_seen, slots, *common))
    torch.testing.assert_close(
        out, window_attention_ref(q, k, v, kc, vc, slots, *common, scales=scales), rtol=1e-5, atol=1e-5
    )
    # the paged source (full attention with sinks): the whole context from the pool
    kc, vc, scales, k_seen, v_seen = _quantized_cache(40, 4, hk, dim, dim, seed=6)
    tables = _tables(lens.tolist(), 4, 40, seed=7)
    paged = (starts, ctx, lens, sink, 0.3, 0, True)
    out = window_attention_triton(q, None, None, kc, vc, tables, *paged, scales=scales)
    torch.testing.assert_close(out, window_attention_triton(q, None, None, k_seen, v_seen, tables, *paged))
    torch.testing.assert_close(
        out, window_attention_ref(q, None, None, kc, vc, tables, *paged, scales=scales), rtol=1e-5, atol=1e-5
    )


def test_ring_write_stores_codes_and_scales() -> None:
    hk, dim, cap = 2, 16, 6
    _, k, v, starts, ctx, lens = _window_step([30, 0], [1, 9], 2, hk, dim)
    (k_codes, k_scale), (v_codes, v_scale) = quantize_rows(k), quantize_rows(v)
    slots = torch.tensor([1, 0])
    places = (slots, starts, ctx, lens)
    rings = []
    for write in (ring_write_ref, ring_write_triton):
        ring = [torch.zeros(2, cap, hk, dim, dtype=torch.float8_e4m3fn) for _ in range(2)]
        ring_scales = [torch.zeros(2, cap, hk, 1) for _ in range(2)]
        write(RingWriteInputs(k_codes, v_codes, *ring, *places))
        write(RingWriteInputs(k_scale, v_scale, *ring_scales, *places))
        rings.append([r.float() for r in ring] + ring_scales)
    for got, want in zip(rings[1], rings[0], strict=True):
        assert torch.equal(got, want)
    # row 0 (position 30) sits at index 30 % 6 of slot 1, dequantizing to the round-tripped row
    assert torch.equal(
        dequantize_rows(rings[0][0][1, 0].to(torch.float8_e4m3fn), rings[0][2][1, 0], k.dtype), k[0]
    )


def test_paged_write_stores_codes_and_scales_at_the_slots() -> None:
    """The Triton scatter (used on CUDA) against the torch one for e4m3 codes and their [.., 1] scale rows."""
    from dgpp.kernels.kv_write import write_kv_triton
    from dgpp.nn.attention import write_kv

    k = torch.randn(5, 2, 16, generator=GEN)
    v = torch.randn(5, 2, 8, generator=GEN)
    (k_codes, k_scale), (v_codes, v_scale) = quantize_rows(k), quantize_rows(v)
    slots = torch.tensor([3, -1, 9, 0, 14], dtype=torch.int32)
    pools = []
    for write in (write_kv, write_kv_triton):
        codes = [torch.zeros(4, 4, 2, d, dtype=torch.float8_e4m3fn) for d in (16, 8)]
        scales = [torch.zeros(4, 4, 2, 1) for _ in range(2)]
        write(*codes, k_codes, v_codes, slots)
        write(*scales, k_scale, v_scale, slots)
        pools.append([c.float() for c in codes] + scales)
    for got, want in zip(pools[1], pools[0], strict=True):
        assert torch.equal(got, want)
    k_pool, k_sc = pools[0][0].view(16, 2, 16), pools[0][2].view(16, 2, 1)
    assert torch.equal(
        dequantize_rows(k_pool[9].to(torch.float8_e4m3fn), k_sc[9], torch.float32), round_trip(k[2])
    )
    assert float(k_sc[1].abs().max()) == 0.0  # slot -1 wrote nothing
