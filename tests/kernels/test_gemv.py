"""Decode-size linear kernels (interpreter) against F.linear."""

from __future__ import annotations

import torch
import torch.nn.functional as F

from dgpp.kernels.gemv import gate_up_silu_ref, gate_up_silu_triton, multi_linear_triton


def test_multi_linear_matches_separate_projections() -> None:
    g = torch.Generator().manual_seed(0)
    x = torch.randn(3, 80, generator=g)  # K not a multiple of the K tile
    ws = [torch.randn(64, 80, generator=g), torch.randn(16, 80, generator=g), torch.randn(32, 80, generator=g)]
    outs = multi_linear_triton(x, ws)
    assert [tuple(o.shape) for o in outs] == [(3, 64), (3, 16), (3, 32)]
    for out, w in zip(outs, ws, strict=True):
        torch.testing.assert_close(out, F.linear(x, w), rtol=1e-5, atol=1e-5)
    # per-head views of a column slice work as the attention layer uses them
    assert outs[0].view(3, 4, 16).shape == (3, 4, 16)


def test_single_weight_and_sixteen_rows() -> None:
    g = torch.Generator().manual_seed(1)
    x, w = torch.randn(16, 48, generator=g), torch.randn(48, 48, generator=g)
    (out,) = multi_linear_triton(x, [w])
    torch.testing.assert_close(out, F.linear(x, w), rtol=1e-5, atol=1e-5)


def test_gate_up_silu_matches_reference() -> None:
    g = torch.Generator().manual_seed(2)
    x = torch.randn(2, 64, generator=g)
    wg, wu = torch.randn(48, 64, generator=g), torch.randn(48, 64, generator=g)
    out = gate_up_silu_triton(x, wg, wu)
    torch.testing.assert_close(out, gate_up_silu_ref(x, wg, wu), rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(out, F.silu(F.linear(x, wg)) * F.linear(x, wu), rtol=1e-5, atol=1e-5)
