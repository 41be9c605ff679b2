"""Speculative verify steps through the decode graphs' padded static batch (``capture=False``: the very batch a CUDA
graph replays, run eagerly on the CPU): each verify row as its own decode row gives the eager verify's logits and
hidden rows bit for bit (mixed draft counts, padding rows), padding rows write nothing, a replay hands the drafter its
hidden rows from the static buffer, and greedy with drafts (GLM-4.7 MTP, GLM-5.3 MTP over MLA and DSA, an oracle,
Qwen3 prompt lookup) emits the plain transcript with the verifies replayed; a hybrid verifies eager."""

from __future__ import annotations

import pytest
import torch
from test_lookup_draft import _greedy
from test_lookup_draft import serve as serve_lookup
from test_speculative import PROMPTS, serve, tiny_glm_with_mtp

from dgpp.engine.graphs import DecodeGraphs, verify_graphs
from dgpp.engine.lookup_draft import LookupDecoder
from dgpp.engine.runner import ModelRunner
from dgpp.engine.speculative import SpeculativeDecoder
from dgpp.engine.verify_graphs import as_decode_rows, verify_rows_independent
from dgpp.engine.work import SeqWork
from dgpp.startup.loading import load_model
from dgpp.step.pools import CachePools
from dgpp.testing.builders import build_tiny_checkpoint

BS, BLOCKS_PER_SEQ = 4, 6


@pytest.fixture(scope="module")
def qwen3(tmp_path_factory):
    return load_model(build_tiny_checkpoint("qwen3", tmp_path_factory.mktemp("verify_graphs_qwen3"), seed=3))


@pytest.fixture(scope="module")
def glm(tmp_path_factory):
    return tiny_glm_with_mtp(tmp_path_factory.mktemp("verify_graphs_glm"))


@pytest.fixture(scope="module")
def glm_model(glm):
    return glm[0]


def _prefilled(model, pools: CachePools, prompts: list[list[int]]) -> list[list[int]]:
    """The prompts' K/V in ``pools`` (one sequence a slot, ``BLOCKS_PER_SEQ`` blocks each from block 1: block 0 and
    the last blocks belong to nobody); returns the block tables."""
    tables = [list(range(1 + i * BLOCKS_PER_SEQ, 1 + (i + 1) * BLOCKS_PER_SEQ)) for i in range(len(prompts))]
    ModelRunner(model, pools).step([SeqWork(i, tables[i], 0, p) for i, p in enumerate(prompts)])
    return tables


def _pools(model, seqs: int) -> CachePools:
    return CachePools(
        model.cache_spec(), seqs * BLOCKS_PER_SEQ + 3, BS, seqs, next(model.parameters()).device
    )


def _verify_work(tables, starts: list[int], counts: list[int], seed: int) -> list[SeqWork]:
    """One verify step: each request's last token and ``counts[i]`` drafts (random ids) at ``starts[i]``."""
    gen = torch.Generator().manual_seed(seed)
    return [
        SeqWork(
            i, tables[i], c, torch.randint(3, 200, (k + 1,), generator=gen).tolist(), every_row_logits=True
        )
        for i, (c, k) in enumerate(zip(starts, counts, strict=True))
    ]


def _clone_pools(pools: CachePools) -> list[torch.Tensor]:
    return [t.clone() for pair in pools.kv.values() for t in pair]


