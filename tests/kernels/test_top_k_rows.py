"""The per-row radix top-k (Triton interpreter) gives ``select_top_k``'s picks exactly: heavy exact ties (to the
lower position), negative scores, -0.0 tying with 0.0 at the cut, rows shorter than ``k`` (all of them, then the
lowest padding positions), empty rows, rows longer than one pass step, and whatever lies past a row's length."""

from __future__ import annotations

import pytest
import torch

from dgpp.kernels.dsa_index import select_top_k
from dgpp.kernels.top_k_rows import top_k_rows_triton


def _scores(width: int, seed: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    scores = torch.randn(7, width, generator=g)
    scores[1, :500] = torch.randint(0, 4, (500,), generator=g).float()  # a few values, many exact ties
    scores[2] = -scores[2].abs()  # every score negative
    scores[3] = torch.where(torch.rand(width, generator=g) < 0.5, -0.0, 0.0)  # only zeros of either sign
    scores[3, :7] = 1.0
    scores[4, 2000:] = 50.0  # past the row's length: never picked
    return scores


@pytest.mark.parametrize("k", [40, 1100])
def test_picks_equal_select_top_k(k: int) -> None:
    scores = _scores(3000, seed=k)
    lens = torch.tensor([2500, 500, 3000, 1200, 2000, 30, 0])
    got = top_k_rows_triton(scores, lens, k)
    want = select_top_k(scores, lens, k)
    assert torch.equal(got[1], want[1])
    for r in range(scores.shape[0]):
        assert torch.equal(got[0][r], want[0][r]), r


def test_a_row_picks_its_best_not_the_first() -> None:
    """Fails if the select degenerates to the first k positions: the best scores sit at the row's end."""
    scores = torch.zeros(1, 2048)
    scores[0, 1500:1510] = torch.arange(10, 0, -1).float()
    positions, count = top_k_rows_triton(scores, torch.tensor([2048]), 10)
    assert positions[0].tolist() == list(range(1500, 1510)) and int(count[0]) == 10
