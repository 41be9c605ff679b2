"""Conv decode-step kernel (interpreter) vs its torch reference and vs the varlen conv layer path."""

from __future__ import annotations

import pytest
import torch

from dgpp.kernels.causal_conv1d import conv_decode_ref, conv_decode_triton
from dgpp.nn.causal_conv1d import causal_conv1d_varlen

C, K = 40, 4  # 40 channels: not a power of two, so the channel mask matters


@pytest.mark.parametrize("with_bias, silu", [(False, True), (True, False)])
def test_decode_kernel_matches_reference_and_shifts_state(with_bias, silu):
    gen = torch.Generator().manual_seed(0)
    x = torch.randn(4, C, generator=gen)
    weight = torch.randn(C, K, generator=gen)
    bias = torch.randn(C, generator=gen) if with_bias else None
    pool = torch.randn(6, K - 1, C, generator=gen)
    slots = torch.tensor([3, -1, 0, 5])  # row 1 is CUDA-graph padding
    fresh = torch.tensor([False, False, True, False])
    before = pool.clone()
    pool_ref = pool.clone()
    ref = conv_decode_ref(x, weight, bias, pool_ref, slots, fresh, silu)
    out = conv_decode_triton(x, weight, bias, pool, slots, fresh, silu)
    torch.testing.assert_close(out, ref, rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(pool, pool_ref, rtol=0, atol=0)
    assert out[1].abs().max() == 0  # the padding row outputs zeros and writes no slot
    assert torch.equal(pool[[1, 2, 4]], before[[1, 2, 4]])
    # the history shifts by one input; a fresh sequence's history was zeros
    assert torch.equal(pool[3], torch.cat([before[3][1:], x[0:1]]))
    assert torch.equal(pool[0], torch.cat([torch.zeros(K - 2, C), x[2:3]]))


def test_decode_reference_equals_varlen_path():
    gen = torch.Generator().manual_seed(1)
    x = torch.randn(3, C, generator=gen)
    weight = torch.randn(C, K, generator=gen)
    pool = torch.randn(4, K - 1, C, generator=gen)
    slots = torch.tensor([2, 0, 3])
    pool_varlen = pool.clone()
    ref = conv_decode_ref(x, weight, None, pool, slots, torch.tensor([False, True, False]))
    varlen = causal_conv1d_varlen(x, weight, None, pool_varlen, slots, [1, 1, 1], [5, 0, 9])
    torch.testing.assert_close(ref, varlen, rtol=1e-6, atol=1e-6)
    torch.testing.assert_close(pool, pool_varlen, rtol=0, atol=0)


def test_decode_kernel_reads_rows_of_a_wider_projection():
    # x as the [q|k|v] part of a [q|k|v|z] projection: rows strided wider than the channels, the output dense
    gen = torch.Generator().manual_seed(2)
    wide = torch.randn(3, C + 24, generator=gen)
    x = wide[:, :C]
    weight = torch.randn(C, K, generator=gen)
    pool = torch.randn(3, K - 1, C, generator=gen)
    pool_ref = pool.clone()
    slots, fresh = torch.tensor([2, 0, 1]), torch.tensor([0, 0, 1], dtype=torch.int8)
    ref = conv_decode_ref(x.contiguous(), weight, None, pool_ref, slots, fresh, True)
    out = conv_decode_triton(x, weight, None, pool, slots, fresh, True)
    assert out.is_contiguous() and out.shape == (3, C)
    torch.testing.assert_close(out, ref, rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(pool, pool_ref, rtol=0, atol=0)
