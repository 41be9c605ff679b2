"""MLA kernels (Triton interpreter, fp32) against their torch references: absorbed attention over a paged latent
cache, dense and over DSA-selected tokens, and the per-head absorption product."""

from __future__ import annotations

import pytest
import torch

from dgpp.kernels import dsa_index, head_matmul, mla_attention, quantized_write
from dgpp.kernels.head_matmul import head_matmul_ref, head_matmul_triton
from dgpp.kernels.mla_attention import mla_attention_ref, mla_attention_triton
from dgpp.nn import attention

LATENT, ROPE, HEADS, BS = 32, 8, 4, 4


def _cache(lens: list[int], seed: int, num_blocks: int = 200, rope_dim: int = ROPE):
    g = torch.Generator().manual_seed(seed)
    rows = len(lens)
    max_blocks = num_blocks // 5  # room for 160 tokens per row (at most 5 rows)
    latent = torch.randn(num_blocks, BS, 1, LATENT, generator=g)
    rope = torch.randn(num_blocks, BS, 1, rope_dim, generator=g)
    perm = torch.randperm(num_blocks, generator=g)
    tables = torch.full((rows, max_blocks), -1, dtype=torch.int32)
    for r in range(rows):
        tables[r] = perm[r * max_blocks : (r + 1) * max_blocks].int()
    q_lat = torch.randn(rows, HEADS, LATENT, generator=g)
    q_rot = torch.randn(rows, HEADS, rope_dim, generator=g)
    return q_lat, q_rot, latent, rope, tables, torch.tensor(lens, dtype=torch.int32)


def test_dense_rows_match_reference_with_padding_and_split_contexts():
    # a padding row, one-split rows and rows long enough to be merged over several splits
    q_lat, q_rot, latent, rope, tables, lens = _cache([0, 1, 29, 130, 7], seed=1)
    out = mla_attention_triton(q_lat, q_rot, latent, rope, tables, lens, 0.2)
    ref = mla_attention_ref(q_lat, q_rot, latent, rope, tables, lens, 0.2)
    assert torch.equal(out[0], torch.zeros_like(out[0]))
    torch.testing.assert_close(out, ref, rtol=1e-4, atol=1e-5)


def test_nope_rows_match_reference():
    """GLM-5.3-Flash's MLA has no rotated part: an empty rope cache and query (zero-width rows)."""
    q_lat, q_rot, latent, rope, tables, lens = _cache([1, 29, 130], seed=5, rope_dim=0)
    out = mla_attention_triton(q_lat, q_rot, latent, rope, tables, lens, 0.2)
    torch.testing.assert_close(
        out, mla_attention_ref(q_lat, q_rot, latent, rope, tables, lens, 0.2), rtol=1e-4, atol=1e-5
    )


def test_sparse_rows_attend_exactly_their_selection():
    q_lat, q_rot, latent, rope, tables, lens = _cache([40, 100, 12], seed=2)
    g = torch.Generator().manual_seed(3)
    topk = 24
    indices = torch.zeros(3, topk, dtype=torch.int32)
    indices[0] = torch.randperm(40, generator=g)[:topk].sort().values.int()
    indices[1] = torch.randperm(100, generator=g)[:topk].sort().values.int()
    sparse = torch.tensor([1, 1, 0], dtype=torch.int32)  # the last row is dense (fewer tokens than top-k)
    picked = lens.clone()
    picked[:2] = topk
    out = mla_attention_triton(q_lat, q_rot, latent, rope, tables, picked, 0.3, indices, sparse)
    ref = mla_attention_ref(q_lat, q_rot, latent, rope, tables, picked, 0.3, indices, sparse)
    torch.testing.assert_close(out, ref, rtol=1e-4, atol=1e-5)
    dense = mla_attention_ref(q_lat, q_rot, latent, rope, tables, lens, 0.3)
    assert not torch.allclose(out[1], dense[1], atol=1e-3)  # the selection is what the row attends
    torch.testing.assert_close(out[2], dense[2], rtol=1e-4, atol=1e-5)


