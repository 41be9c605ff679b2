"""Decode-graph logic on the CPU: size selection, padding rows that write nothing, same logits as eager."""

from __future__ import annotations

import pytest
import torch

from dgpp.bench.models import build_random_model
from dgpp.engine.graphs import DecodeGraphs, capture_sizes, pick_size
from dgpp.engine.runner import ModelRunner, build_batch
from dgpp.engine.work import SeqWork
from dgpp.step.pools import CachePools


def test_capture_sizes_and_selection() -> None:
    assert capture_sizes(1) == [1]
    assert capture_sizes(6) == [1, 2, 4, 6]
    assert capture_sizes(64) == [1, 2, 4, 8, 16, 24, 32, 40, 48, 56, 64]
    assert capture_sizes(20) == [1, 2, 4, 8, 16, 20]
    sizes = capture_sizes(64)
    assert [pick_size(sizes, n) for n in (1, 3, 8, 9, 33, 64)] == [1, 4, 8, 16, 40, 64]
    assert pick_size(sizes, 65) is None
    with pytest.raises(ValueError):
        capture_sizes(0)


@pytest.fixture(scope="module")
def tiny_model():
    return build_random_model("tiny", "cpu", torch.float32, seed=3)


def _prefilled(model, n_seqs: int, prompt: int, blocks_per_seq: int):
    device = next(model.parameters()).device
    pools = CachePools(model.cache_spec(), n_seqs * blocks_per_seq + 2, 4, n_seqs, device)
    tables = [list(range(i * blocks_per_seq, (i + 1) * blocks_per_seq)) for i in range(n_seqs)]
    gen = torch.Generator().manual_seed(0)
    prompts = torch.randint(0, model.info.vocab_size, (n_seqs, prompt), generator=gen).tolist()
    runner = ModelRunner(model, pools)
    logits = runner.step([SeqWork(i, tables[i], 0, p) for i, p in enumerate(prompts)])
    return pools, tables, torch.argmax(logits, -1).tolist(), runner


def test_padded_graph_batch_equals_eager_and_leaves_spare_blocks_alone(tiny_model) -> None:
    pools, tables, last, runner = _prefilled(tiny_model, 3, 9, 4)
    graphs = DecodeGraphs(tiny_model, pools, max_batch=8, max_blocks=4, capture=False)
    spare = [k[-2:].clone() for k, _ in pools.kv.values()]  # blocks no sequence owns
    for step in range(3):
        work = [SeqWork(i, tables[i], 9 + step, [last[i]]) for i in range(3)]
        batch = build_batch(work, pools)
        assert graphs.can_run(batch)
        padded = graphs.run(batch)  # 3 rows in the size-4 batch: one padding row
        assert padded.shape == (3, tiny_model.info.vocab_size)
        # eager on the very same step: re-running writes the same K/V again, so logits must agree
        eager = runner.step(work)
        torch.testing.assert_close(padded, eager, rtol=1e-5, atol=1e-5)
        last = torch.argmax(eager, -1).tolist()
    for (k, _), before in zip(pools.kv.values(), spare, strict=True):
        assert torch.equal(k[-2:], before)
    # buffers past the live rows hold padding: no write (-1), empty context, no state slot
    assert graphs.slot_mapping[3:].eq(-1).all() and graphs.seq_lens[3:].eq(0).all()
    assert graphs.state_slots[3:].eq(-1).all()


def test_graphs_refuse_prefill_and_oversized_batches(tiny_model) -> None:
    pools, tables, last, _ = _prefilled(tiny_model, 2, 5, 4)
    graphs = DecodeGraphs(tiny_model, pools, max_batch=1, max_blocks=4, capture=False)
    prefill = build_batch([SeqWork(0, tables[0], 5, [1, 2])], pools)
    too_many = build_batch([SeqWork(i, tables[i], 5, [last[i]]) for i in range(2)], pools)
    assert not graphs.can_run(prefill) and not graphs.can_run(too_many)
    with pytest.raises(ValueError, match="cannot run"):
        graphs.load(too_many)


@pytest.fixture(scope="module")
def moe_checkpoint(tmp_path_factory):
    from dgpp.testing.builders import build_tiny_checkpoint

    return build_tiny_checkpoint("qwen3_moe", tmp_path_factory.mktemp("qwen3_moe"), seed=5)


