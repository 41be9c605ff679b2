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