def test_a_row_is_the_same_bits_alone_or_in_a_batch():
    q_lat, q_rot, latent, rope, tables, lens = _cache([5, 77, 130, 33], seed=4)
    together = mla_attention_triton(q_lat, q_rot, latent, rope, tables, lens, 0.25)
    for r in range(4):
        alone = mla_attention_triton(
            q_lat[r : r + 1], q_rot[r : r + 1], latent, rope, tables[r : r + 1], lens[r : r + 1], 0.25
        )
        assert torch.equal(alone[0], together[r])


def test_head_matmul_matches_reference_for_strided_weights():
    g = torch.Generator().manual_seed(5)
    x = torch.randn(19, 3, 40, generator=g)
    kv_b = torch.randn(3, 24 + 16, 40, generator=g)  # [H, nope + v, latent], as MLA views kv_b_proj
    w_uv_t = kv_b[:, 24:].transpose(1, 2)  # [H, latent, v], read in place
    out = head_matmul_triton(x, w_uv_t)
    torch.testing.assert_close(out, head_matmul_ref(x, w_uv_t), rtol=1e-4, atol=1e-5)
    assert torch.equal(head_matmul_triton(x[7:8], w_uv_t)[0], out[7])


@pytest.mark.parametrize("kv_dtype", ["auto", "fp8", "fp4"])
@torch.inference_mode()
def test_cuda_path_matches_the_torch_path_on_a_glm5_layer(tmp_path, monkeypatch, kv_dtype):
    """The CUDA wiring (``dgpp.nn.mla_cuda``: per-row tables, DSA selections as index lists, the absorption
    products), run here through the interpreter, against the layer's torch path on the same step: a mixed batch of
    prefill chunks (rows past index_topk 8 attend their selection), then a decode-only step; under ``kv_dtype`` fp8 /
    fp4 over quantized latents and e4m3 index keys with their row scales."""
    from dgpp.engine.runner import build_batch
    from dgpp.engine.work import SeqWork
    from dgpp.nn.dsa_cuda import device_selection
    from dgpp.nn.mla_cuda import absorbed_attention_cuda
    from dgpp.offline import make_pools
    from dgpp.startup.loading import load_model
    from dgpp_glm.testing_glm5 import build_tiny_glm_moe_dsa

    # stand in for CUDA: the kernels themselves run (interpreter), not their torch references; the cache writes too
    for module in (head_matmul, mla_attention, dsa_index, quantized_write, attention):
        monkeypatch.setattr(module, "use_triton", lambda x: True)
    model = load_model(build_tiny_glm_moe_dsa(tmp_path, seed=5))
    attn = model.model.layers[0].self_attn
    pools, blocks, _ = make_pools(model, [24, 24], 4, kv_dtype)
    latent_scale = pools.kv_scales[attn.cache_name][0] if kv_dtype != "auto" else None
    key_scale = pools.kv_scales[attn.indexer.cache_name][0] if kv_dtype != "auto" else None
    tables = [blocks.allocate(6), blocks.allocate(6)]
    g = torch.Generator().manual_seed(6)
    prompts = [torch.randint(3, 512, (n,), generator=g).tolist() for n in (13, 20)]
    steps = [
        [SeqWork(0, tables[0], 0, prompts[0][:9]), SeqWork(1, tables[1], 0, prompts[1])],
        [SeqWork(0, tables[0], 9, prompts[0][9:])],
        [SeqWork(0, tables[0], 13, [7]), SeqWork(1, tables[1], 20, [9])],
    ]
    for work in steps:
        batch = build_batch(work, pools)
        x = model.model.layers[0].input_layernorm(model.model.embed_tokens(batch.input_ids))
        query = attn.prepare(x, batch)
        selection = attn.indexer(x, query.q_resid, batch)
        ref = attn.attend(query, batch, selection)
        kv_b = attn.kv_b_proj.weight.view(attn.num_heads, -1, attn.kv_lora_rank)
        caches = batch.cache.kv[attn.cache_name]
        out = absorbed_attention_cuda(
            query.q_nope, query.q_rot, kv_b, *caches, batch, selection, attn.scale, latent_scale
        )
        ours = attn.o_proj(out.flatten(1))
        torch.testing.assert_close(ours, ref, rtol=1e-4, atol=1e-5)
        # the same rows with the selection in its device form (what the CUDA indexer hands on): the same bits
        ix = attn.indexer
        q = ix.rotary(
            batch.positions, ix.wq_b(query.q_resid).view(x.shape[0], ix.num_heads, -1), x[:, None, :16]
        )[0]
        weights = ix.weights_proj(x.float()) * ix.num_heads**-0.5
        on_device = device_selection(
            q, weights, batch.cache.kv[ix.cache_name][0], batch, ix.topk, ix.head_dim**-0.5, key_scale
        )
        again = absorbed_attention_cuda(
            query.q_nope, query.q_rot, kv_b, *caches, batch, on_device, attn.scale, latent_scale
        )
        assert torch.equal(again, out)
    assert any(s is not None for s in selection)  # the decode rows attend a sparse selection


