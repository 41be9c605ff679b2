"""Sampler vs a float64 oracle written from the original engine's order of sampling steps, plus seeding and greedy rules."""

from __future__ import annotations

import json
import math

import pytest
import torch

from dgpp.sample import ChoiceSampler, SampleResult, SamplingDefaults, SamplingParams, filtered_distribution

VOCAB = 64


def sample_rows(logits: torch.Tensor, choices: list[ChoiceSampler]) -> list[SampleResult]:
    """One token per row, each from its own choice's sampler (what a step does for its rows)."""
    return [choice.sample(logits[i]) for i, choice in enumerate(choices)]


def oracle(
    logits: list[float],
    params: SamplingParams,
    prompt: list[int],
    generated: list[int],
    allowed: set[int] | None,
) -> dict[int, float]:
    """Reference distribution in float64, one step at a time, no torch."""
    x = [float(v) for v in logits]
    counts = {t: generated.count(t) for t in set(generated)}
    seen = set(prompt) | set(generated)
    for t in range(len(x)):
        if params.repetition_penalty != 1.0 and t in seen:
            x[t] = x[t] / params.repetition_penalty if x[t] > 0 else x[t] * params.repetition_penalty
        x[t] -= params.frequency_penalty * counts.get(t, 0)
        x[t] -= params.presence_penalty * (1 if counts.get(t, 0) else 0)
    for t, b in params.logit_bias.items():
        x[t] += b
    cands = [t for t in range(len(x)) if allowed is None or t in allowed]
    cands.sort(key=lambda t: (-x[t], t))
    if params.top_k:
        cands = cands[: params.top_k]
    z = [x[t] / params.temperature for t in cands]
    m = max(z)
    e = [math.exp(v - m) for v in z]
    s = sum(e)
    probs = [v / s for v in e]
    if params.min_p:
        keep = [i for i, p in enumerate(probs) if p >= params.min_p * probs[0]]
        cands, probs = [cands[i] for i in keep], [probs[i] for i in keep]
    if params.top_p < 1.0:
        s = sum(probs)
        acc, keep = 0.0, 0
        for p in probs:
            keep += 1
            acc += p / s
            if acc >= params.top_p:
                break
        cands, probs = cands[:keep], probs[:keep]
    s = sum(probs)
    return {t: p / s for t, p in zip(cands, probs, strict=True)}