@pytest.mark.parametrize("family", ["qwen3", "glm"])
def test_padded_verify_rows_give_the_eager_bits(family, qwen3, glm_model) -> None:
    """Mixed draft counts (none, one, three) in one step, padded to the next captured row count: every row's logits
    and hidden are the eager verify's, bit for bit, and the padding rows' buffers hold padding."""
    model = qwen3 if family == "qwen3" else glm_model
    model.keep_hidden = True
    try:
        prompts = [[5 + i for i in range(n)] for n in (7, 4, 10)]
        pools = _pools(model, 3)
        tables = _prefilled(model, pools, prompts)
        graphs = verify_graphs(DecodeGraphs(model, pools, 3, BLOCKS_PER_SEQ, capture=False), model, 3)
        assert graphs is not None and graphs.takes_verify and graphs.sizes == [1, 2, 4, 8, 12]
        eager = ModelRunner(model, pools)
        for seed, counts in enumerate(([0, 1, 3], [1, 0, 0], [3, 3, 3])):
            work = _verify_work(tables, [len(p) for p in prompts], counts, seed)
            padded = graphs.run_work(work)
            assert padded is not None
            # GLM keeps every row's hidden for its MTP layer; Qwen3 has no drafter that reads them
            padded_hidden = None if model.last_hidden is None else model.last_hidden.clone()
            assert (padded_hidden is not None) == (family == "glm")
            reference = eager.step(work, verify=True)  # rewrites the same K/V rows, then attends over them
            rows = sum(counts) + len(counts)
            assert padded.shape == reference.shape == (rows, model.info.vocab_size)
            assert torch.equal(padded, reference)
            if padded_hidden is not None:
                assert model.last_hidden is not None and torch.equal(padded_hidden, model.last_hidden)
            size = graphs.stats.by_size
            assert graphs.slot_mapping[rows:].eq(-1).all() and graphs.seq_lens[rows:].eq(0).all()
        assert dict(size) == {8: 1, 4: 1, 12: 1}  # 7 rows in 8, 3 in 4, 12 in 12
    finally:
        model.keep_hidden = False


def test_padding_rows_write_nothing(qwen3) -> None:
    """A wide verify, then narrower ones (the static buffers' rows past the live ones held live slots a step
    before): the pools end bit for bit as the eager verifies leave them, and blocks nobody owns stay untouched."""
    prompts = [[9 + i for i in range(n)] for n in (6, 9)]
    pools_graph, pools_eager = _pools(qwen3, 2), _pools(qwen3, 2)
    tables = _prefilled(qwen3, pools_graph, prompts)
    _prefilled(qwen3, pools_eager, prompts)
    graphs = verify_graphs(DecodeGraphs(qwen3, pools_graph, 2, BLOCKS_PER_SEQ, capture=False), qwen3, 3)
    assert graphs is not None
    eager = ModelRunner(qwen3, pools_eager)
    before = _clone_pools(pools_graph)
    starts = [len(p) for p in prompts]
    for seed, counts in enumerate(
        ([3, 3], [0, 2], [1, 0])
    ):  # 8 rows, then 4 in 4, then 3 in 4: one padding row
        work = _verify_work(tables, starts, counts, seed)
        assert torch.equal(graphs.run_work(work), eager.step(work, verify=True))
        starts = [c + k + 1 for c, k in zip(starts, counts, strict=True)]
    assert graphs.stats.padded_rows == 1
    after = _clone_pools(pools_graph)
    for got, want in zip(after, _clone_pools(pools_eager), strict=True):
        assert torch.equal(got, want)
    for got, was in zip(after, before, strict=True):  # block 0 and the spare blocks: nobody's
        assert torch.equal(got[0], was[0]) and torch.equal(got[-3:], was[-3:])


class _ReplayInPlace:
    """Stands in for a captured graph on the CPU: a replay rewrites the size's static output buffers (logits and
    hidden) from the static inputs and runs no Python a caller could see, so ``last_hidden`` is left stale."""

    def __init__(self, graphs: DecodeGraphs, size: int) -> None:
        self.graphs, self.size = graphs, size
        self.logits, self.hidden = (
            graphs.outputs[size],
            graphs.hidden[size],
        )  # the buffers it was captured with

    def replay(self) -> None:
        g, model = self.graphs, self.graphs.model
        n = self.size  # the torch path reads the lengths on the host: the static device buffers' own
        static = g._static_batch(n, g.seq_lens[:n].tolist(), g.context_lens[:n].tolist())
        self.logits.copy_(g._forward(static))
        assert model.last_hidden is not None
        self.hidden.copy_(model.last_hidden)
        model.last_hidden = torch.full_like(model.last_hidden, float("nan"))  # what no replay refreshes


