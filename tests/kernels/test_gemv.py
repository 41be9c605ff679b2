"""Decode-size linear kernels (interpreter) against F.linear."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from dgpp.kernels.gemv import gate_up_silu_ref, gate_up_silu_triton, multi_linear_triton
from dgpp.policy import ExecPolicy, install, with_environment


def test_multi_linear_matches_separate_projections() -> None:
    g = torch.Generator().manual_seed(0)
    x = torch.randn(3, 80, generator=g)  # K not a multiple of the K tile
    ws = [
        torch.randn(64, 80, generator=g),
        torch.randn(16, 80, generator=g),
        torch.randn(32, 80, generator=g),
    ]
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


def test_rows_up_to_sixty_four_pick_wider_row_tiles() -> None:
    from dgpp.kernels.gemv import MAX_ROWS, row_block

    assert [row_block(m) for m in (1, 16, 17, 32, 33, 64)] == [16, 16, 32, 32, 64, 64]
    assert MAX_ROWS == 64
    with pytest.raises(ValueError, match="1..64 rows"):
        row_block(65)
    g = torch.Generator().manual_seed(4)
    for m in (17, 40, 64):
        x = torch.randn(m, 80, generator=g)
        ws = [torch.randn(32, 80, generator=g), torch.randn(16, 80, generator=g)]
        for out, w in zip(multi_linear_triton(x, ws), ws, strict=True):
            torch.testing.assert_close(out, F.linear(x, w), rtol=1e-5, atol=1e-5)
        wg, wu = torch.randn(32, 80, generator=g), torch.randn(32, 80, generator=g)
        torch.testing.assert_close(
            gate_up_silu_triton(x, wg, wu), gate_up_silu_ref(x, wg, wu), rtol=1e-4, atol=1e-4
        )


@pytest.mark.parametrize(("lo", "hi"), [(1, 16), (17, 32), (33, 64)])
def test_a_row_does_not_depend_on_the_row_count_within_a_row_tile(lo: int, hi: int) -> None:
    """MTP verify and batching rely on it: within one BM class a row's output is bit-identical whatever
    the number of rows sharing the launch."""
    g = torch.Generator().manual_seed(hi)
    x = torch.randn(hi, 96, generator=g)
    w = torch.randn(48, 96, generator=g)
    wg, wu = torch.randn(32, 96, generator=g), torch.randn(32, 96, generator=g)
    (full,) = multi_linear_triton(x, [w])
    full_mlp = gate_up_silu_triton(x, wg, wu)
    for m in sorted({lo, (lo + hi) // 2, hi - 1}):
        (part,) = multi_linear_triton(x[:m], [w])
        assert torch.equal(part, full[:m])
        assert torch.equal(gate_up_silu_triton(x[:m], wg, wu), full_mlp[:m])


def test_lm_head_gemv_is_opt_in_and_matches(monkeypatch) -> None:
    import dgpp.kernels.gemv as gemv

    g = torch.Generator().manual_seed(6)
    x, head = torch.randn(3, 64, generator=g), torch.randn(512, 64, generator=g)
    monkeypatch.setattr(gemv, "use_triton", lambda t: True)  # stand in for CUDA under the interpreter
    monkeypatch.delenv("DGPP_GEMV_HEAD", raising=False)
    install(with_environment(ExecPolicy()))
    assert gemv.lm_head_gemv(x, head) is None
    monkeypatch.setenv("DGPP_GEMV_HEAD", "1")
    install(with_environment(ExecPolicy()))  # the override is read once, when the policy is built
    torch.testing.assert_close(gemv.lm_head_gemv(x, head), F.linear(x, head), rtol=1e-5, atol=1e-5)
    # a vocab-parallel rank's contiguous slice of rows
    torch.testing.assert_close(
        gemv.lm_head_gemv(x, head.narrow(0, 256, 256)), F.linear(x, head[256:]), rtol=1e-5, atol=1e-5
    )
