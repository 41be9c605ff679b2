"""RMSNorm(+residual), rotary and SwiGLU: Triton (interpreter) against the torch references."""

from __future__ import annotations

import pytest
import torch

from dgpp.kernels.rmsnorm import rms_norm_ref, rms_norm_triton
from dgpp.kernels.rotary import rotary_ref, rotary_triton
from dgpp.kernels.swiglu import silu_and_mul_ref, silu_and_mul_triton


def _cos_sin(max_pos: int, rot: int, base: float = 10000.0) -> torch.Tensor:
    inv = 1.0 / base ** (torch.arange(0, rot, 2, dtype=torch.float32) / rot)
    freqs = torch.outer(torch.arange(max_pos, dtype=torch.float32), inv)
    return torch.cat([freqs.cos(), freqs.sin()], dim=-1)


@pytest.mark.parametrize("offset", [0.0, 1.0])
@pytest.mark.parametrize("hidden", [64, 80])
def test_rms_norm_matches_reference(hidden: int, offset: float) -> None:
    g = torch.Generator().manual_seed(hidden)
    x = torch.randn(5, hidden, generator=g)
    w = torch.randn(hidden, generator=g)
    torch.testing.assert_close(rms_norm_triton(x, w, 1e-6, None, offset), rms_norm_ref(x, w, 1e-6, None, offset))


def test_fused_add_rms_norm_returns_sum_and_norm() -> None:
    g = torch.Generator().manual_seed(1)
    x, r = torch.randn(2, 3, 64, generator=g), torch.randn(2, 3, 64, generator=g)
    w = torch.randn(64, generator=g)
    out, res = rms_norm_triton(x, w, 1e-5, r)
    ref_out, ref_res = rms_norm_ref(x, w, 1e-5, r)
    torch.testing.assert_close(res, x + r)
    torch.testing.assert_close(res, ref_res)
    torch.testing.assert_close(out, ref_out)
    assert out.shape == x.shape


def test_rms_norm_on_strided_rows() -> None:
    # per-head q/k norm runs on a [T, H, D] view of a wider projection output
    g = torch.Generator().manual_seed(2)
    wide = torch.randn(4, 3 * 32, generator=g)
    heads = wide[:, :64].view(4, 2, 32)
    w = torch.randn(32, generator=g)
    torch.testing.assert_close(rms_norm_triton(heads, w, 1e-6), rms_norm_ref(heads, w, 1e-6))


@pytest.mark.parametrize(("rot", "neox"), [(32, True), (32, False), (16, True), (16, False)])
def test_rotary_matches_reference(rot: int, neox: bool) -> None:
    g = torch.Generator().manual_seed(rot + neox)
    q, k = torch.randn(6, 4, 32, generator=g), torch.randn(6, 2, 32, generator=g)
    pos = torch.tensor([0, 5, 17, 3, 63, 1])
    cs = _cos_sin(64, rot)
    q_ref, k_ref = rotary_ref(q, k, pos, cs, rot, neox)
    q_tri, k_tri = rotary_triton(q, k, pos, cs, rot, neox)
    torch.testing.assert_close(q_tri, q_ref)
    torch.testing.assert_close(k_tri, k_ref)
    if rot < 32:  # channels past rotary_dim pass through untouched
        torch.testing.assert_close(q_tri[..., rot:], q[..., rot:])


def test_rotary_reference_matches_hf_rotate_half() -> None:
    # independent check of the reference itself: HF's q*cos + rotate_half(q)*sin
    g = torch.Generator().manual_seed(9)
    q, k = torch.randn(3, 2, 16, generator=g), torch.randn(3, 1, 16, generator=g)
    pos = torch.tensor([1, 4, 9])
    cs = _cos_sin(16, 16)
    cos = torch.cat([cs[pos, :8]] * 2, -1)[:, None]
    sin = torch.cat([cs[pos, 8:]] * 2, -1)[:, None]

    def rotate_half(x: torch.Tensor) -> torch.Tensor:
        return torch.cat([-x[..., 8:], x[..., :8]], -1)

    q_ref, _ = rotary_ref(q, k, pos, cs, 16, True)
    torch.testing.assert_close(q_ref, q * cos + rotate_half(q) * sin)


def test_silu_and_mul_matches_reference() -> None:
    g = torch.Generator().manual_seed(3)
    x = torch.randn(3, 2, 2 * 1100, generator=g)  # two column blocks, ragged tail
    out = silu_and_mul_triton(x)
    assert out.shape == (3, 2, 1100)
    torch.testing.assert_close(out, silu_and_mul_ref(x))
    gate, up = x[..., :1100], x[..., 1100:]
    torch.testing.assert_close(out, torch.nn.functional.silu(gate) * up)
