"""The window compressor's decode step (Triton interpreter, fp32) against its torch form and against the
compressor's own pool of a window: overlapping (CSA) and not (HCA), rows that close a window and rows that do
not, the first window (no predecessor), a padding row; the ring is written for live rows only."""

from __future__ import annotations

import pytest
import torch

from dgpp.kernels.window_pool import window_pool_decode_ref, window_pool_decode_triton
from dgpp.nn.window_compressor import WindowPooler

DIM = 24


class _Bias(WindowPooler):
    def __init__(self, ratio: int, overlap: bool, ape: torch.Tensor) -> None:
        super().__init__(DIM, ratio, "c", overlap=overlap, dtype=torch.float32)
        self.ape = ape

    def position_bias(self) -> torch.Tensor:
        return self.ape


def _case(ratio: int, overlap: bool, positions: list[int], seed: int):
    g = torch.Generator().manual_seed(seed)
    width = 2 * DIM if overlap else DIM
    cap = 2 * ratio if overlap else ratio
    rows = len(positions)
    return dict(
        kv=torch.randn(rows, width, generator=g),
        gate=torch.randn(rows, width, generator=g),
        ring_kv=torch.randn(rows + 1, cap, width, generator=g),
        ring_gate=torch.randn(rows + 1, cap, width, generator=g),
        ape=torch.randn(ratio, width, generator=g),
        slots=torch.arange(rows),
        positions=torch.tensor(positions),
        seq_lens=torch.tensor(positions) + 1,
        ratio=ratio,
        overlap=overlap,
    )


@pytest.mark.parametrize(("ratio", "overlap"), [(4, True), (8, False), (32, False)])
def test_pool_and_ring_match_torch_form_and_the_compressor(ratio: int, overlap: bool) -> None:
    # window 0 closing, a later window closing, rows mid-window, a padding row (slot -1)
    positions = [ratio - 1, 5 * ratio - 1, ratio + 1, 3 * ratio - 1, 0]
    args = _case(ratio, overlap, positions, seed=ratio)
    args["slots"][3] = -1
    theirs = {k: v.clone() if isinstance(v, torch.Tensor) else v for k, v in args.items()}
    before = args["ring_kv"].clone(), args["ring_gate"].clone()
    out = window_pool_decode_triton(**args)
    ref = window_pool_decode_ref(**theirs)
    torch.testing.assert_close(out, ref, rtol=1e-5, atol=1e-6)
    assert torch.equal(args["ring_kv"], theirs["ring_kv"]) and torch.equal(
        args["ring_gate"], theirs["ring_gate"]
    )
    assert float(out[2].abs().max()) == 0.0 and float(out[3].abs().max()) == 0.0  # mid-window; padding
    # the padding row's slot is untouched; a live row's own position holds its projections
    assert torch.equal(args["ring_kv"][3], before[0][3]) and torch.equal(args["ring_gate"][3], before[1][3])
    cap = args["ring_kv"].shape[1]
    assert torch.equal(args["ring_kv"][1, positions[1] % cap], args["kv"][1])
    # the closing rows' pools are the compressor's own pool of that window from the same rows
    pooler = _Bias(ratio, overlap, args["ape"])
    for r in (0, 1):
        pos = positions[r]
        first = max(0, pos - cap + 1)
        rows = [before[0][r, p % cap] for p in range(first, pos)] + [args["kv"][r]]
        gates = [before[1][r, p % cap] for p in range(first, pos)] + [args["gate"][r]]
        pooled = pooler.pool(torch.stack(rows), torch.stack(gates), pos // ratio)
        torch.testing.assert_close(out[r], pooled, rtol=1e-5, atol=1e-6)


def test_first_overlapping_window_reads_no_predecessor() -> None:
    """Window 0 of an overlapping pool has no previous window: whatever its ring slots hold is not read."""
    args = _case(4, True, [3], seed=3)
    out = window_pool_decode_triton(
        **{k: v.clone() if isinstance(v, torch.Tensor) else v for k, v in args.items()}
    )
    args["ring_kv"][0, 4:] = 1e3  # the slots positions -4..-1 would map to
    args["ring_gate"][0, 4:] = 5.0
    assert torch.equal(window_pool_decode_triton(**args), out)