def test_replay_hands_the_static_hidden_rows_to_the_drafter(glm_model) -> None:
    """The replay branch: logits and hidden rows come out of the size's static buffers, copied (a later replay
    rewrites them), equal to the eager verify's; a graph captured without hidden rows is refused by name."""
    model = glm_model
    model.keep_hidden = True
    try:
        prompts = [[5 + i for i in range(n)] for n in (7, 4)]
        pools = _pools(model, 2)
        tables = _prefilled(model, pools, prompts)
        graphs = verify_graphs(DecodeGraphs(model, pools, 2, BLOCKS_PER_SEQ, capture=False), model, 2)
        assert graphs is not None
        graphs.captured = graphs.use_graphs = True  # replay through stand-ins
        for size in graphs.sizes:
            graphs.outputs[size] = graphs._forward(graphs._static_batch(size)).clone()  # all padding
            graphs.hidden[size] = model.last_hidden.clone()
            graphs.graphs[size] = _ReplayInPlace(graphs, size)  # type: ignore[assignment]
        work = _verify_work(tables, [len(p) for p in prompts], [2, 1], seed=4)
        logits = graphs.run_work(work)
        hidden = model.last_hidden
        assert hidden is not None and hidden.shape[0] == 5
        assert hidden.untyped_storage().data_ptr() != graphs.hidden[6].untyped_storage().data_ptr()
        hidden = hidden.clone()
        assert torch.equal(logits, ModelRunner(model, pools).step(work, verify=True))
        assert torch.equal(hidden, model.last_hidden)
        del graphs.hidden[6]  # 5 rows replay in the size-6 graph
        with pytest.raises(RuntimeError, match="size-6 decode graph keeps no hidden rows"):
            graphs.run_work(work)
    finally:
        model.keep_hidden = False


def test_prefill_chunks_are_not_verify_rows() -> None:
    verify = SeqWork(0, [0, 1], 3, [7, 8, 9], every_row_logits=True)
    rows = as_decode_rows([SeqWork(1, [2], 2, [4]), verify])
    assert rows is not None
    assert [(w.state_slot, w.context_len, w.token_ids) for w in rows] == [
        (1, 2, [4]),
        (0, 3, [7]),
        (0, 4, [8]),
        (0, 5, [9]),
    ]
    assert as_decode_rows([SeqWork(0, [0, 1], 0, [7, 8, 9])]) is None


def _with_graphs(runner: ModelRunner, max_batch: int, max_blocks: int) -> None:
    runner.graphs = DecodeGraphs(runner.model, runner.pools, max_batch, max_blocks, capture=False)


@pytest.mark.parametrize("depth", [1, 3])
def test_greedy_mtp_through_verify_graphs_equals_plain(glm, depth, monkeypatch) -> None:
    """GLM-4.7's MTP layer drafts from the hidden rows the padded static verify hands over (the very rows the eager
    verify keeps); chunked prefill, a prefix-cache hit, admission while others decode."""
    model, drafter = glm
    kept: dict[bool, list[tuple[str, int, torch.Tensor]]] = {False: [], True: []}
    keep = SpeculativeDecoder._keep

    def recording(self, s, first, hidden):
        kept[self.runner.graphs is not None].append((s.request_id, first, hidden.clone()))
        keep(self, s, first, hidden)

    monkeypatch.setattr(SpeculativeDecoder, "_keep", recording)
    plain, _ = serve(model)
    eager, _ = serve(model, drafter, depth)
    spec, sched = serve(model, drafter, depth, graphs=True)
    assert spec == eager == plain
    graphs = sched.runner.graphs
    assert isinstance(graphs, DecodeGraphs) and graphs.takes_verify
    stats = sched.speculative.stats
    assert stats.num_draft_tokens_total > 0
    # every decode pass went through the static batch (one-token prefill chunks may too)
    assert graphs.stats.replays >= sched.stats.decode_steps
    assert _replayed_rows(graphs) >= sched.stats.decode_rows + stats.num_draft_tokens_total
    assert len(kept[True]) == len(kept[False]) > 0
    for (rid, first, rows), (rid_eager, first_eager, rows_eager) in zip(kept[True], kept[False], strict=True):
        assert (rid, first) == (rid_eager, first_eager) and torch.equal(rows, rows_eager)