def test_index_scores_kernel_matches_reference_and_selects_like_the_torch_indexer():
    from dgpp.kernels.dsa_index import index_scores_ref, index_scores_triton, select_top_k
    from dgpp.nn.dsa import top_k_lowest_on_ties

    g = torch.Generator().manual_seed(7)
    heads, dim, topk = 16, 32, 12
    k_cache = torch.randn(60, BS, 1, dim, generator=g)
    tables = torch.randperm(60, generator=g)[:36].view(3, 12).int()  # 48 tokens of room: the grid overhangs
    lens = torch.tensor([0, 9, 41], dtype=torch.int32)
    q = torch.randn(3, heads, dim, generator=g)
    w = torch.randn(3, heads, generator=g)
    ours = index_scores_triton(q, w, k_cache, tables, lens, dim**-0.5)
    ref = index_scores_ref(q, w, k_cache, tables, lens, dim**-0.5)
    assert torch.isinf(ours[0]).all() and torch.isinf(ours[1, 9:]).all()
    torch.testing.assert_close(ours, ref, rtol=1e-5, atol=1e-5)
    positions, counts = select_top_k(ours, lens, topk)
    assert counts.tolist() == [0, 9, 12]
    assert positions[1, :9].tolist() == list(range(9))  # fewer tokens than top-k: all of them, in order
    assert positions[2].tolist() == top_k_lowest_on_ties(ours[2, :41], topk).tolist()
    assert ours.shape == (3, 48)


def test_index_scores_tiles_past_a_rows_tokens_are_minus_inf_and_the_rest_unchanged():
    """A table much wider than the rows' tokens (a decode graph's table spans the pool): the 64-token tiles wholly
    past a row's length are skipped, -inf like the reference, and every tile with tokens scores as before."""
    from dgpp.kernels.dsa_index import _BLOCK_T, index_scores_ref, index_scores_triton

    g = torch.Generator().manual_seed(8)
    heads, dim, blocks = 16, 32, 80
    k_cache = torch.randn(blocks, BS, 1, dim, generator=g)
    tables = torch.stack([torch.randperm(blocks, generator=g) for _ in range(4)]).int()
    width = blocks * BS
    lens = torch.tensor(
        [0, _BLOCK_T - 1, _BLOCK_T + 1, width], dtype=torch.int32
    )  # 0, 1, 2 and every tile live
    q, w = torch.randn(4, heads, dim, generator=g), torch.randn(4, heads, generator=g)
    ours = index_scores_triton(q, w, k_cache, tables, lens, dim**-0.5)
    torch.testing.assert_close(
        ours, index_scores_ref(q, w, k_cache, tables, lens, dim**-0.5), rtol=1e-5, atol=1e-5
    )
    for row, n in enumerate(lens.tolist()):
        assert torch.isinf(ours[row, n:]).all() and torch.isfinite(ours[row, :n]).all()


