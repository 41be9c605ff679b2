"""Prompt-lookup drafts (``engine.draft: "lookup"``) through the scheduler: greedy with lookup drafts emits exactly
the plain greedy transcript (chunked or not, solo or batched, a dense model and the Qwen3.5 GDN hybrid) while some
drafts are accepted; seeded sampling keeps the plain distribution (a chi-square test against the model's exact
probabilities, which rejects a verify that redraws plainly instead of from the residual); the n-gram index;
``spec_decode`` counters; the keys."""

from __future__ import annotations

import pytest
import torch

from dgpp.engine.graphs import DecodeGraphs
from dgpp.engine.lookup_draft import LookupDecoder, NgramIndex
from dgpp.engine.runner import ModelRunner
from dgpp.engine.verify_schedule import ScheduleSettings
from dgpp.engine.work import SeqWork
from dgpp.sample import ChoiceSampler, SamplingParams
from dgpp.sched.block_pool import BlockPool, SlotPool
from dgpp.sched.prefix_cache import PrefixCache
from dgpp.sched.published import Published
from dgpp.sched.request import SeqEvent, Sequence
from dgpp.sched.scheduler import Scheduler
from dgpp.serve.metrics import engine_report
from dgpp.startup.loading import load_model
from dgpp.step.pools import CachePools
from dgpp.testing.builders import build_tiny_checkpoint
from dgpp.testing.distribution import chi_square_p_value, sequence_probabilities
from dgpp.testing.scheduler import scheduler_config

BS, BLOCKS = 4, 160
_GEN = torch.Generator().manual_seed(11)


def _copy_heavy(n: int, tail: int) -> list[int]:
    """A random paragraph, a separator, then its first ``tail`` tokens again (the model is asked to go on copying)."""
    para = torch.randint(3, 200, (n,), generator=_GEN).tolist()
    return para + [1, 2] + para[:tail]


PROMPTS = [_copy_heavy(n, t) for n, t in ((14, 3), (21, 5), (9, 2))] + [
    torch.randint(3, 200, (6,), generator=_GEN).tolist()
]
MAX_TOKENS = [24, 18, 20, 12]
# three tokens carry all the mass (a large logit bias; their relative odds are the model's), and the prompt holds
# every pair of them, so every decode step drafts one of them and the draft is right about a third of the time
TRIO = (5, 6, 7)
SAMPLED_PROMPT = [3, 9, 5, 5, 6, 6, 7, 7, 5, 7, 6, 5, 4, 11, 6]


@pytest.fixture(scope="module")
def dense(tmp_path_factory):
    return load_model(build_tiny_checkpoint("qwen3", tmp_path_factory.mktemp("lookup_qwen3"), seed=3))


@pytest.fixture(scope="module")
def hybrid(tmp_path_factory):
    return load_model(build_tiny_checkpoint("qwen3_5", tmp_path_factory.mktemp("lookup_qwen35"), seed=23))


def _scheduler(model, *, chunk: int, concurrency: int, graphs: bool = False) -> Scheduler:
    conf = scheduler_config(block_size=BS, chunk_tokens=chunk, max_concurrency=concurrency, queue_limit=4096)
    pools = CachePools(
        model.cache_spec(), BLOCKS, BS, conf.max_concurrency + 4, device=next(model.parameters()).device
    )
    runner = ModelRunner(model, pools)
    if graphs:  # the decode graphs: captured on CUDA, elsewhere their padded static batch runs eagerly
        runner.graphs = DecodeGraphs(model, pools, conf.max_concurrency, BLOCKS)
    blocks, slots = BlockPool(BLOCKS, BS), SlotPool(conf.max_concurrency, 4)
    cache = PrefixCache(blocks, chunk, hybrid=model.info.hybrid, slots=slots, copy_state=pools.copy_state)
    return Scheduler(conf, runner, blocks, slots, cache)


def serve(
    model,
    requests: list[tuple[list[int], SamplingParams]],
    *,
    depth: int = 0,
    chunk: int = 8,
    concurrency: int = 3,
    min_ngram: int = 2,
    max_ngram: int = 3,
    schedule: ScheduleSettings | None = None,
    graphs: bool = False,
) -> tuple[list[list[int]], Scheduler]:
    """Every request through one scheduler (lookup drafts at ``depth``; 0: plain decode); tokens per request.
    ``graphs``: decode and verify steps through the decode graphs' static batch."""
    sched = _scheduler(model, chunk=chunk, concurrency=concurrency, graphs=graphs)
    if depth:
        sched.speculative = LookupDecoder(sched.runner, depth, min_ngram, max_ngram, schedule)
    out: dict[str, list[int]] = {}

    def sink(s: Sequence, ev: SeqEvent) -> None:
        assert ev.error is None, ev.error
        out.setdefault(s.request_id, []).extend(ev.tokens)

    vocab = model.info.vocab_size
    for i, (prompt, params) in enumerate(requests):
        sched.submit([Sequence(f"r{i}", 0, prompt, params, ChoiceSampler(params, vocab, prompt), sink)])
    for _ in range(20 * len(requests) + 200):
        if not sched.has_work:
            break
        sched.tick()
    assert not sched.has_work, "scheduler did not drain"
    return [out[f"r{i}"] for i in range(len(requests))], sched


