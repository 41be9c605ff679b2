"""The MLA latent cache's fp8 / fp4 forms (``engine.kv_dtype``) and the kernels that read them (Triton interpreter,
fp32): round trips within each format's error, the packed layout, the absorbed MLA kernel over quantized latents
(dense and DSA-selected rows) and the DSA index scores over e4m3 keys."""

from __future__ import annotations

import pytest
import torch

from dgpp.kernels.dsa_index import index_scores_ref, index_scores_triton
from dgpp.kernels.kv_fp8 import quantize_rows
from dgpp.kernels.latent_formats import (
    dequantize_fp4,
    dequantize_latent,
    e2m1_codes,
    e2m1_values,
    quantize_fp4,
    quantize_latent,
)
from dgpp.kernels.mla_attention import mla_attention_ref, mla_attention_triton
from dgpp.step.cache_spec import KV_FP8, fp4_row_bytes

LATENT, ROPE, HEADS, BS = 64, 8, 4, 4


def test_e2m1_rounds_to_nearest_with_ties_to_even_and_saturates():
    grid = torch.tensor([0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0])
    assert torch.equal(e2m1_values(e2m1_codes(grid)), grid)
    assert torch.equal(e2m1_values(e2m1_codes(-grid[1:])), -grid[1:])
    ties = torch.tensor([0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5.0])
    assert e2m1_values(e2m1_codes(ties)).tolist() == [0.0, 1.0, 1.0, 2.0, 2.0, 4.0, 4.0]
    assert e2m1_values(e2m1_codes(torch.tensor([7.0, -100.0]))).tolist() == [6.0, -6.0]


def test_fp4_row_layout_is_the_originals_288_bytes_at_512():
    assert fp4_row_bytes(512) == 288 and fp4_row_bytes(64) == 48 and fp4_row_bytes(16) == 16
    x = torch.randn(3, 5, 512)
    packed, scale = quantize_fp4(x)
    assert packed.dtype == torch.uint8 and packed.shape == (3, 5, 288) and scale.shape == (3, 5, 1)
    # low nibble = even element: [6, -3, 0, ...] stores e2m1 codes 0x7 (6) and 0xD (-3) in its first byte
    row = torch.zeros(1, 16)
    row[0, 0], row[0, 1] = 6.0, -3.0
    packed, scale = quantize_fp4(row)
    assert int(packed[0, 0]) == (0x7 | (0xD << 4))
    assert torch.equal(scale, torch.tensor([[6.0]]) / (6 * 448))
    assert int(packed[0, 8]) == 0x7E  # the block scale code e4m3(448): 448 · s_r = 1, the block's S
    assert torch.equal(dequantize_fp4(packed, scale, 16, torch.float32), row)


@pytest.mark.parametrize(("fmt", "bound"), [("fp8", 2**-4), ("fp4", 0.25)])
def test_round_trip_within_the_formats_error(fmt, bound):
    g = torch.Generator().manual_seed(0)
    x = torch.randn(200, 1, 512, generator=g) * torch.rand(200, 1, 1, generator=g) * 4
    x[0] = 0  # an all-zero row keeps scale 0 and reads back exactly
    stored, scale = quantize_latent(x, fmt)
    back = dequantize_latent(stored, scale, 512, torch.float32)
    assert torch.equal(back[0], x[0])
    error = (back - x).abs()
    assert float(error.max()) > 0
    if fmt == "fp8":  # e4m3: 3 mantissa bits, relative to the value (the row scale keeps it normal)
        reference = x.abs().amax(-1, keepdim=True)
        assert bool((error <= bound * torch.maximum(x.abs(), reference * 2**-6)).all())
    else:  # e2m1 steps of up to 2 at the block's top of 6 (half a step: 1/6), the block scale e4m3-rounded
        block_max = x.unflatten(-1, (32, 16)).abs().amax(-1, keepdim=True)
        assert bool((error.unflatten(-1, (32, 16)) <= bound * block_max + 1e-7).all())


def _cache(lens: list[int], seed: int, num_blocks: int = 120):
    g = torch.Generator().manual_seed(seed)
    rows, max_blocks = len(lens), num_blocks // 4
    latent = torch.randn(num_blocks, BS, 1, LATENT, generator=g)
    rope = torch.randn(num_blocks, BS, 1, ROPE, generator=g)
    perm = torch.randperm(num_blocks, generator=g)
    tables = torch.stack([perm[r * max_blocks : (r + 1) * max_blocks] for r in range(rows)]).int()
    q_lat = torch.randn(rows, HEADS, LATENT, generator=g)
    q_rot = torch.randn(rows, HEADS, ROPE, generator=g)
    return q_lat, q_rot, latent, rope, tables, torch.tensor(lens, dtype=torch.int32)


