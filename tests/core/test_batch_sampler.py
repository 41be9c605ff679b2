"""The scheduler's batch sampler (one device draw per step) against the reference sampler (``ChoiceSampler``):
greedy bit-exact, every parameter's distribution with fixed seeds, seeded reproducibility however a choice is
batched, independent choices, and tiny temperatures."""

from __future__ import annotations

import pytest
import torch

from dgpp.kernels.sampling import sample_tokens_triton
from dgpp.sample import ChoiceSampler, SamplingParams, filtered_distribution
from dgpp.sample import draw as draw_mod
from dgpp.sample.batch import sample_batch
from dgpp.sample.draw import _plain_race

VOCAB = 64
DRAWS = 3000  # rows per distribution check: one choice per seed, all in one batch


def _logits(seed: int, rows: int = 1, vocab: int = VOCAB, scale: float = 2.0) -> torch.Tensor:
    return torch.randn(rows, vocab, generator=torch.Generator().manual_seed(seed)) * scale


def _reference_probs(choice: ChoiceSampler, row: torch.Tensor) -> torch.Tensor:
    ids, probs = filtered_distribution(choice.processed_logits(row), choice.params)
    out = torch.zeros(row.shape[0], dtype=torch.float64)
    out[ids] = (probs / probs.sum()).double()
    return out


CASES = [
    SamplingParams(temperature=0.7),
    SamplingParams(temperature=1.3, top_k=9),
    SamplingParams(temperature=1.0, min_p=0.05),
    SamplingParams(temperature=0.9, top_p=0.8),
    SamplingParams(temperature=0.8, top_k=50, top_p=0.95),
    SamplingParams(
        temperature=1.1,
        top_k=20,
        min_p=0.02,
        top_p=0.9,
        repetition_penalty=1.3,
        presence_penalty=0.5,
        frequency_penalty=0.25,
        logit_bias={3: 2.0, 7: -1.5},
    ),
]


@pytest.mark.parametrize("candidate_max", [1024, 4])  # 4: top-k rows take the fully sorted route
@pytest.mark.parametrize("params", CASES)
def test_draws_follow_the_reference_distribution(
    params: SamplingParams, candidate_max: int, monkeypatch
) -> None:
    monkeypatch.setattr(draw_mod, "CANDIDATE_MAX", candidate_max)
    row = _logits(1)[0]
    prompt, generated = [1, 2, 3, 5], [5, 5, 8]
    choices = []
    for seed in range(DRAWS):
        c = ChoiceSampler(SamplingParams(**{**params.__dict__, "seed": seed}), VOCAB, prompt)
        for t in generated:
            c.accept(t)
        choices.append(c)
    results = sample_batch(row.repeat(DRAWS, 1), choices)
    counts = torch.bincount(torch.tensor([r.token for r in results]), minlength=VOCAB).double() / DRAWS
    want = _reference_probs(choices[0], row)
    assert float((counts - want).abs().max()) < 0.03, (counts, want)
    assert bool((counts[want == 0] == 0).all()), "a filtered token was drawn"


def test_greedy_rows_are_the_reference_argmax_bit_exact() -> None:
    logits = _logits(2, rows=6)
    logits[1, 7] = logits[1, 40] = 50.0  # a tie goes to the lowest id
    kinds = [
        SamplingParams(temperature=0.0),
        SamplingParams(temperature=0.9, top_k=1),
        SamplingParams(temperature=0.8, seed=3),
        SamplingParams(temperature=0.0, repetition_penalty=1.5),
        SamplingParams(temperature=0.0, logit_bias={9: 30.0}),
        SamplingParams(temperature=1e-40, min_p=0.1),
    ]
    choices = [ChoiceSampler(p, VOCAB, [2, 7, 9]) for p in kinds]
    got = sample_batch(logits, choices)
    for i in (0, 1, 3, 4, 5):
        ref = ChoiceSampler(kinds[i], VOCAB, [2, 7, 9]).sample(logits[i])
        assert got[i].token == ref.token, i
    assert got[1].token == 7


def test_logprobs_rows_report_what_the_reference_reports() -> None:
    logits = _logits(3, rows=2)
    kinds = [
        SamplingParams(temperature=0.0, logprobs=True, top_logprobs=3),
        SamplingParams(temperature=0.9, top_k=5, seed=4, logprobs=True, top_logprobs=2),
    ]
    got = sample_batch(logits, [ChoiceSampler(p, VOCAB, []) for p in kinds])
    ref = ChoiceSampler(kinds[0], VOCAB, []).sample(logits[0])
    assert (got[0].token, got[0].logprob, got[0].top_logprobs) == (ref.token, ref.logprob, ref.top_logprobs)
    probs = _reference_probs(ChoiceSampler(kinds[1], VOCAB, []), logits[1])
    assert got[1].logprob == pytest.approx(float(torch.log(probs[got[1].token])), abs=1e-5)
    assert len(got[1].top_logprobs) == 2


