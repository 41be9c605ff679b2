"""GLM-5.3's DSA decode with graph-style inputs (a block table padded to the whole pool, lengths as device
tensors) against the eager step's: each row's dense/sparse choice, its index scores and its top-k follow its own
length, so the attention output is the same bits; the selection never picks a position past a row's length."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from dgpp.kernels import dsa_index, head_matmul, mla_attention
from dgpp.kernels.dsa_index import select_top_k
from dgpp.nn.dsa import top_k_lowest_on_ties


def test_select_top_k_is_the_stable_sort_s_pick_with_ties_to_the_lower_position():
    g = torch.Generator().manual_seed(1)
    scores = torch.randint(0, 5, (6, 300), generator=g).float()  # many exact ties
    lens = torch.tensor([0, 3, 16, 17, 150, 300], dtype=torch.int32)
    scores[torch.arange(300)[None, :] >= lens[:, None]] = float("-inf")
    positions, counts = select_top_k(scores, lens, 16)
    assert counts.tolist() == [0, 3, 16, 16, 16, 16]
    for r, n in enumerate(lens.tolist()):
        want = list(range(min(n, 16))) if n <= 16 else top_k_lowest_on_ties(scores[r, :n], 16).tolist()
        assert positions[r, : counts[r]].tolist() == want


def test_padding_past_a_rows_length_never_enters_its_selection():
    """Whatever a pool-wide table's padding scores (here higher than every real token), the picks are those of
    the row's own tokens."""
    g = torch.Generator().manual_seed(2)
    lens = torch.tensor([5, 40, 90], dtype=torch.int32)
    scores = torch.randn(3, 128, generator=g)
    tight = scores.masked_fill(torch.arange(128)[None, :] >= lens[:, None], float("-inf"))
    leaky = scores.masked_fill(torch.arange(128)[None, :] >= lens[:, None], 1e9)
    want = select_top_k(tight, lens, 16)
    got = select_top_k(leaky, lens, 16)
    for r, n in enumerate(want[1].tolist()):
        assert got[0][r, :n].tolist() == want[0][r, :n].tolist()
    assert torch.equal(got[1], want[1])


def _graph_style(batch, width_blocks: int, filler: torch.Tensor):
    """``batch`` as a decode graph feeds it: the block table widened to ``width_blocks`` (the pool), the columns
    past each row's blocks holding ``filler`` block ids (live blocks of other rows: a leak would read real keys)."""
    rows, used = batch.block_tables.shape
    padded = filler[:width_blocks].repeat(rows, 1).to(batch.block_tables.dtype)
    padded[:, :used] = batch.block_tables
    return dataclasses.replace(batch, block_tables=padded)


@torch.inference_mode()
@pytest.mark.parametrize("kv_dtype", ["auto", "fp4"])
def test_graph_style_decode_step_equals_the_eager_step(tmp_path, monkeypatch, kv_dtype):
    """Decode rows shorter (5 tokens) and longer (14, 21) than index_topk 8: with the table padded to the pool the
    selection and the attention output equal the eager step's bit for bit, and a short row stays dense; also over
    fp4 latents and e4m3 index keys (``engine.kv_dtype: fp4``)."""
    from dgpp.engine.runner import build_batch
    from dgpp.engine.work import SeqWork
    from dgpp.nn.dsa_cuda import device_selection
    from dgpp.nn.mla_cuda import absorbed_attention_cuda
    from dgpp.offline import make_pools
    from dgpp.startup.loading import load_model
    from dgpp_glm.testing_glm5 import build_tiny_glm_moe_dsa

    for module in (
        head_matmul,
        mla_attention,
        dsa_index,
    ):  # the kernels the graph runs, under the interpreter
        monkeypatch.setattr(module, "use_triton", lambda x: True)
    model = load_model(build_tiny_glm_moe_dsa(tmp_path, seed=5))
    attn = model.model.layers[0].self_attn
    ix = attn.indexer
    pools, blocks, _ = make_pools(model, [8, 24, 24], 4, kv_dtype)
    latent_scale, key_scale = (
        (pools.kv_scales[attn.cache_name][0], pools.kv_scales[ix.cache_name][0])
        if pools.kv_scales
        else (None, None)
    )
    tables = [blocks.allocate(2), blocks.allocate(6), blocks.allocate(6)]
    g = torch.Generator().manual_seed(6)
    prompts = [torch.randint(3, 512, (n,), generator=g).tolist() for n in (5, 14, 21)]
    kv_b = attn.kv_b_proj.weight.view(attn.num_heads, -1, attn.kv_lora_rank)

    def step(work, graph: bool):
        batch = build_batch(work, pools)
        x = model.model.layers[0].input_layernorm(model.model.embed_tokens(batch.input_ids))
        query = attn.prepare(x, batch)
        torch_rows = ix(x, query.q_resid, batch)  # writes the step's index keys; the torch indexer's picks
        if graph:
            batch = _graph_style(batch, 14, torch.tensor(tables[2] + tables[1] + tables[0]))
        q = ix.rotary(
            batch.positions, ix.wq_b(query.q_resid).view(x.shape[0], ix.num_heads, -1), x[:, None, :16]
        )[0]
        weights = ix.weights_proj(x.float()) * ix.num_heads**-0.5
        picks = device_selection(
            q, weights, batch.cache.kv[ix.cache_name][0], batch, ix.topk, ix.head_dim**-0.5, key_scale
        )
        caches = batch.cache.kv[attn.cache_name]
        out = absorbed_attention_cuda(
            query.q_nope, query.q_rot, kv_b, *caches, batch, picks, attn.scale, latent_scale
        )
        return picks, out, torch_rows

    prefill = [SeqWork(i, tables[i], 0, prompts[i][:-1]) for i in range(3)]
    step(prefill, graph=False)
    decode = [SeqWork(i, tables[i], len(prompts[i]) - 1, prompts[i][-1:]) for i in range(3)]
    eager, eager_out, torch_rows = step(decode, graph=False)
    graph, graph_out, _ = step(decode, graph=True)
    assert graph.sparse.tolist() == [0, 1, 1]  # each row's own length decides, not the table's width
    assert graph.as_rows()[0] is None and torch_rows[0] is None
    for r in (1, 2):
        assert graph.as_rows()[r].tolist() == eager.as_rows()[r].tolist() == torch_rows[r].tolist()
    assert torch.equal(graph_out, eager_out)

    # a step of short rows only: eager's table is no wider than index_topk (dense, no selection at all)
    short = [SeqWork(0, tables[0], 5, [11])]
    none_eager, short_eager, _ = step(short, graph=False)
    short_graph_sel, short_graph, _ = step(short, graph=True)
    assert none_eager is None and short_graph_sel.as_rows() == [None]
    assert torch.equal(short_graph, short_eager)


@pytest.mark.parametrize("k", [1, 7])
def test_select_top_k_handles_a_width_at_k(k):
    scores = torch.tensor([[3.0, 1.0, 3.0, 2.0, 0.0, 5.0, 1.0]])
    positions, counts = select_top_k(scores, torch.tensor([7], dtype=torch.int32), k)
    assert positions[0].tolist() == top_k_lowest_on_ties(scores[0], k).tolist() and counts.tolist() == [k]
