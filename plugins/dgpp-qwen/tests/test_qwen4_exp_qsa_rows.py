"""qwen4_exp's QSA per-row device path (``dgpp_qwen.layers.qsa_rows``; Triton's interpreter on CPU tensors, fp32
tiny checkpoint: compress_ratio 4, block_topk 4, dense limit 19) against the row-by-row reference:

- the block keys stored as blocks complete equal ``_block_keys`` recomputed from the raw keys, bit for bit, for
  blocks smaller and larger than the pool's blocks;
- each row's selected tokens equal ``_select`` (sparse rows) or every visible token (dense rows), ties to the lower
  block included;
- the attention over them matches ``attend_selected`` within fp32 rounding (and not the dense answer), with the
  same bits solo and batched.
"""

from __future__ import annotations

import os

import pytest
import torch

from dgpp.engine.runner import ModelRunner, build_batch
from dgpp.engine.work import SeqWork
from dgpp.nn.attention import gather_context
from dgpp.nn.compressed_decode import entry_table
from dgpp.step.pools import CachePools
from dgpp_qwen.layers import qsa_rows
from dgpp_qwen.layers.qsa import attend_selected
from dgpp_qwen.layers.qsa_rows import row_attention, row_selection

pytestmark = pytest.mark.skipif(
    os.environ.get("TRITON_INTERPRET") != "1", reason="the device path's kernels run in Triton's interpreter"
)

PROMPTS = (9, 45, 24)  # dense, sparse and sparse rows; 45 ends inside a block
CONTEXT = 64  # tokens of table per sequence


@pytest.fixture(scope="module")
def model():
    from dgpp.bench.launches import tiny_model

    return tiny_model("qwen4_exp", torch.float32)


def _prefilled(model, block_size: int):
    blocks = CONTEXT // block_size
    pools = CachePools(model.cache_spec(), len(PROMPTS) * blocks, block_size, len(PROMPTS))
    tables = [list(range(i * blocks, (i + 1) * blocks)) for i in range(len(PROMPTS))]
    gen = torch.Generator().manual_seed(4)
    prompts = [torch.randint(1, model.info.vocab_size, (n,), generator=gen).tolist() for n in PROMPTS]
    runner = ModelRunner(model, pools)
    # the longest prompt in two chunks: its blocks are completed by two steps
    runner.step([SeqWork(1, tables[1], 0, prompts[1][:18])])
    runner.step(
        [SeqWork(0, tables[0], 0, prompts[0]), SeqWork(1, tables[1], 18, prompts[1][18:])]
        + [SeqWork(2, tables[2], 0, prompts[2])]
    )
    return runner, pools, tables


def _qsa_layers(model):
    return [layer.self_attn for layer in model.model.layers if layer.layer_type != "linear_attention"]


def _decode_batch(model, pools, tables, rows=range(len(PROMPTS))):
    work = [SeqWork(i, tables[i], PROMPTS[i], [7 + i]) for i in rows]
    return build_batch(work, pools)