@pytest.mark.parametrize("fmt", ["fp8", "fp4"])
def test_mla_kernel_reads_quantized_latents_as_the_dequantized_cache(fmt):
    """Dense rows (one split and merged splits), a padding row and DSA-selected rows: the kernel over codes + row
    scales gives the bits it gives over the cache dequantized by ``dequantize_latent``, and matches the torch
    reference; the quantized cache is what it reads (not the exact latents)."""
    q_lat, q_rot, latent, rope, tables, lens = _cache([0, 3, 29, 110], seed=1)
    stored, scale = quantize_latent(latent, fmt)
    assert stored.dtype == (KV_FP8 if fmt == "fp8" else torch.uint8)
    readable = dequantize_latent(stored, scale, LATENT, torch.float32)
    g = torch.Generator().manual_seed(2)
    indices = torch.zeros(4, 16, dtype=torch.int32)
    indices[3] = torch.randperm(110, generator=g)[:16].sort().values.int()
    sparse = torch.tensor([0, 0, 0, 1], dtype=torch.int32)
    picked = lens.clone()
    picked[3] = 16
    for args in ((lens,), (picked, indices, sparse)):
        tables_lens = (tables, *args[:1])
        extra = args[1:] or (None, None)
        out = mla_attention_triton(q_lat, q_rot, stored, rope, *tables_lens, 0.2, *extra, latent_scale=scale)
        plain = mla_attention_triton(q_lat, q_rot, readable, rope, *tables_lens, 0.2, *extra)
        assert torch.equal(out, plain)
        ref = mla_attention_ref(q_lat, q_rot, stored, rope, *tables_lens, 0.2, *extra, latent_scale=scale)
        torch.testing.assert_close(out, ref, rtol=1e-4, atol=1e-5)
        exact = mla_attention_ref(q_lat, q_rot, latent, rope, *tables_lens, 0.2, *extra)
        assert not torch.allclose(out[1:], exact[1:], rtol=1e-4, atol=1e-5)


def test_index_scores_read_e4m3_keys_with_their_row_scales():
    g = torch.Generator().manual_seed(3)
    keys = torch.randn(40, BS, 1, 32, generator=g)
    codes, scale = quantize_rows(keys)
    q = torch.randn(3, 4, 32, generator=g)
    weights = torch.rand(3, 4, generator=g)
    tables = torch.randperm(40, generator=g)[:30].view(3, 10).int()
    lens = torch.tensor([0, 17, 40], dtype=torch.int32)
    out = index_scores_triton(q, weights, codes, tables, lens, 0.125, scale)
    readable = (codes.float() * scale).float()
    assert torch.equal(out, index_scores_triton(q, weights, readable, tables, lens, 0.125))
    torch.testing.assert_close(out, index_scores_ref(q, weights, codes, tables, lens, 0.125, scale))
    exact = index_scores_ref(q, weights, keys, tables, lens, 0.125)
    assert not torch.equal(out[1:], exact[1:])


@pytest.mark.parametrize("fmt", ["fp8", "fp4"])
def test_triton_write_stores_quantized_rows_and_row_scales_as_the_torch_write(fmt):
    """The CUDA path's cache write (``kernels.write_kv``) of codes / packed bytes beside the rope rows, and of the
    row scales beside their empty second tensor, lands the same bytes as the CPU path's write (slot -1 writes
    nothing)."""
    from dgpp.kernels.kv_write import write_kv_triton
    from dgpp.nn.attention import write_kv

    g = torch.Generator().manual_seed(4)
    stored, scale = quantize_latent(torch.randn(5, 1, LATENT, generator=g), fmt)
    rope = torch.randn(5, 1, ROPE, generator=g)
    slots = torch.tensor([3, -1, 0, 17, 9])
    results = []
    for write in (write_kv_triton, write_kv):
        latent_pool = torch.zeros(6, BS, 1, stored.shape[-1], dtype=stored.dtype)
        rope_pool = torch.zeros(6, BS, 1, ROPE)
        scale_pool, empty = torch.zeros(6, BS, 1, 1), torch.zeros(6, BS, 1, 0)
        write(latent_pool, rope_pool, stored, rope, slots)
        write(scale_pool, empty, scale, scale[..., :0], slots)
        results.append((latent_pool.view(torch.uint8), rope_pool, scale_pool))
    for ours, ref in zip(*results, strict=True):
        assert torch.equal(ours, ref)
    assert torch.equal(results[0][2].view(-1)[[3, 0, 17, 9]], scale.view(-1)[[0, 2, 3, 4]])