def test_seeded_choice_draws_the_same_alone_or_batched() -> None:
    logits = _logits(4, rows=5)
    params = SamplingParams(temperature=1.0, top_p=0.9, seed=42)
    others = [
        SamplingParams(temperature=0.0),
        SamplingParams(temperature=0.7, top_k=3, seed=1),
        SamplingParams(temperature=1.2, min_p=0.1),
    ]
    solo = ChoiceSampler(params, VOCAB, [])
    batched = ChoiceSampler(params, VOCAB, [])
    for step in range(4):
        alone = sample_batch(logits[step : step + 1], [solo])[0].token
        mates = [ChoiceSampler(p, VOCAB, []) for p in others]
        rows = torch.cat([logits[4:5], logits[step : step + 1], logits[:2]])
        together = sample_batch(rows, [mates[0], batched, mates[1], mates[2]])
        assert together[1].token == alone, step


def test_choices_of_one_seed_are_independent_of_neighbouring_seeds() -> None:
    """Choice i of seed s is not choice 0 of seed s + i (their streams and draws differ)."""
    logits = torch.zeros(1, 4096)  # uniform: every draw is decided by the seed alone
    for s, i in [(42, 1), (42, 3), (7, 2)]:
        a = ChoiceSampler(SamplingParams(temperature=1.0, seed=s), 4096, [], choice_index=i)
        b = ChoiceSampler(SamplingParams(temperature=1.0, seed=s + i), 4096, [], choice_index=0)
        assert a.generator.initial_seed() != b.generator.initial_seed()
        ta = [sample_batch(logits, [a])[0].token for _ in range(6)]
        tb = [sample_batch(logits, [b])[0].token for _ in range(6)]
        assert ta != tb
        again = ChoiceSampler(SamplingParams(temperature=1.0, seed=s), 4096, [], choice_index=i)
        assert [sample_batch(logits, [again])[0].token for _ in range(6)] == ta  # reproducible


@pytest.mark.parametrize("temperature", [1e-40, 1e-30, 1e-12])
def test_tiny_temperatures_with_filters_are_greedy_where_that_is_the_limit(temperature: float) -> None:
    logits = _logits(5, rows=4) * 10
    logits[3, 11] = logits[3, 30] = 80.0  # tied best: only those two may come out
    for kw in ({"min_p": 0.1}, {"top_k": 5}, {"top_k": 5, "min_p": 0.2, "top_p": 0.5}, {}):
        params = [SamplingParams(temperature=temperature, seed=s, **kw) for s in range(4)]
        ref = [ChoiceSampler(p, VOCAB, []).sample(logits[i]).token for i, p in enumerate(params)]
        got = [r.token for r in sample_batch(logits, [ChoiceSampler(p, VOCAB, []) for p in params])]
        argmax = torch.argmax(logits, -1).tolist()
        assert got[:3] == argmax[:3] and ref[:3] == argmax[:3]
        assert got[3] in (11, 30) and ref[3] in (11, 30)


def test_a_fully_masked_row_fails_alone() -> None:
    nothing = torch.zeros(VOCAB, dtype=torch.bool)
    masked = ChoiceSampler(SamplingParams(temperature=0.8, seed=1), VOCAB, [], mask_fn=lambda v: nothing)
    fine = ChoiceSampler(SamplingParams(temperature=0.0), VOCAB, [])
    out = sample_batch(_logits(6, rows=2), [masked, fine])
    assert isinstance(out[0], ValueError) and out[1].token == int(torch.argmax(_logits(6, rows=2)[1]))


def test_plain_rows_draw_the_same_in_the_kernel_and_in_torch() -> None:
    """The Triton kernel (CUDA's route for temperature / min-p rows) and the torch race pick the same tokens."""
    z = _logits(7, rows=6, vocab=300)
    z = z - z.amax(-1, keepdim=True)
    temp = torch.tensor([1.0, 0.5, 2.0, 1e-30, 0.8, 1.0])
    min_p = torch.tensor([0.0, 0.0, 0.1, 0.0, 0.3, 0.0])
    seeds = torch.tensor([1, 2, 3, 4, 5, 2**62 + 9])
    kernel = sample_tokens_triton(z, temp, torch.zeros(6, dtype=torch.int32), min_p, torch.ones(6), seeds)
    assert kernel.tolist() == _plain_race(z, temp, min_p, seeds).tolist()