def _greedy(biased: bool = False) -> list[tuple[list[int], SamplingParams]]:
    """The prompts, greedy; ``biased`` adds one whose output is held to three tokens (a logit bias), which its
    prompt repeats in every order: the lookup is right about a third of the time whatever the weights."""
    plain = [
        (p, SamplingParams(temperature=0.0, max_tokens=n)) for p, n in zip(PROMPTS, MAX_TOKENS, strict=True)
    ]
    trio = SamplingParams(temperature=0.0, max_tokens=16, logit_bias={t: 40.0 for t in TRIO})
    return plain + [(SAMPLED_PROMPT, trio)] if biased else plain


def _counters(sched: Scheduler) -> dict:
    spec = engine_report(Published(sched))["scheduler"]["spec_decode"]
    assert spec["drafter"] == "lookup"
    assert spec["num_draft_tokens_total"] == sum(spec["num_draft_tokens_per_pos_total"])
    assert spec["num_accepted_tokens_total"] == sum(spec["num_accepted_tokens_per_pos_total"])
    return spec


def test_ngram_index_proposes_what_followed_the_latest_match():
    index = NgramIndex(1, 3)
    index.extend([5, 6, 7, 8, 9, 5, 6, 7, 4, 5, 6])
    assert index.propose(2) == [7, 4]  # "5 6" last occurred before 7 4 (the later match wins)
    index.extend([1])
    assert index.propose(3) == []  # 1 never occurred before
    index.extend([5, 6, 7])
    assert index.propose(4) == [4, 5, 6, 1]  # the 3-gram "5 6 7" at its latest earlier place
    tail = NgramIndex(2, 2)
    tail.extend([3, 4, 3, 4])
    assert tail.propose(5) == [3, 4]  # only tokens that exist are proposed


def test_lookup_state_drafts_what_it_has_earned():
    """One more draft than last accepted (up to the depth); after a wrong first draft, 1, 3, 7 ... steps without."""
    from dgpp.engine.lookup_draft import LookupState

    state = LookupState(1, 3, depth=4)
    assert (state.limit, state.skip) == (4, 0)
    state.judged(4, 1, 4)
    assert (state.limit, state.skip) == (2, 0)
    state.judged(2, 2, 4)
    assert state.limit == 3
    skips = []
    for _ in range(6):
        state.judged(1, 0, 4)
        skips.append(state.skip)
    assert skips == [1, 3, 7, 15, 15, 15] and state.limit == 1
    state.judged(1, 1, 4)
    assert (state.misses, state.limit) == (0, 2)


def test_verify_items_name_every_row_for_logits():
    """A verify item's every row is a logits row, in row order beside the other items' last rows, so any model's
    ``forward`` (which returns the rows ``logits_indices`` names) gives the verify its logits."""
    from dgpp.engine.runner import build_batch

    pools = CachePools({}, 8, BS, 4)
    work = [
        SeqWork(0, [0], 2, [7]),
        SeqWork(1, [1, 2], 3, [7, 8, 9], every_row_logits=True),
        SeqWork(2, [3], 0, [1, 2], want_logits=False),
        SeqWork(3, [4], 1, [4, 5]),
    ]
    assert build_batch(work, pools).logits_indices.tolist() == [0, 1, 2, 3, 7]


@pytest.mark.parametrize(
    ("depth", "chunk", "concurrency"), [(3, 8, 3), (3, 64, 1), (3, 4, 4), (1, 8, 3), (8, 4, 4)]
)
def test_dense_greedy_lookup_equals_plain(dense, depth, chunk, concurrency):
    """At several depths (8: past the old cap of 5), chunked, solo and batched."""
    plain, _ = serve(dense, _greedy(), chunk=chunk, concurrency=concurrency)
    assert [len(t) for t in plain] == MAX_TOKENS
    spec, sched = serve(dense, _greedy(), depth=depth, chunk=chunk, concurrency=concurrency)
    assert spec == plain
    counters = _counters(sched)
    # the copy-heavy prompts make the lookup right sometimes: drafting is on and pays
    assert counters["num_drafts_total"] > 0 and counters["num_accepted_tokens_total"] > 0
    assert sched.stats.decode_steps < sum(MAX_TOKENS)
    if depth > 5:
        assert sum(counters["num_verifies_per_depth_total"][6:]) > 0  # steps that judged more than 5 drafts