@pytest.mark.parametrize("block_size", [16, 2])  # 4 block keys per pool block, or one per 2 pool blocks
def test_stored_block_keys_are_the_recomputed_ones(model, block_size) -> None:
    from dgpp.bench.launches import cuda_path

    runner, pools, tables = _prefilled(model, block_size)
    with (
        cuda_path()
    ):  # one decode step on the device path: the 24-token row completes nothing, 9 and 45 a block
        runner.step([SeqWork(i, tables[i], n, [5]) for i, n in enumerate(PROMPTS)])
    for attn in _qsa_layers(model):
        indexer = attn.indexer
        raw, stored = pools.kv[indexer.cache_name][0], pools.kv[indexer.blocks_cache_name][0]
        assert stored.shape[1] == max(1, block_size // 4)
        for i, n in enumerate(PROMPTS):
            length = n + 1
            table = torch.tensor(tables[i], dtype=torch.int32)
            expected = indexer._block_keys(gather_context(raw, table, length)[:, 0], torch.arange(length))
            column = entry_table(table[None], 4, block_size)[0]
            per = stored.shape[1]
            entries = torch.arange(length // 4)
            ours = stored[column[entries // per].long(), entries % per, 0]
            assert expected.shape[0] == length // 4 and torch.equal(ours, expected), (attn, i)
            assert not stored[column[length // 4 // per].long(), length // 4 % per].any()  # not complete yet


def _expected_tokens(indexer, query: torch.Tensor, block_keys: torch.Tensor, position: int) -> torch.Tensor:
    if position + 1 <= indexer.dense_limit():
        return torch.arange(position + 1)
    return indexer._select(query, block_keys, position)


@pytest.mark.parametrize("queries", ["random", "tied"])
def test_each_row_selects_the_reference_tokens(model, queries) -> None:
    """``tied``: index queries of zeros score every block 0, so the picks are the lowest blocks."""
    runner, pools, tables = _prefilled(model, 16)
    attn = _qsa_layers(model)[0]
    indexer = attn.indexer
    batch = _decode_batch(model, pools, tables)
    gen = torch.Generator().manual_seed(5)
    x = torch.randn(len(PROMPTS), model.cfg.base.hidden_size, generator=gen)
    index_q = indexer(x, batch)
    if queries == "tied":
        index_q = torch.zeros_like(index_q)
    selection = row_selection(indexer, index_q, batch)
    assert selection is not None
    positions, counts = selection
    reference = indexer.select(index_q, batch)  # the CPU's row-by-row masks
    raw = pools.kv[indexer.cache_name][0]
    for r, n in enumerate(PROMPTS):
        table = batch.block_tables[r]
        block_keys = indexer._block_keys(gather_context(raw, table, n + 1)[:, 0], torch.arange(n + 1))
        want = _expected_tokens(indexer, index_q[r], block_keys, n)
        ours = positions[r, : int(counts[r])].long()
        assert torch.equal(ours, want), r
        mask = reference[r]
        assert torch.equal(ours, torch.arange(n + 1) if mask is None else mask[0].nonzero()[:, 0])
        if queries == "tied" and n + 1 > indexer.dense_limit():
            assert torch.equal(ours[:16], torch.arange(16))  # blocks 0..3: ties to the lower block
    assert [int(c) for c in counts] == [10, 16 + 2, 16 + 1]


def test_attention_over_the_selection_matches_the_reference_and_rows_keep_their_bits(
    model, monkeypatch
) -> None:
    runner, pools, tables = _prefilled(model, 16)
    attn = _qsa_layers(model)[1]
    indexer = attn.indexer
    gen = torch.Generator().manual_seed(6)
    x = torch.randn(len(PROMPTS), model.cfg.base.hidden_size, generator=gen)
    q = torch.randn(len(PROMPTS), attn.num_heads, attn.head_dim, generator=gen)
    batch = _decode_batch(model, pools, tables)
    index_q = indexer(x, batch)
    kv = pools.kv[attn.attn.cache_name]
    out = row_attention(indexer, q, index_q, kv, batch, attn.attn.scale)
    selection = indexer.select(index_q, batch)
    for r, n in enumerate(PROMPTS):
        keys, values = (gather_context(c, batch.block_tables[r], n + 1) for c in kv)
        want = attend_selected(q[r : r + 1], keys, values, n, selection[r], attn.attn.scale)
        torch.testing.assert_close(out[r : r + 1], want, rtol=1e-5, atol=1e-6)
        if selection[r] is not None:  # a sparse row: attending every token gives another answer
            dense = attend_selected(q[r : r + 1], keys, values, n, None, attn.attn.scale)
            assert not torch.allclose(out[r : r + 1], dense, rtol=1e-3, atol=1e-4), r
    for r in range(len(PROMPTS)):
        solo = _decode_batch(model, pools, tables, rows=[r])
        alone = row_attention(indexer, q[r : r + 1], index_q[r : r + 1], kv, solo, attn.attn.scale)
        assert torch.equal(alone[0], out[r]), r
    # a long prompt's rows go in several calls: the same bits
    monkeypatch.setattr(qsa_rows, "rows_per_call", lambda heads, v_dim: 2)
    assert torch.equal(row_attention(indexer, q, index_q, kv, batch, attn.attn.scale), out)


def test_prompt_rows_on_the_device_path_match_the_cpu_path(model) -> None:
    """A 45-token prompt (sparse rows from position 19), in one step and in two chunks: every row's logits on the
    device path within fp32 rounding of the CPU's row-by-row reference."""
    from contextlib import nullcontext

    from dgpp.bench.launches import cuda_path

    gen = torch.Generator().manual_seed(7)
    prompt = torch.randint(1, model.info.vocab_size, (45,), generator=gen).tolist()
    table = list(range(CONTEXT // 16))

    def run(chunks: list[int], device_path: bool) -> torch.Tensor:
        runner = ModelRunner(model, CachePools(model.cache_spec(), len(table), 16, 1))
        out, start = [], 0
        with cuda_path() if device_path else nullcontext():
            for n in chunks:
                work = SeqWork(0, table, start, prompt[start : start + n], every_row_logits=True)
                out.append(runner.step([work]))
                start += n
        return torch.cat(out)

    cpu = run([45], False)
    for chunks in ([45], [18, 27]):
        ours = run(chunks, True)
        torch.testing.assert_close(ours, cpu, rtol=1e-5, atol=1e-5 * float(cpu.abs().max()))
