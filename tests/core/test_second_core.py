"""``dgpp.nn.second_core``: two halves of a product on two threads, a failure on the helper thread raised on the
caller's without leaving its result queue out of step, and a CPU decode row's LM head split over two cores with
the whole product's bits."""

from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor

import pytest
import torch

from dgpp.nn import second_core
from dgpp.nn.batch_invariant import batch_invariant_linear
from dgpp.nn.embedding import LMHead
from dgpp.nn.second_core import SPLIT_MIN_OUTPUTS, on_two_cores, usable_cores
from dgpp.testing.second_core import counted_splits


def test_the_halves_come_back_in_order():
    first, second = torch.arange(3.0)[None], torch.arange(3.0, 7.0)[None]
    assert torch.equal(on_two_cores(lambda: first, lambda: second), torch.arange(7.0)[None])


def test_a_failure_on_the_helper_is_raised_here_and_the_next_call_gets_its_own_result():
    def fails() -> torch.Tensor:
        raise ValueError("second half failed")

    with pytest.raises(ValueError, match="second half failed"):
        on_two_cores(lambda: torch.zeros(1, 1), fails)
    assert torch.equal(
        on_two_cores(lambda: torch.ones(1, 1), lambda: torch.full((1, 1), 2.0)), torch.tensor([[1.0, 2.0]])
    )


def test_callers_on_several_threads_each_get_their_own_halves():
    def calls(tag: float) -> bool:
        return all(
            torch.equal(
                on_two_cores(lambda: torch.full((1, 1), tag), lambda: torch.full((1, 1), -tag)),
                torch.tensor([[tag, -tag]]),
            )
            for _ in range(200)
        )

    with ThreadPoolExecutor(3) as pool:
        assert all(pool.map(calls, (1.0, 2.0, 3.0)))


@pytest.mark.skipif(usable_cores() < 2, reason="needs a second core")
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_the_cpu_head_runs_on_two_cores_with_the_whole_products_bits(dtype, monkeypatch):
    vocab, hidden = SPLIT_MIN_OUTPUTS + 100, 64  # halves cut at a multiple of 64: 8,192 and 8,292 outputs
    head = LMHead(vocab, hidden, dtype=dtype)
    with torch.no_grad():
        head.weight.copy_(torch.randn(vocab, hidden, generator=torch.Generator().manual_seed(1)))
    with counted_splits(monkeypatch, second_core) as splits:
        x = torch.randn(3, hidden, generator=torch.Generator().manual_seed(2)).to(dtype)
        with torch.inference_mode():
            for row in x.split(1):
                assert torch.equal(head(row), batch_invariant_linear(row, head.weight))
            assert len(splits) >= 3  # the decode rows split (besides the once-per-shape check)
            splits.clear()
            assert torch.equal(head(x), batch_invariant_linear(x, head.weight))  # several rows: split too
            assert splits