CASES = [
    SamplingParams(temperature=0.7),
    SamplingParams(temperature=1.3, top_k=9),
    SamplingParams(temperature=1.0, min_p=0.05),
    SamplingParams(temperature=0.9, top_p=0.8),
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


@pytest.mark.parametrize("params", CASES)
def test_distribution_matches_float64_oracle(params: SamplingParams) -> None:
    gen = torch.Generator().manual_seed(1)
    logits = torch.randn(VOCAB, generator=gen) * 3
    prompt, generated = [1, 2, 3, 5], [5, 5, 9]
    allowed = set(range(0, VOCAB, 2)) | {5, 9}
    mask = torch.zeros(VOCAB, dtype=torch.bool)
    mask[list(allowed)] = True
    choice = ChoiceSampler(params, VOCAB, prompt, mask_fn=lambda v: mask)
    for t in generated:
        choice.accept(t)
    ids, probs = filtered_distribution(choice.processed_logits(logits), params)
    got = {int(i): float(p) for i, p in zip(ids, probs / probs.sum(), strict=True)}
    want = oracle(logits.tolist(), params, prompt, generated, allowed)
    assert list(got) == list(want), "surviving ids or their draw order differ from the oracle"
    for t in want:
        assert got[t] == pytest.approx(want[t], rel=1e-5, abs=1e-7)


def test_draws_follow_the_distribution() -> None:
    params = SamplingParams(temperature=1.0, top_k=4, seed=7)
    logits = torch.tensor([2.0, 1.0, 0.5, 0.0] + [-1.0] * 12)
    want = oracle(logits.tolist(), params, [], [], None)
    choice = ChoiceSampler(params, 16, [])
    n = 4000
    hits = torch.zeros(16)
    for _ in range(n):
        hits[choice.sample(logits).token] += 1
    for t, p in want.items():
        assert abs(hits[t] / n - p) < 4 * math.sqrt(p * (1 - p) / n)
    assert hits[4:].sum() == 0


def test_greedy_takes_lowest_id_on_ties_and_consumes_no_draw() -> None:
    logits = torch.tensor([0.0, 3.0, 1.0, 3.0])
    choice = ChoiceSampler(SamplingParams(temperature=0.0, seed=3), 4, [])
    before = choice.generator.get_state().clone()
    assert choice.sample(logits).token == 1
    assert torch.equal(before, choice.generator.get_state())


def test_seeded_choice_is_independent_of_batch_mates() -> None:
    gen = torch.Generator().manual_seed(2)
    steps = [torch.randn(3, VOCAB, generator=gen) for _ in range(12)]
    params = SamplingParams(temperature=1.0, seed=42)

    def run(rows: list[int]) -> list[int]:
        choices = [ChoiceSampler(params, VOCAB, [], choice_index=i) for i in range(3)]
        picked = []
        for logits in steps:
            results = sample_rows(logits[rows], [choices[r] for r in rows])
            picked.append(results[rows.index(1)].token)
        return picked

    assert run([1]) == run([0, 1, 2]) == run([2, 1])
    a = [ChoiceSampler(params, VOCAB, [], choice_index=i).sample(steps[0][0]).token for i in range(8)]
    assert len(set(a)) > 1, "choices of one seeded request should not all draw the same numbers"
    # the seed is mixed before the choice index is added: choice 3 of seed 42 is not choice 0 of seed 45
    shifted = SamplingParams(temperature=1.0, seed=45)
    assert (
        ChoiceSampler(params, VOCAB, [], choice_index=3).generator.initial_seed()
        != ChoiceSampler(shifted, VOCAB, [], choice_index=0).generator.initial_seed()
    )


def test_logit_bias_forces_and_forbids() -> None:
    logits = torch.zeros(VOCAB)
    forced = ChoiceSampler(SamplingParams(temperature=1.0, seed=1, logit_bias={17: 100.0}), VOCAB, [])
    assert all(forced.sample(logits).token == 17 for _ in range(20))
    logits[5] = 10.0
    forbid = ChoiceSampler(SamplingParams(temperature=0.0, logit_bias={5: -100.0}), VOCAB, [])
    assert forbid.sample(logits).token != 5


def test_logprobs_greedy_raw_and_sampled_renormalized() -> None:
    logits = torch.tensor([1.0, 2.0, 3.0, 0.5])
    g = ChoiceSampler(SamplingParams(temperature=0.0, logprobs=True, top_logprobs=2), 4, []).sample(logits)
    raw = torch.log_softmax(logits.double(), 0)
    assert g.token == 2 and g.logprob == pytest.approx(float(raw[2]), rel=1e-6)
    assert [t for t, _ in g.top_logprobs] == [2, 1]
    s = ChoiceSampler(
        SamplingParams(temperature=1.0, top_k=2, seed=0, logprobs=True, top_logprobs=3), 4, []
    ).sample(logits)
    p2 = math.exp(3) / (math.exp(3) + math.exp(2))
    assert s.token in (1, 2)
    assert dict(s.top_logprobs)[2] == pytest.approx(math.log(p2), rel=1e-5)
    assert s.top_logprobs[2][1] == -9999.0  # outside the top-k support


def test_defaults_from_generation_config(tmp_path) -> None:
    (tmp_path / "generation_config.json").write_text(
        json.dumps({"temperature": 0.6, "top_p": 0.95, "top_k": 20})
    )
    d = SamplingDefaults.from_generation_config(tmp_path)
    # serve/generation.py applies these to what a request omits (tests/core/test_generation_params.py)
    assert (d.temperature, d.top_p, d.top_k, d.min_p) == (0.6, 0.95, 20, 0.0)
    (tmp_path / "generation_config.json").write_text(json.dumps({"do_sample": False, "temperature": 0.7}))
    assert SamplingDefaults.from_generation_config(tmp_path).temperature == 0.0
    assert SamplingDefaults.from_generation_config(tmp_path / "none").temperature == 1.0


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_rows_on_the_gpu_follow_the_same_rules() -> None:
    """Logits that stay on the GPU: same surviving ids and probabilities, same greedy tie rule, seeded
    draws independent of batch mates."""
    gen = torch.Generator().manual_seed(5)
    logits = torch.randn(VOCAB, generator=gen) * 3
    params = CASES[-1]
    mask = torch.zeros(VOCAB, dtype=torch.bool)
    mask[::3] = True
    cpu = ChoiceSampler(params, VOCAB, [1, 2], mask_fn=lambda v: mask)
    gpu = ChoiceSampler(params, VOCAB, [1, 2], mask_fn=lambda v: mask)
    for t in (3, 3, 9):
        cpu.accept(t)
        gpu.accept(t)
    ids_c, probs_c = filtered_distribution(cpu.processed_logits(logits), params)
    ids_g, probs_g = filtered_distribution(gpu.processed_logits(logits.cuda()), params)
    assert ids_g.is_cuda and ids_c.tolist() == ids_g.cpu().tolist()
    assert torch.allclose(probs_c, probs_g.cpu(), rtol=1e-5, atol=1e-7)
    ties = torch.tensor([0.0, 3.0, 1.0, 3.0], device="cuda")
    assert ChoiceSampler(SamplingParams(temperature=0.0), 4, []).sample(ties).token == 1
    rows = torch.randn(10, 3, VOCAB, generator=gen).cuda()
    seeded = SamplingParams(temperature=0.8, seed=9, logprobs=True, top_logprobs=2)

    def run(batch: list[int]) -> list[int]:
        choices = [ChoiceSampler(seeded, VOCAB, [], choice_index=i) for i in range(3)]
        return [sample_rows(step[batch], [choices[r] for r in batch])[batch.index(1)].token for step in rows]

    assert run([1]) == run([0, 1, 2])


@pytest.mark.parametrize("temperature", [0.0, 1.0])
def test_a_fully_masked_row_fails_greedy_and_sampled_alike(temperature) -> None:
    # greedy used to emit id 0 (argmax of an all -inf row) where sampling raised
    nothing = torch.zeros(8, dtype=torch.bool)
    choice = ChoiceSampler(SamplingParams(temperature=temperature, seed=1), 8, [], mask_fn=lambda v: nothing)
    with pytest.raises(ValueError, match="every token is masked"):
        choice.sample(torch.randn(8))
    only_five = torch.zeros(8, dtype=torch.bool)
    only_five[5] = True
    choice = ChoiceSampler(
        SamplingParams(temperature=temperature, seed=1), 8, [], mask_fn=lambda v: only_five
    )
    assert choice.sample(torch.randn(8)).token == 5


@pytest.mark.parametrize(
    ("raw", "named"),
    [
        ({"top_p": "0.9"}, "top_p"),
        ({"temperature": -1}, "temperature"),
        ({"repetition_penalty": 0}, "repetition_penalty"),
        ({"top_k": True}, "top_k"),
        ({"min_p": 2}, "min_p"),
    ],
)
def test_bad_generation_config_values_are_refused_naming_file_and_key(tmp_path, raw, named) -> None:
    from dgpp.errors import ConfigError

    (tmp_path / "generation_config.json").write_text(json.dumps(raw))
    with pytest.raises(ConfigError, match=f"generation_config.json: {named} must be a number"):
        SamplingDefaults.from_generation_config(tmp_path)


def test_null_generation_config_values_keep_the_defaults(tmp_path) -> None:
    # transformers writes unset values as null; float(None) used to crash the startup
    (tmp_path / "generation_config.json").write_text(
        json.dumps({"temperature": None, "top_p": None, "top_k": 5})
    )
    d = SamplingDefaults.from_generation_config(tmp_path)
    assert (d.temperature, d.top_p, d.top_k) == (1.0, 1.0, 5)
