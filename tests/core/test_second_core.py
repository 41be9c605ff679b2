"""``dgpp.nn.second_core``: two halves of a product on two threads, and a failure on the helper thread raised
on the caller's without leaving its result queue out of step."""

from __future__ import annotations

import pytest
import torch

from dgpp.nn.second_core import on_two_cores


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
