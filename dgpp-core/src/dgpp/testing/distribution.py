"""Exact probabilities of plain sampling's first tokens, and Pearson's test of observed draws against them: how the
tests show that speculative decoding keeps the plain sampling distribution."""

from __future__ import annotations

import math

from dgpp.engine.runner import ModelRunner
from dgpp.engine.work import SeqWork
from dgpp.sample import ChoiceSampler, SamplingParams
from dgpp.sample.sampler import filtered_distribution
from dgpp.step.model import Model
from dgpp.step.pools import CachePools

BLOCK = 4


def sequence_probabilities(
    model: Model, prompt: list[int], params: SamplingParams, length: int, floor: float = 1e-9
) -> dict[tuple[int, ...], float]:
    """P(first ``length`` tokens) of plain sampling with ``params`` after ``prompt``, from the model's logits after
    each prefix (the processors see the tokens before each row); prefixes below ``floor`` are not followed (their
    mass stays in the total as missing cells)."""
    blocks = -(-(len(prompt) + length) // BLOCK)
    runner = ModelRunner(
        model, CachePools(model.cache_spec(), blocks, BLOCK, 2, device=next(model.parameters()).device)
    )
    vocab = model.info.vocab_size

    def next_token(generated: tuple[int, ...]) -> dict[int, float]:
        logits = runner.step([SeqWork(0, list(range(blocks)), 0, [*prompt, *generated])])[0]
        sampler = ChoiceSampler(params, vocab, prompt)
        ids, p = filtered_distribution(sampler.processed_logits(logits, generated), params)
        p = (p / p.sum()).double()
        return {int(i): float(q) for i, q in zip(ids.tolist(), p.tolist(), strict=True)}

    level: dict[tuple[int, ...], float] = {(): 1.0}
    for _ in range(length):
        level = {
            (*seq, token): p * q
            for seq, p in level.items()
            if p >= floor
            for token, q in next_token(seq).items()
        }
    return level


def chi_square_p_value(
    counts: dict[tuple[int, ...], int], expected: dict[tuple[int, ...], float], n: int
) -> float:
    """Pearson's test of ``counts`` (``n`` draws) against ``expected`` probabilities; cells expecting fewer than 5
    draws are pooled into one remainder cell."""
    cells = sorted(expected, key=expected.__getitem__, reverse=True)
    big = [c for c in cells if expected[c] * n >= 5]
    observed = [counts.get(c, 0) for c in big] + [n - sum(counts.get(c, 0) for c in big)]
    wanted = [expected[c] * n for c in big] + [n * (1.0 - sum(expected[c] for c in big))]
    if wanted[-1] < 5:  # fold a thin remainder into the smallest kept cell
        observed[-2] += observed.pop()
        wanted[-2] += wanted.pop()
    stat = sum((o - e) ** 2 / e for o, e in zip(observed, wanted, strict=True))
    dof = len(wanted) - 1
    # Wilson-Hilferty: (stat / dof) ** (1/3) is close to normal
    z = ((stat / dof) ** (1 / 3) - (1 - 2 / (9 * dof))) / math.sqrt(2 / (9 * dof))
    return 0.5 * math.erfc(z / math.sqrt(2))