def _decode_graph_vs_eager(model, steps: int, atol: float, capture: bool) -> DecodeGraphs:
    pools, tables, last, runner = _prefilled(model, 3, 9, 4)
    graphs = DecodeGraphs(model, pools, max_batch=8, max_blocks=4, capture=capture)
    graphs.capture()
    for step in range(steps):
        work = [SeqWork(i, tables[i], 9 + step, [last[i]]) for i in range(3)]
        batch = build_batch(work, pools, graphs.device)
        assert graphs.can_run(batch)
        padded = graphs.run(batch)  # 3 rows in the size-4 batch: the padding row is routed to experts too
        eager = runner.step(work)
        torch.testing.assert_close(padded, eager, rtol=atol, atol=atol)
        assert torch.argmax(padded, -1).tolist() == torch.argmax(eager, -1).tolist()
        last = torch.argmax(eager, -1).tolist()
    return graphs


def test_moe_model_runs_the_padded_graph_batch(moe_checkpoint) -> None:
    """A MoE model goes through the decode-graph path (its expert alignment has no host sync)."""
    from dgpp.startup.loading import load_model

    _decode_graph_vs_eager(load_model(moe_checkpoint), 3, 1e-5, capture=False)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU (run with TRITON_INTERPRET=0)")
def test_moe_model_decode_is_captured_on_cuda(moe_checkpoint) -> None:
    from dgpp.startup.loading import load_model

    graphs = _decode_graph_vs_eager(load_model(moe_checkpoint, device="cuda"), 4, 1e-4, capture=True)
    assert graphs.use_graphs and set(graphs.graphs) == {1, 2, 4, 8}


def test_work_list_path_fills_the_same_inputs_as_a_batch(tiny_model) -> None:
    """run_work (the runner's decode path: SeqWork lists -> pinned mirrors -> two copies) feeds the graph the
    same live inputs and padding as load(build_batch(...)), gives the same logits, and names bad tables."""
    pools, tables, last, runner = _prefilled(tiny_model, 3, 9, 4)
    via_batch = DecodeGraphs(tiny_model, pools, max_batch=8, max_blocks=6, capture=False)
    via_work = DecodeGraphs(tiny_model, pools, max_batch=8, max_blocks=6, capture=False)
    for step in range(3):
        # rows of ragged table widths; the widest row shrinks after the first step (stale columns stay unread)
        work = [
            SeqWork(i, tables[i][: 4 if step == 0 or i != 2 else 3], 9 + step, [last[i]]) for i in range(3)
        ]
        if step == 2:
            work = work[:2]
        assert via_work.can_run_work(work)
        from_work = via_work.run_work(work)
        from_batch = via_batch.run(build_batch(work, pools))
        assert torch.equal(from_work, from_batch)
        for name in ("input_ids", "positions", "slot_mapping", "state_slots", "seq_lens", "context_lens"):
            assert torch.equal(getattr(via_work, name), getattr(via_batch, name)), name
        for i, w in enumerate(work):
            assert via_work.block_tables[i, : len(w.block_table)].tolist() == w.block_table
        last = torch.argmax(from_work, -1).tolist() + last[len(work) :]
    assert via_work.stats.as_metrics()["replays"] == 3 and via_work.stats.padded_rows == 1 + 1 + 0
    assert not via_work.can_run_work([SeqWork(0, tables[0], 9, [1, 2])])  # prefill
    assert via_work.run_work([SeqWork(0, tables[0], 9, [1, 2])]) is None and via_work.stats.replays == 3
    assert not via_work.can_run_work([SeqWork(0, tables[0], 9, [1], want_logits=False)])
    assert not via_work.can_run_work([SeqWork(i, tables[0], 9, [1]) for i in range(9)])  # over max_batch
    with pytest.raises(ValueError, match="covers 4 tokens, needs 5"):
        via_work.run_work([SeqWork(0, tables[0][:1], 4, [1])])
    with pytest.raises(ValueError, match=r"work item 1: block ids \[0, 99\] outside the pool"):
        via_work.run_work([SeqWork(0, tables[0], 9, [1]), SeqWork(1, [0, 99], 5, [1])])


def test_runner_decode_steps_take_the_work_list_path(tiny_model) -> None:
    pools, tables, last, runner = _prefilled(tiny_model, 2, 5, 4)
    eager = ModelRunner(tiny_model, pools)
    runner.graphs = DecodeGraphs(tiny_model, pools, max_batch=4, max_blocks=4, capture=False)
    work = [SeqWork(i, tables[i], 5, [last[i]]) for i in range(2)]
    torch.testing.assert_close(runner.step(work), eager.step(work), rtol=1e-5, atol=1e-5)
    assert runner.graphs.stats.replays == 1
    runner.step([SeqWork(0, tables[0], 6, [1, 2])])  # a prefill chunk stays eager
    assert runner.graphs.stats.replays == 1