def _replayed_rows(graphs: DecodeGraphs) -> int:
    """The live rows the static batch ran: its padded rows less the padding."""
    return sum(size * n for size, n in graphs.stats.by_size.items()) - graphs.stats.padded_rows


@pytest.mark.parametrize("kv_dtype", ["auto", "fp8"])
def test_greedy_mla_dsa_mtp_through_verify_graphs_equals_plain(tmp_path, kv_dtype) -> None:
    """GLM-5.3 (MLA latents and DSA index keys, sparse selections; its MTP layer with its own indexer): each verify
    row, as a decode row, selects and attends over its own prefix; under fp8 the latents are quantized rows."""
    from dgpp.plugins import manager
    from dgpp.startup.loading import load_context
    from dgpp_glm.testing_glm5 import build_tiny_glm_moe_dsa

    path = build_tiny_glm_moe_dsa(tmp_path, seed=7, mtp_layers=1)
    model = load_model(path)
    assert verify_rows_independent(model)
    drafter = manager().hook.dgpp_build_draft(ctx=load_context(path), model=model)
    plain, _ = serve(model, kv_dtype=kv_dtype)
    spec, sched = serve(model, drafter, 2, kv_dtype=kv_dtype, graphs=True)
    assert spec == plain
    graphs = sched.runner.graphs
    assert isinstance(graphs, DecodeGraphs) and graphs.takes_verify
    assert graphs.stats.replays >= sched.stats.decode_steps > 0
    assert _replayed_rows(graphs) >= sched.stats.decode_rows + sched.speculative.stats.num_draft_tokens_total


def test_greedy_oracle_through_verify_graphs_is_fully_accepted(glm) -> None:
    model, _ = glm
    plain, _ = serve(model)
    transcripts = {f"r{i}": PROMPTS[i] + plain[f"r{i}"] for i in range(len(PROMPTS))}
    for wrong_from in (None, 1):
        spec, sched = serve(model, depth=3, oracle=transcripts, wrong_from=wrong_from, graphs=True)
        assert spec == plain
        stats = sched.speculative.stats
        graphs = sched.runner.graphs
        assert graphs.stats.replays >= sched.stats.decode_steps
        assert _replayed_rows(graphs) >= sched.stats.decode_rows + stats.num_draft_tokens_total
        if wrong_from is None:
            assert stats.num_accepted_tokens_total == stats.num_draft_tokens_total > 0
        else:
            assert 0 < stats.num_accepted_tokens_total < stats.num_draft_tokens_total


@pytest.mark.parametrize(("depth", "chunk", "concurrency"), [(3, 8, 3), (3, 64, 1), (8, 4, 4)])
def test_greedy_lookup_through_verify_graphs_equals_plain(qwen3, depth, chunk, concurrency) -> None:
    plain, _ = serve_lookup(qwen3, _greedy(), chunk=chunk, concurrency=concurrency)
    spec, sched = serve_lookup(
        qwen3, _greedy(), depth=depth, chunk=chunk, concurrency=concurrency, graphs=True
    )
    assert spec == plain
    stats = sched.speculative.stats
    assert stats.num_accepted_tokens_total > 0
    assert sched.runner.graphs.stats.replays >= sched.stats.decode_steps
    assert _replayed_rows(sched.runner.graphs) >= sched.stats.decode_rows + stats.num_draft_tokens_total


def test_hybrid_verifies_eager(tmp_path) -> None:
    """The Qwen3.5 GDN hybrid's verify rows share the request's recurrent state: no verify graphs."""
    model = load_model(build_tiny_checkpoint("qwen3_5", tmp_path, seed=23))
    assert not verify_rows_independent(model)
    pools = _pools(model, 2)
    runner = ModelRunner(model, pools)
    _with_graphs(runner, 2, BLOCKS_PER_SEQ)
    LookupDecoder(runner, 2, 2, 3)
    assert runner.graphs is None


def test_no_decode_graphs_no_verify_graphs(glm) -> None:
    model, drafter = glm
    runner = ModelRunner(model, _pools(model, 2))
    SpeculativeDecoder(runner, drafter, 2)
    assert runner.graphs is None
    model.keep_hidden = False
