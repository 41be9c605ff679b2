"""Sampled requests with MTP drafts keep plain sampling's distribution: a drafter that always proposes one of the
three tokens carrying the mass is right about a third of the time, and the first three tokens of 1500 seeded
requests, drawn 24 at a time, follow the model's exact probabilities (a chi-square test); the same test rejects a
verify that redraws plainly on a rejection instead of from the residual. A seeded request's tokens are the same
alone or among others (every row's verdict comes from its own draw seed). The lookup drafter's test is in
``test_lookup_draft.py``."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from dgpp.engine.runner import ModelRunner
from dgpp.engine.speculative import SpeculativeDecoder
from dgpp.sample import ChoiceSampler, SamplingParams
from dgpp.sched.block_pool import BlockPool, SlotPool
from dgpp.sched.prefix_cache import PrefixCache
from dgpp.sched.request import SeqEvent, Sequence
from dgpp.sched.scheduler import Scheduler
from dgpp.startup.loading import load_model
from dgpp.step.pools import CachePools
from dgpp.testing.distribution import chi_square_p_value, sequence_probabilities
from dgpp.testing.scheduler import scheduler_config
from dgpp_glm.testing_glm4 import build_tiny_glm4_moe

BS, BLOCKS, DRAWS = 4, 256, 1500
TRIO = (5, 6, 7)  # a large logit bias gives these three all the mass; their relative odds are the model's
PROMPT = [3, 9, 11, 4, 12, 8]
DRAFT = 6


class ConstantDrafter(nn.Module):
    """A test double for an MTP drafter: proposes ``token`` at every position, sure of it."""

    def __init__(self, token: int, vocab: int) -> None:
        super().__init__()
        self.token, self.vocab = token, vocab

    def cache_spec(self) -> dict:
        return {}

    def forward(self, batch, previous_hidden: torch.Tensor, step: int = 0) -> torch.Tensor:
        out = torch.zeros(batch.logits_indices.shape[0], self.vocab, device=previous_hidden.device)
        out[:, self.token] = 30.0
        return out

    def compute_logits(self, hidden: torch.Tensor, step: int = 0) -> torch.Tensor:
        return hidden


@pytest.fixture(scope="module")
def glm(tmp_path_factory):
    """A target that keeps its hidden rows for a drafter (the drafter here ignores them)."""
    return load_model(build_tiny_glm4_moe(tmp_path_factory.mktemp("sampled_glm"), seed=21))


def _params(seed: int | None) -> SamplingParams:
    """Four tokens, of which the first three are tested: the first from the prefill, the second from the verify
    row of the first draft, the third from the second draft's row (when the first stood) or from the next pass's
    first row (the last allowed token is never drafted)."""
    return SamplingParams(temperature=1.0, max_tokens=4, seed=seed, logit_bias={t: 40.0 for t in TRIO})


def _serve(model, seeds: list[int], concurrency: int) -> tuple[list[tuple[int, ...]], SpeculativeDecoder]:
    conf = scheduler_config(block_size=BS, chunk_tokens=64, max_concurrency=concurrency, queue_limit=4096)
    device = next(model.parameters()).device
    pools = CachePools(model.cache_spec(), BLOCKS, BS, concurrency + 4, device=device)
    runner = ModelRunner(model, pools)
    blocks, slots = BlockPool(BLOCKS, BS), SlotPool(concurrency, 4)
    cache = PrefixCache(blocks, 64, hybrid=model.info.hybrid, slots=slots, copy_state=pools.copy_state)
    sched = Scheduler(conf, runner, blocks, slots, cache)
    vocab = model.info.vocab_size
    decoder = SpeculativeDecoder(runner, ConstantDrafter(DRAFT, vocab), depth=2)
    sched.speculative = decoder
    out: dict[str, list[int]] = {}

    def sink(s: Sequence, ev: SeqEvent) -> None:
        assert ev.error is None, ev.error
        out.setdefault(s.request_id, []).extend(ev.tokens)

    for i, seed in enumerate(seeds):
        p = _params(seed)
        sched.submit([Sequence(f"r{i}", 0, PROMPT, p, ChoiceSampler(p, vocab, PROMPT), sink)])
    for _ in range(20 * len(seeds) + 200):
        if not sched.has_work:
            break
        sched.tick()
    assert not sched.has_work, "scheduler did not drain"
    return [tuple(out[f"r{i}"]) for i in range(len(seeds))], decoder


def _counts(model) -> tuple[dict[tuple[int, ...], int], SpeculativeDecoder]:
    drawn, decoder = _serve(model, list(range(DRAWS)), concurrency=24)
    counts: dict[tuple[int, ...], int] = {}
    for tokens in drawn:
        counts[tokens[:3]] = counts.get(tokens[:3], 0) + 1
    return counts, decoder


def test_sampled_mtp_keeps_the_plain_distribution(glm, monkeypatch):
    import dgpp.sample.batch as verify

    expected = sequence_probabilities(glm, PROMPT, _params(None), 3)
    assert len([p for p in expected.values() if p > 0.02]) >= 10  # a spread-out distribution, not a point
    counts, decoder = _counts(glm)
    stats = decoder.stats
    # every request verified its first draft; the second only behind an accepted first
    assert stats.draft_tokens_per_pos[0] >= DRAWS
    assert 0.05 * DRAWS < stats.accepted_tokens_per_pos[0] < 0.9 * stats.draft_tokens_per_pos[0]
    assert stats.accepted_tokens_per_pos[1] > 0
    assert sum(counts.values()) == DRAWS and set(counts) <= set(expected)
    assert chi_square_p_value(counts, expected, DRAWS) > 1e-3

    # the bug: on a rejection, a plain draw (the draft still in the running) where the residual belongs
    monkeypatch.setattr(verify, "_residual", lambda keep, is_draft: keep)
    wrong, _ = _counts(glm)
    assert chi_square_p_value(wrong, expected, DRAWS) < 1e-6


def test_seeded_sampled_mtp_is_the_same_alone_or_batched(glm):
    seeds = list(range(40, 64))
    batched, _ = _serve(glm, seeds, concurrency=24)
    alone = [_serve(glm, [seed], concurrency=1)[0][0] for seed in seeds[:6]]
    assert alone == batched[:6]
    assert len(set(batched)) > 3  # the seeds draw different tokens


def test_verify_rows_report_the_targets_logprobs():
    """A judged row reports what plain sampling would: the logprob of the emitted token under the target's
    filtered distribution (not the residual it may have come from), and the same top alternatives."""
    from dgpp.sample.batch import Row, sample_batch, sample_rows
    from dgpp.sample.sampler import filtered_distribution

    logits = torch.tensor([[2.0, 1.5, 0.3, -1.0, 0.9, 0.0, -0.5, 1.1]] * 2)
    kinds = [
        SamplingParams(temperature=0.7, top_k=5, logprobs=True, top_logprobs=3, seed=1),
        SamplingParams(temperature=0.0, logprobs=True, top_logprobs=3),
    ]
    for params in kinds:
        for draft in range(8):
            drawn = sample_rows(
                logits,
                [Row(ChoiceSampler(params, 8, []), drafted=True), Row(ChoiceSampler(params, 8, []))],
                torch.tensor([draft, -1]),
            )
            judged, plain = drawn.result(0), sample_batch(logits[1:], [ChoiceSampler(params, 8, [])])[0]
            assert not isinstance(judged, Exception) and not isinstance(plain, Exception)
            assert judged.top_logprobs == plain.top_logprobs
            if params.greedy:
                want = torch.log_softmax(logits[0], 0)[judged.token]
            else:
                ids, probs = filtered_distribution(logits[0], params)
                want = torch.log(probs / probs.sum())[ids.tolist().index(judged.token)]
            assert judged.logprob == pytest.approx(float(want), abs=1e-6)
            assert drawn.accepted[0] == (judged.token == draft)