def test_hybrid_greedy_lookup_equals_plain(hybrid):
    """The GDN state saw every verify row: on a rejection it is restored and the accepted rows run again."""
    plain, _ = serve(hybrid, _greedy(biased=True))
    for depth, chunk in ((2, 8), (4, 64)):
        spec, sched = serve(hybrid, _greedy(biased=True), depth=depth, chunk=chunk, min_ngram=1)
        assert spec == plain
        counters = _counters(sched)
        assert counters["num_accepted_tokens_total"] > 0
        assert (
            counters["num_accepted_tokens_total"] < counters["num_draft_tokens_total"]
        )  # rejections restored


# ---- sampled: the distribution is the plain one -----------------------------------------------------------
DRAWS = 1500


def _sampled_params(seed: int | None) -> SamplingParams:
    """Three tokens: the first from the prefill, the second from the verify of one draft (the last allowed token
    is never drafted), the third its bonus row or the next step's."""
    return SamplingParams(temperature=1.0, max_tokens=3, seed=seed, logit_bias={t: 40.0 for t in TRIO})


def _sampled_pairs(model) -> tuple[dict[tuple[int, int], int], dict]:
    requests = [(SAMPLED_PROMPT, _sampled_params(seed)) for seed in range(DRAWS)]
    out, sched = serve(model, requests, depth=1, chunk=64, concurrency=24, min_ngram=1, max_ngram=2)
    counts: dict[tuple[int, int], int] = {}
    for tokens in out:
        counts[(tokens[0], tokens[1])] = counts.get((tokens[0], tokens[1]), 0) + 1
    return counts, _counters(sched)


def test_sampled_lookup_keeps_the_plain_distribution(dense, monkeypatch):
    """Every second token comes out of a drafted verify row: the ratio test keeps the draft with p(draft), else
    draws from the residual. The pairs follow the model's exact probabilities; a verify that redraws plainly
    on a rejection over-weights the draft, and the same test rejects it."""
    import dgpp.sample.batch as verify

    expected = sequence_probabilities(dense, SAMPLED_PROMPT, _sampled_params(None), 2)
    assert len([p for p in expected.values() if p > 0.03]) >= 5  # a spread-out distribution, not a point
    counts, counters = _sampled_pairs(dense)
    assert counters["num_drafts_total"] == DRAWS  # every request drafted once (its second token)
    assert 0.05 * DRAWS < counters["num_accepted_tokens_total"] < 0.9 * DRAWS  # some drafts kept, some not
    assert sum(counts.values()) == DRAWS and set(counts) <= set(expected)
    assert chi_square_p_value(counts, expected, DRAWS) > 1e-3

    # the bug: on a rejection, a plain draw (the draft still in the running) where the residual belongs
    monkeypatch.setattr(verify, "_residual", lambda keep, is_draft: keep)
    wrong, _ = _sampled_pairs(dense)
    assert chi_square_p_value(wrong, expected, DRAWS) < 1e-6


# ---- keys ------------------------------------------------------------------------------------------------
def test_engine_draft_builds_the_lookup_decoder(dense):
    from dgpp.config import EngineConfig, parse_config
    from dgpp.errors import ConfigError
    from dgpp.plugins import manager
    from dgpp.startup.speculative_build import build_speculative

    runner = ModelRunner(dense, CachePools(dense.cache_spec(), 8, BS, 2))
    cfg = EngineConfig(draft="lookup", draft_depth=4, lookup_ngram=5, lookup_min_ngram=3)
    decoder = build_speculative(cfg, None, runner, pm=manager())  # type: ignore[arg-type]
    assert isinstance(decoder, LookupDecoder) and decoder.depth == 4 and decoder.stats.depth == 4
    assert (decoder.min_ngram, decoder.max_ngram) == (3, 5) and decoder.stats.as_metrics()[
        "drafter"
    ] == "lookup"
    with pytest.raises(ConfigError, match=r"engine\.draft.*engine\.mtp"):
        parse_config({"model": "m", "engine": {"draft": "lookup", "mtp": True}})
    with pytest.raises(ConfigError, match=r"engine\.lookup_min_ngram"):
        parse_config({"model": "m", "engine": {"draft": "lookup", "lookup_ngram": 2, "lookup_min_ngram": 3}})
    with pytest.raises(ConfigError, match=r"engine\.draft"):
        parse_config({"model": "m", "engine": {"draft": "ngram"}})