@pytest.mark.parametrize("radix_pick", [False, True], ids=["select_top_k", "top_k_rows"])
@torch.inference_mode()
def test_device_selection_picks_what_the_torch_indexer_picks(tmp_path, monkeypatch, radix_pick):
    """The CUDA indexer's selection path (``dgpp.nn.dsa_cuda``, here with the reference scorer) against the torch
    indexer on the same step: prefill chunks (rows past index_topk 8 select) and a decode step; the picks by the
    torch top-k and by the Triton per-row radix select that CUDA takes (interpreter)."""
    import dgpp.nn.dsa_cuda as dsa_cuda

    monkeypatch.setattr(dsa_cuda, "use_triton", lambda x: radix_pick)
    from dgpp.engine.runner import build_batch
    from dgpp.engine.work import SeqWork
    from dgpp.nn.dsa_cuda import device_selection
    from dgpp.offline import make_pools
    from dgpp.startup.loading import load_model
    from dgpp_glm.testing_glm5 import build_tiny_glm_moe_dsa

    model = load_model(build_tiny_glm_moe_dsa(tmp_path, seed=9))
    layer = model.model.layers[0]
    ix = layer.self_attn.indexer
    pools, blocks, _ = make_pools(model, [24, 24], 4)
    tables = [blocks.allocate(6), blocks.allocate(6)]
    g = torch.Generator().manual_seed(10)
    prompts = [torch.randint(3, 512, (n,), generator=g).tolist() for n in (14, 21)]
    for work in (
        [SeqWork(0, tables[0], 0, prompts[0]), SeqWork(1, tables[1], 0, prompts[1][:6])],
        [SeqWork(1, tables[1], 6, prompts[1][6:])],
        [SeqWork(0, tables[0], 14, [5]), SeqWork(1, tables[1], 21, [6])],
    ):
        batch = build_batch(work, pools)
        x = layer.input_layernorm(model.model.embed_tokens(batch.input_ids))
        q_resid = layer.self_attn.prepare(x, batch).q_resid
        torch_rows = ix(x, q_resid, batch)
        q = ix.rotary(
            batch.positions, ix.wq_b(q_resid).view(x.shape[0], ix.num_heads, ix.head_dim), x[:, None, :16]
        )[0]
        weights = ix.weights_proj(x.float()) * ix.num_heads**-0.5
        k_cache = batch.cache.kv[ix.cache_name][0]
        picks = device_selection(q, weights, k_cache, batch, ix.topk, ix.head_dim**-0.5)
        for r, want in enumerate(torch_rows):
            n = int(picks.counts[r])
            got = picks.positions[r, :n].tolist()
            visible = int(batch.positions[r]) + 1
            assert got == (list(range(visible)) if want is None else want.tolist())


@pytest.mark.parametrize("dim", [128, 80])
def test_index_scores_sum_every_depth_slice_of_the_dot(dim):
    """The kernel's per-head dot runs in 32-deep slices chained through its accumulator: 128 deep is four of them,
    80 deep three with a masked tail. Every slice counts (dropping or repeating one would be far off here)."""
    from dgpp.kernels.dsa_index import _BLOCK_C, index_scores_ref, index_scores_triton

    assert dim > _BLOCK_C
    g = torch.Generator().manual_seed(dim)
    heads = 8
    k_cache = torch.randn(6, BS, 1, dim, generator=g)
    tables = torch.randperm(6, generator=g).view(2, 3).int()
    lens = torch.tensor([5, 3 * BS - 2], dtype=torch.int32)
    q, w = torch.randn(2, heads, dim, generator=g), torch.randn(2, heads, generator=g)
    ours = index_scores_triton(q, w, k_cache, tables, lens, dim**-0.5)
    torch.testing.assert_close(
        ours, index_scores_ref(q, w, k_cache, tables, lens, dim**-0.5), rtol=1e-5, atol=1e-5
    )
    first_slice = index_scores_ref(q[..., :_BLOCK_C], w, k_cache[..., :_BLOCK_C], tables, lens, dim**-0.5)
    assert (ours - first_slice)[torch.isfinite(ours)].abs().max() > 1e-2


def test_index_scores_scale_the_weights_in_the_kernel():
    """bf16 weights times ``weight_scale`` read in the kernel: the scores of ``weights.float() * weight_scale``."""
    from dgpp.kernels.dsa_index import index_scores_triton

    g = torch.Generator().manual_seed(9)
    heads, dim = 16, 32
    k_cache = torch.randn(4, BS, 1, dim, generator=g)
    tables = torch.arange(4).view(1, 4).int()
    lens = torch.tensor([3 * BS + 1], dtype=torch.int32)
    q, w = torch.randn(1, heads, dim, generator=g), torch.randn(1, heads, generator=g).bfloat16()
    scaled = index_scores_triton(q, w, k_cache, tables, lens, dim**-0.5, weight_scale=heads**-0.5)
    assert torch.equal(
        scaled, index_scores_triton(q, w.float() * heads**-0.5, k_cache, tables, lens, dim**-0.5)
    )
    unscaled = index_scores_triton(q, w, k_cache, tables, lens, dim**-0.5)
    assert not torch.equal(scaled, unscaled)
