"""Device sampling: Triton (interpreter) draws the same tokens as the torch reference from the same seeds."""

from __future__ import annotations

import torch

from dgpp.kernels.sampling import sample_tokens_ref, sample_tokens_triton, uniform_ref


def _params(rows: int, temp: float, k: int, min_p: float, p: float):
    return (
        torch.full((rows,), temp),
        torch.full((rows,), k, dtype=torch.int32),
        torch.full((rows,), min_p),
        torch.full((rows,), p),
    )


def test_greedy_is_argmax_with_lowest_id_on_ties() -> None:
    logits = torch.randn(3, 300, generator=torch.Generator().manual_seed(0))
    logits[1, 7] = logits[1, 250] = 100.0
    seeds = torch.arange(3)
    out = sample_tokens_triton(logits, *_params(3, 0.0, 0, 0.0, 1.0), seeds)
    assert out.tolist() == torch.argmax(logits, -1).tolist()
    assert out[1] == 7


def test_same_draws_as_reference_for_each_filter() -> None:
    g = torch.Generator().manual_seed(1)
    logits = torch.randn(4, 500, generator=g) * 3
    for temp, k, min_p, p in [
        (1.0, 0, 0.0, 1.0),
        (0.7, 20, 0.0, 1.0),
        (1.3, 0, 0.0, 0.8),
        (0.9, 50, 0.05, 0.9),
    ]:
        for step in range(2):
            seeds = torch.tensor([11, 12, 13, 14]) * 1000 + step
            params = _params(4, temp, k, min_p, p)
            tri = sample_tokens_triton(logits, *params, seeds)
            assert tri.tolist() == sample_tokens_ref(logits, *params, seeds).tolist(), (temp, k, min_p, p)


def test_filters_restrict_the_support() -> None:
    rows = 16  # one launch, a different seed per row
    logits = torch.linspace(0, 5, 64).repeat(rows, 1)
    seeds = torch.arange(rows) * 104729
    seen_k = set(sample_tokens_triton(logits, *_params(rows, 1.0, 3, 0.0, 1.0), seeds).tolist())
    seen_p = set(sample_tokens_triton(logits, *_params(rows, 5.0, 0, 0.0, 0.05), seeds).tolist())
    assert seen_k <= {61, 62, 63} and len(seen_k) > 1
    probs = torch.softmax(logits[0] / 5.0, 0).flip(0).cumsum(0)
    need = int((probs < 0.05).sum()) + 1  # smallest top set reaching 5% of the mass
    assert seen_p <= set(range(64 - need, 64)) and len(seen_p) > 1


def test_mixed_batch_and_frequencies() -> None:
    # a row sampled many times with different seeds follows softmax(z) (exponential race)
    n = 240
    logits = torch.tensor([[0.0, 1.0, 2.0, 3.0]]).repeat(n, 1)
    temps = torch.ones(n)
    temps[0] = 0.0  # one greedy row in a sampled batch
    out = sample_tokens_triton(
        logits,
        temps,
        torch.zeros(n, dtype=torch.int32),
        torch.zeros(n),
        torch.ones(n),
        torch.arange(n) * 7919,
    )
    assert out[0] == 3
    freq = torch.bincount(out[1:], minlength=4).float() / (n - 1)
    torch.testing.assert_close(freq, torch.softmax(logits[0], 0), atol=0.06, rtol=0)


def test_uniforms_are_in_open_interval_and_vary_with_seed() -> None:
    u = uniform_ref(torch.tensor([0, 1, 2**40 + 5]), 1000)
    assert float(u.min()) > 0 and float(u.max()) < 1
    assert not torch.equal(u[0], u[1]) and abs(float(u.mean()) - 0.5) < 0.02
