"""The trailing interleaved RoPE kernel (``dgpp.kernels.trailing_rotary``, Triton's interpreter) against
``TrailingRotary``'s torch chain: plain and YaRN frequencies, angles rounded or kept in fp32, the inverse turn,
head counts off the head tile, a copied ``nope`` part longer than one copy step, strided rows."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from dgpp.kernels.trailing_rotary import trailing_rotary
from dgpp.nn import rotary
from dgpp.nn.rotary import RopeScaling, YarnScaling, rotary_embedding

YARN = RopeScaling(
    theta=160000.0,
    rope_type="yarn",
    yarn=YarnScaling(factor=16.0, original_max_position=4096, attention_factor=1.2),
)


@pytest.mark.parametrize(
    ("rope", "fp32_angles", "inverse", "heads", "dim", "rot"),
    [
        (RopeScaling(theta=10000.0), False, False, 5, 40, 16),
        (YARN, False, True, 20, 200, 8),  # 192 nope channels: two copy steps; 20 heads: two head tiles
        (YARN, True, False, 1, 64, 64),  # no nope part
        (RopeScaling(theta=10000.0), True, True, 3, 72, 64),  # 32 pairs, 8 copied channels
    ],
)
def test_trailing_rotary_matches_the_torch_chain(
    rope, fp32_angles, inverse, heads, dim, rot, monkeypatch
) -> None:
    gen = torch.Generator().manual_seed(heads + dim)
    turn = rotary_embedding(rope, dim, rot, style="interleaved", trailing=True, fp32_angles=fp32_angles)
    rows = 6
    x = torch.randn(rows, heads, dim, generator=gen)
    positions = torch.tensor([0, 1, 7, 130, 4095, 70000], dtype=torch.int32)
    got = trailing_rotary(
        x, positions, turn.inv_freq, turn.magnitude, fp32_angles=fp32_angles, inverse=inverse
    )
    want = turn.rotate(x, positions, inverse=inverse)  # CPU tensors: the torch chain
    nope = dim - rot
    assert torch.equal(got[..., :nope], x[..., :nope])
    # numpy's cos / sin (the interpreter's) and torch's are an ulp apart at most, far below a wrong pair or sign
    torch.testing.assert_close(got, want, rtol=2e-6, atol=2e-6)
    # with the chain's cos / sin taken from numpy too, every other op rounds alike: bit for bit
    monkeypatch.setattr(torch.Tensor, "cos", lambda t: torch.from_numpy(np.cos(t.numpy())))
    monkeypatch.setattr(torch.Tensor, "sin", lambda t: torch.from_numpy(np.sin(t.numpy())))
    assert torch.equal(got, turn.rotate(x, positions, inverse=inverse))
    assert (got[1:, :, nope:] - x[1:, :, nope:]).abs().max() > 0.1  # rows past position 0 did turn
    back = trailing_rotary(
        got, positions, turn.inv_freq, turn.magnitude, fp32_angles=True, inverse=not inverse
    )
    if fp32_angles and turn.magnitude == 1.0:
        torch.testing.assert_close(back, x, rtol=1e-5, atol=1e-5)


def test_strided_rows_and_the_layer_dispatch(monkeypatch) -> None:
    """A ``[T, 1, D]`` view of wider rows (the latent K/V as the attention turns it), through ``rotate``'s CUDA
    branch: the kernel's result, the same as the torch chain's."""
    gen = torch.Generator().manual_seed(3)
    turn = rotary_embedding(YARN, 48, 16, style="interleaved", trailing=True)
    wide = torch.randn(4, 80, generator=gen)
    x = wide[:, 8:56][:, None, :]
    positions = torch.tensor([3, 9, 27, 81])
    want = turn.rotate(x, positions)
    monkeypatch.setattr(rotary, "use_triton", lambda t: True)
    got = turn.rotate(x, positions)
    assert got.shape == (4, 1, 48) and got.is_contiguous()
    assert torch.equal(got, trailing_rotary(x, positions, turn.inv_freq, turn.magnitude, fp32_angles=False))
    torch.testing.assert_close(got, want, rtol=2e-6, atol=2e-6)


@pytest.mark.parametrize(
    ("heads", "dim", "rot", "eps"), [(5, 40, 16, 1e-6), (20, 200, 8, 1e-6), (2, 12, 8, 0.5)]
)
def test_head_rms_in_the_same_launch(heads, dim, rot, eps) -> None:
    """``head_rms_eps``: each head scaled by its unweighted RMS before the turn (DeepSeek-V4's query), within fp32
    rounding of the torch chain (its sum of squares reduces in another order); rows of very different scales
    (one at 1e-3, where an eps of 1e-6 moves the factor) and 8 channels with an eps of 0.5."""
    gen = torch.Generator().manual_seed(heads * dim)
    turn = rotary_embedding(YARN, dim, rot, style="interleaved", trailing=True)
    scales = torch.tensor([1e-3, 1.0, 30.0, 0.2])[:, None, None]
    x = torch.randn(4, heads, dim, generator=gen) * scales
    positions = torch.tensor([0, 5, 130, 4095])
    got = trailing_rotary(x, positions, turn.inv_freq, turn.magnitude, fp32_angles=False, head_rms_eps=eps)
    want = turn.rotate(x, positions, head_rms_eps=eps)
    torch.testing.assert_close(got, want, rtol=2e-6, atol=2e-6)
    normed = x * torch.rsqrt(x.square().mean(-1, keepdim=True) + eps)
    torch.testing.assert_close(got[..., : dim - rot], normed[..., : dim - rot], rtol=2e-6, atol=2e-6)
    plain = trailing_rotary(x, positions, turn.inv_freq, turn.magnitude, fp32_angles=False)
    assert (got - plain).abs().max() > 0.1  # the scale is applied
    no_eps = x * torch.rsqrt(x.square().mean(-1, keepdim=True))
    assert (got[..., : dim - rot] - no_eps[..., : dim - rot]).abs().max() > 1e-3  # the eps is added


def test_head_rms_rounds_the_factor_and_the_product_to_bf16() -> None:
    """In bf16 the factor and the scaled head are each rounded to bf16 before the turn, as the torch chain
    rounds them (up to the order of the sum of squares: the factor at most one bf16 step apart, so the product
    at most two)."""
    gen = torch.Generator().manual_seed(11)
    turn = rotary_embedding(RopeScaling(theta=10000.0), 64, 16, style="interleaved", trailing=True)
    x = torch.randn(3, 4, 64, generator=gen).bfloat16()
    positions = torch.tensor([0, 9, 300])
    got = trailing_rotary(x, positions, turn.inv_freq, turn.magnitude, fp32_angles=False, head_rms_eps=1e-6)
    want = turn.rotate(x, positions, head_rms_eps=1e-6)
    assert got.dtype == torch.bfloat16
    nope_got, nope_want = got[..., :48].float(), want[..., :48].float()
    assert ((nope_got - nope_want).abs() <= 2**-6 * nope_want.abs()).all()
    assert (got.float() - want.float()).abs().max() <= 2**-6 * want.float().abs().max()
    exact = nope_got * torch.rsqrt(x.float().square().mean(-1, keepdim=True) + 1e-6)[..., :1].expand(
        -1, -1, 48
    )
    assert not torch.equal(nope_got, exact.bfloat16().float())  # the factor was rounded to bf16 first
