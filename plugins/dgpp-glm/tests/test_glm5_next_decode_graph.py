"""GLM-5.3-Flash's decode step on device-side lengths (the form a CUDA graph replays), on the CPU: the graph's
padded inputs give the eager step's logits bit for bit, and the indexer's device decode step stores and selects
what the row-by-row path does (tiny checkpoint: kpool 4, index_topk 8, so rows past 12 tokens run sparse)."""

from __future__ import annotations

import copy

import pytest
import torch

from dgpp.engine.graphs import DecodeGraphs
from dgpp.engine.runner import build_batch
from dgpp.engine.work import SeqWork
from dgpp.nn.batch_invariant import batch_invariant_linear
from dgpp.nn.selection import DeviceSelection
from dgpp.step.cache_spec import stored_as
from dgpp.step.pools import CachePools
from dgpp.testing.prefilled import prefill_random
from dgpp.testing.suite import tiny_checkpoint_fixtures
from dgpp_glm.testing_glm5_next import build_tiny_glm5_next

checkpoint, fp32_pair = tiny_checkpoint_fixtures(build_tiny_glm5_next, "glm5_next")

PROMPTS = (23, 9, 14)  # sparse, dense and sparse rows; 9 and 14 end inside a pool
BLOCKS_PER_SEQ = 8  # 32 tokens of 4-token blocks


def _prefilled(model, kv_dtype: str = "auto"):
    spec = stored_as(model.cache_spec(), kv_dtype)
    return prefill_random(model, PROMPTS, BLOCKS_PER_SEQ, 4, seed=1, spec=spec, spare_blocks=2, spare_seqs=0)


@pytest.mark.parametrize("kv_dtype", ["auto", "fp4"])
def test_padded_graph_inputs_give_the_eager_logits_bit_for_bit(fp32_pair, kv_dtype) -> None:
    """Also with ``engine.kv_dtype: fp4`` (packed latents, e4m3 pooled index keys and their scales)."""
    model, _ = fp32_pair
    pools, tables, last, runner = _prefilled(model, kv_dtype)
    graphs = DecodeGraphs(model, pools, max_batch=8, max_blocks=BLOCKS_PER_SEQ, capture=False)
    for step in range(5):  # the 9- and 14-token rows complete a pool within these steps
        work = [SeqWork(i, tables[i], n + step, [last[i]]) for i, n in enumerate(PROMPTS)]
        snapshot = {name: {k: t.clone() for k, t in ts.items()} for name, ts in pools.state.items()}
        kv = {name: tuple(t.clone() for t in _tensors(pools, name)) for name in pools.kv}
        batch = build_batch(work, pools)
        assert graphs.can_run(batch)
        padded = graphs.run(batch)  # 3 rows in the size-4 batch: one padding row
        # eager on the very same step from the same state
        for name, ts in snapshot.items():
            for k, t in ts.items():
                pools.state[name][k].copy_(t)
        for name, ts in kv.items():
            for live, saved in zip(_tensors(pools, name), ts, strict=True):
                live.copy_(saved)
        eager = runner.step(work)
        assert torch.equal(padded, eager)
        last = torch.argmax(eager, -1).tolist()
    assert graphs.state_slots[3:].eq(-1).all()


@pytest.mark.parametrize(("kv_dtype", "kernel"), [("auto", False), ("fp8", False), ("fp8", True)])
def test_device_decode_step_stores_and_selects_as_the_row_path(
    fp32_pair, kv_dtype, kernel, monkeypatch
) -> None:
    """Also with e4m3 pooled index keys (``engine.kv_dtype: fp8``): the same codes and scales either way, the decode
    step's keys written by the torch encoder or (``kernel``, as on CUDA) by the one-launch quantized write."""
    from dgpp.kernels import quantized_write

    launches: list[int] = []
    if kernel:
        write = quantized_write.write_quantized_triton

        def counted(*args):
            launches.append(args[2].shape[0])
            write(*args)

        monkeypatch.setattr(quantized_write, "use_triton", lambda x: True)
        monkeypatch.setattr(quantized_write, "write_quantized_triton", counted)
    model, _ = fp32_pair
    pools, tables, last, _ = _prefilled(model, kv_dtype)
    indexer = model.stack.layers[1].self_attn.indexer
    gen = torch.Generator().manual_seed(2)
    kinds: set[bool] = set()  # sparse rows and dense rows both met
    for step in range(5):
        work = [SeqWork(i, tables[i], n + step, [last[i]]) for i, n in enumerate(PROMPTS)]
        row_pools = copy.deepcopy(pools)
        device_batch, row_batch = build_batch(work, pools), build_batch(work, row_pools)
        x = torch.randn(len(PROMPTS), model.config.hidden_size, generator=gen)
        q_resid = torch.randn(len(PROMPTS), model.config.q_lora_rank, generator=gen)
        picked = indexer(x, q_resid, device_batch)
        assert isinstance(picked, DeviceSelection) and picked.sparse is not None
        # the row path: the prefill store, then the row loop, on a copy of the same cache
        q = indexer.wq_b(q_resid).view(len(PROMPTS), indexer.num_heads, indexer.head_dim).float()
        weights = indexer.weights_proj(x).float() * indexer.num_heads**-0.5
        gate = batch_invariant_linear(x, indexer.index_kpool_compress_gate)
        indexer.store(indexer.k_norm(indexer.wk(x)), gate, row_batch)
        expected = indexer.select_rows(q, weights, row_batch)
        kinds.update(s is not None for s in expected)
        for name in (indexer.cache_name, indexer.buffer_name):
            for ours, theirs in zip(_tensors(pools, name), _tensors(row_pools, name), strict=True):
                assert torch.equal(ours, theirs), name
        for row, (ours, want) in enumerate(zip(picked.as_rows(), expected, strict=True)):
            assert (ours is None) == (want is None), (row, step)  # dense rows: every visible token
            assert ours is None or torch.equal(ours, want.long()), (row, step)
        visible = picked.counts[~picked.sparse.bool()].long()
        assert torch.equal(visible, device_batch.seq_lens[~picked.sparse.bool()].long())
        last = [int(t) for t in torch.randint(0, model.info.vocab_size, (len(PROMPTS),), generator=gen)]
    assert kinds == {True, False}
    assert launches == ([len(PROMPTS)] * 5 if kernel else [])  # one launch a step, every row (most skipped)


def _tensors(pools: CachePools, name: str) -> list[torch.Tensor]:
    """An entry's tensors (a paged entry's scales too), e4m3 codes as bytes (CPU float8 has no compare or copy)."""
    if name in pools.state:
        return list(pools.state[name].values())
    paged = [*pools.kv[name], *pools.kv_scales.get(name, ())]
    return [t.view(torch.uint8) if t.dtype == torch.float8_e4m3fn else t for t in paged]


def test_a_table_too_narrow_for_a_sparse_row_selects_nothing(fp32_pair) -> None:
    """Two 4-token blocks hold two pools, which index_topk 8 keeps whole: every row dense (None), from the width."""
    model, _ = fp32_pair
    pools, tables, last, _ = _prefilled(model)
    indexer = model.stack.layers[1].self_attn.indexer
    batch = build_batch([SeqWork(1, tables[1][:3], 9, [last[1]])], pools)
    x, q_resid = torch.randn(1, model.config.hidden_size), torch.randn(1, model.config.q_lora_rank)
    assert isinstance(indexer(x, q_resid, batch), DeviceSelection)  # three blocks: a third pool may be seen
    batch = build_batch([SeqWork(0, tables[0][:2], 5, [last[0]])], pools)
    assert indexer(x, q_resid, batch) is None
