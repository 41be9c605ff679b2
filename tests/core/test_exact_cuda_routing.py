"""Row routing for exactness on CUDA (dgpp.step.route, dgpp.nn.exact), checked on the CPU: which kernel a row takes is a
function of the row alone, and the canonical kernels (Triton interpreter) give a row the same bits whatever
the row count / batch / table width. The GPU twin: tests/perf/check_exact_cuda.py."""

from __future__ import annotations

import pytest
import torch

from dgpp.kernels.paged_attention import paged_decode_attention_ref
from dgpp.nn.exact import routing as exact_cuda
from dgpp.nn.exact.attention import expand_rows, paged_decode_attention_fixed
from dgpp.nn.exact.gemm import fixed_order_gate_up_silu, fixed_order_linear
from dgpp.nn.exact.recurrent import plan_rows
from dgpp.policy import overriding
from dgpp.step.route import in_flight, route_for, step_route


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_fixed_order_linear_rows_do_not_depend_on_the_row_count(dtype):
    torch.manual_seed(0)
    ws = [torch.randn(n, 64, dtype=dtype) for n in (32, 16, 16)]
    x = torch.randn(70, 64, dtype=dtype)
    solo = torch.cat([torch.cat(fixed_order_linear(x[r : r + 1], ws), 1) for r in range(70)])
    for m in (2, 3, 17, 64, 65, 70):
        assert torch.equal(torch.cat(fixed_order_linear(x[:m], ws), 1), solo[:m]), m
    if (
        dtype == torch.float32
    ):  # the interpreter's bf16 dot is wrong (tests/conftest.py); the GPU check covers it
        ref = torch.cat([torch.nn.functional.linear(x, w) for w in ws], 1)
        torch.testing.assert_close(solo, ref, rtol=1e-4, atol=1e-4)


def test_fixed_order_gate_up_silu_rows_and_values():
    torch.manual_seed(1)
    wg, wu, x = torch.randn(32, 64), torch.randn(32, 64), torch.randn(66, 64)
    solo = torch.cat([fixed_order_gate_up_silu(x[r : r + 1], wg, wu) for r in range(66)])
    assert torch.equal(fixed_order_gate_up_silu(x, wg, wu), solo)
    ref = torch.nn.functional.silu(x @ wg.T) * (x @ wu.T)
    torch.testing.assert_close(solo, ref, rtol=1e-4, atol=1e-4)


def test_fixed_order_linear_refuses_bad_shapes_by_name():
    with pytest.raises(ValueError, match="fixed_order_linear"):
        fixed_order_linear(torch.randn(2, 64), [torch.randn(10, 64)])


def _paged(seed: int, seqs: int, ctx: int, bs: int = 16):
    g = torch.Generator().manual_seed(seed)
    per = -(-ctx // bs)
    kc, vc = (
        torch.randn(seqs * per + 2, bs, 2, 32, generator=g),
        torch.randn(seqs * per + 2, bs, 2, 32, generator=g),
    )
    tables = torch.randperm(seqs * per + 2, generator=g)[: seqs * per].view(seqs, per).int()
    return kc, vc, tables


def test_fixed_split_decode_attention_row_independent_of_batch_and_table_width():
    kc, vc, tables = _paged(2, 5, 300)
    q = torch.randn(5, 4, 32)
    lens = torch.tensor([300, 7, 64, 65, 190], dtype=torch.int32)
    solo = torch.cat(
        [
            paged_decode_attention_fixed(
                q[r : r + 1], kc, vc, tables[r : r + 1], lens[r : r + 1], 0.2, splits=4
            )
            for r in range(5)
        ]
    )
    assert torch.equal(paged_decode_attention_fixed(q, kc, vc, tables, lens, 0.2, splits=4), solo)
    wide = torch.cat([tables, tables[:, :3]], 1)
    assert torch.equal(paged_decode_attention_fixed(q, kc, vc, wide, lens, 0.2, splits=4), solo)
    ref = paged_decode_attention_ref(q, kc, vc, tables, lens, 0.2)
    torch.testing.assert_close(solo, ref, rtol=1e-4, atol=1e-4)


def test_verify_rows_expand_to_the_decode_rows_of_their_positions():
    kc, vc, tables = _paged(3, 2, 200)
    # sequence 0: 3 verify rows ending at 150 tokens; sequence 1: one decode row at 90
    index, rows_tables, seq_lens = expand_rows(tables, [150, 90], [3, 1])
    assert index.tolist() == [0, 0, 0, 1] and seq_lens.tolist() == [148, 149, 150, 90]
    q = torch.randn(4, 4, 32)
    together = paged_decode_attention_fixed(q, kc, vc, rows_tables, seq_lens, 0.3, splits=4)
    for r, (s, n) in enumerate([(0, 148), (0, 149), (0, 150), (1, 90)]):
        alone = paged_decode_attention_fixed(
            q[r : r + 1], kc, vc, tables[s : s + 1], torch.tensor([n], dtype=torch.int32), 0.3, splits=4
        )
        assert torch.equal(together[r : r + 1], alone), r
    assert expand_rows(tables, [0], [1])[2].tolist() == [0]  # a graph padding row stays empty


def test_route_is_a_function_of_each_row_alone():
    from types import SimpleNamespace

    cuda_ids = SimpleNamespace(
        is_cuda=True, device="cpu"
    )  # a CUDA step's input ids, as the engine routes them
    decode = route_for([1, 1, 1], "cpu")
    assert decode.per_row and decode.all_exact
    mixed = route_for([1, 5, 1], "cpu")
    assert not mixed.per_row and mixed.exact_seqs == (0, 2) and mixed.bulk_seqs == (1,)
    assert mixed.exact_rows.tolist() == [0, 6] and mixed.bulk_ranges == ((1, 6),)
    assert route_for([3, 1, 2], "cpu").bulk_ranges == ((0, 3), (4, 6))
    assert route_for([4, 9], "cpu").none_exact
    with overriding(batch_invariant=False):
        assert step_route(cuda_ids, [4, 2, 1], verify=True).per_row
        assert not step_route(cuda_ids, [4, 2, 1]).per_row
    with overriding(batch_invariant=True):
        assert step_route(cuda_ids, [7, 1]).per_row


def test_route_rows_merges_canonical_and_bulk_rows():
    route = route_for([1, 3, 1, 2], "cpu")
    x = torch.arange(7.0)[:, None].repeat(1, 2)
    seen = {}

    def tag(name, value):
        def fn(rows):
            seen.setdefault(name, []).append(rows[:, 0].tolist())
            return [torch.full((rows.shape[0], 1), value)]

        return fn

    with in_flight(route):
        out = exact_cuda.route_rows(x, tag("exact", 1.0), tag("bulk", 2.0))[0]
        assert out[:, 0].tolist() == [1.0, 2.0, 2.0, 2.0, 1.0, 2.0, 2.0]
        # decode rows in one canonical call; each prefill chunk in a call of its own
        assert seen == {"exact": [[0.0, 4.0]], "bulk": [[1.0, 2.0, 3.0], [5.0, 6.0]]}
        # a row set of its own (logits rows): all canonical
        assert exact_cuda.route_rows(x[:2], tag("exact", 1.0), tag("bulk", 2.0))[0][:, 0].tolist() == [
            1.0,
            1.0,
        ]


def test_recurrent_plan_steps_rows_like_plain_decode():
    from types import SimpleNamespace

    batch = SimpleNamespace(
        input_ids=torch.zeros(7, dtype=torch.long),
        q_lens_cpu=[3, 1, 3],
        context_lens_cpu=[10, 4, 0],
        state_slots=torch.tensor([5, 6, 7]),
    )
    plan = plan_rows(batch, route_for(batch.q_lens_cpu, "cpu", per_row=True))  # a verify step
    steps = [(r.tolist(), s.tolist(), f.tolist()) for r, s, f in plan.steps]
    assert steps == [
        ([0, 3, 4], [0, 1, 2], [False, False, True]),
        ([1, 5], [0, 2], [False, False]),
        ([2, 6], [0, 2], [False, False]),
    ]
    assert plan.bulk == ()
    mixed = plan_rows(batch, route_for(batch.q_lens_cpu, "cpu"))
    assert [(r.tolist(), s.tolist()) for r, s, _ in mixed.steps] == [([3], [1])]
    assert mixed.bulk == ((0, 3, 0, 10), (4, 7, 2, 0))


def test_recurrent_plan_gated_delta_equals_the_token_by_token_definition():
    from types import SimpleNamespace

    from dgpp.kernels.gated_delta import gated_delta_ref

    torch.manual_seed(4)
    t, hk, hv, dk, dv = 6, 1, 2, 16, 16
    q, k = torch.randn(t, hk, dk), torch.randn(t, hk, dk)
    v, g, beta = torch.randn(t, hv, dv), -torch.rand(t, hv), torch.rand(t, hv)
    pool = torch.randn(3, hv, dk, dv)
    batch = SimpleNamespace(
        input_ids=torch.zeros(t, dtype=torch.long),
        q_lens_cpu=[4, 2],
        context_lens_cpu=[5, 3],
        state_slots=torch.tensor([0, 2]),
    )
    ref_pool = pool.clone()
    ref = gated_delta_ref(
        q, k, v, g, beta, ref_pool, batch.state_slots, torch.tensor([0, 4, 6]), torch.tensor([False, False])
    )
    plan = plan_rows(batch, route_for(batch.q_lens_cpu, "cpu", per_row=True))  # a verify step
    out = plan.delta(q, k, v, g, beta, pool, 64)
    torch.testing.assert_close(out, ref, rtol=1e-4, atol=1e-4)
    torch.testing.assert_close(pool, ref_pool, rtol=1e-4, atol=1e-4)


def test_recurrent_plan_mixed_and_verify_match_the_definition():
    from types import SimpleNamespace

    from dgpp.kernels.causal_conv1d import conv_decode_ref
    from dgpp.kernels.gated_delta import gated_delta_ref

    torch.manual_seed(5)
    t, hk, hv, dk, dv = 7, 1, 2, 16, 16
    q, k = torch.randn(t, hk, dk), torch.randn(t, hk, dk)
    v, g, beta = torch.randn(t, hv, dv), -torch.rand(t, hv), torch.rand(t, hv)
    batch = SimpleNamespace(
        input_ids=torch.zeros(t, dtype=torch.long),
        q_lens_cpu=[4, 1, 2],
        context_lens_cpu=[5, 3, 0],
        state_slots=torch.tensor([0, 2, 1]),
    )
    qsl, fresh = torch.tensor([0, 4, 5, 7]), torch.tensor([False, False, True])
    for verify in (False, True):
        pool = torch.randn(3, hv, dk, dv)
        ref_pool = pool.clone()
        ref = gated_delta_ref(q, k, v, g, beta, ref_pool, batch.state_slots, qsl, fresh)
        plan = plan_rows(batch, route_for(batch.q_lens_cpu, "cpu", per_row=verify))
        assert len(plan.bulk) == (0 if verify else 2)
        torch.testing.assert_close(plan.delta(q, k, v, g, beta, pool, 64), ref, rtol=1e-4, atol=1e-4)
        torch.testing.assert_close(pool, ref_pool, rtol=1e-4, atol=1e-4)
    # the conv: row-by-row steps == the decode reference fed one token at a time
    x, weight, conv = torch.randn(t, 8), torch.randn(8, 4), torch.randn(3, 3, 8)
    plan = plan_rows(batch, route_for(batch.q_lens_cpu, "cpu", per_row=True))  # a verify step
    ref_conv, ref_rows = conv.clone(), torch.empty(t, 8)
    for j in range(4):
        for i, (start, n) in enumerate(zip((0, 4, 5), batch.q_lens_cpu, strict=True)):
            if j < n:
                ref_rows[start + j] = conv_decode_ref(
                    x[start + j : start + j + 1],
                    weight,
                    None,
                    ref_conv,
                    batch.state_slots[i : i + 1],
                    torch.tensor([j == 0 and i == 2]),
                )[0]
    torch.testing.assert_close(plan.conv(x, weight, None, conv), ref_rows, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(conv, ref_conv, rtol=1e-5, atol=1e-5)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU (TRITON_INTERPRET=0)")
@pytest.mark.parametrize("kind", ["qwen3", "qwen3_moe"])
def test_batch_invariant_chunked_prefill_equals_one_shot_on_cuda(kind, tmp_path):
    import json

    from dgpp.family import LoadContext
    from dgpp.testing import conformance as conf
    from dgpp.testing.builders import build_tiny_checkpoint
    from dgpp_qwen.loader import load_model

    path = build_tiny_checkpoint(kind, tmp_path / kind, dtype=torch.bfloat16, seed=31)
    hf = json.loads((path / "config.json").read_text())
    model = load_model(LoadContext(path, hf, "qwen", hf["architectures"][0], device="cuda"))
    prompts = conf.make_prompts(model.info.vocab_size, (3, 29, 17), seed=34)
    with overriding(batch_invariant=True):
        conf.check_chunked_prefill(model, prompts, chunk_sizes=(1, 7, 16))
        conf.check_mixed_batch(model, prompts)


def _gdn_and_batches(q_lens: list[int], ctx: list[int]):
    from dgpp.engine.runner import build_batch
    from dgpp.engine.work import SeqWork
    from dgpp.nn.gated_deltanet import GatedDeltaNet
    from dgpp.step.pools import CachePools

    torch.manual_seed(6)
    gdn = GatedDeltaNet(
        "gdn", hidden_size=32, num_k_heads=1, num_v_heads=2, head_k_dim=16, head_v_dim=16, conv_kernel=4
    )
    with torch.no_grad():
        for p in gdn.parameters():
            p.copy_(torch.randn_like(p) * 0.3)
        gdn.A_log.copy_(torch.rand_like(gdn.A_log) * 0.5)
    pools = CachePools({"gdn": gdn.cache_spec()}, 8, 4, len(q_lens) + 1)
    for t in pools.state["gdn"].values():
        t.copy_(torch.randn_like(t))
    works = [
        SeqWork(i, [2 * i, 2 * i + 1], c, list(range(1, n + 1)))
        for i, (n, c) in enumerate(zip(q_lens, ctx, strict=True))
    ]
    return gdn, pools, build_batch(works, pools)


@pytest.mark.parametrize("verify", [False, True])
def test_gdn_layer_through_the_routed_plan_equals_the_stock_layer(monkeypatch, verify):
    """The GDN layer's CUDA wiring (recurrent_plan) run on the CPU: outputs and the pooled state match the stock
    varlen path (fp32, to rounding), for a mixed step and a verify step."""
    import dgpp.nn.gated_deltanet as gdn_module

    q_lens, ctx = [3, 1, 2], [2, 5, 0]
    gdn, pools, batch = _gdn_and_batches(q_lens, ctx)
    hidden = torch.randn(sum(q_lens), 32)
    saved = {k: t.clone() for k, t in pools.state["gdn"].items()}
    stock = gdn(hidden, batch)
    stock_state = {k: t.clone() for k, t in pools.state["gdn"].items()}
    for k, t in pools.state["gdn"].items():
        t.copy_(saved[k])
    route = route_for(q_lens, "cpu", per_row=verify)
    monkeypatch.setattr(gdn_module, "recurrent_plan", lambda b: plan_rows(b, route))
    routed = gdn(hidden, batch)
    torch.testing.assert_close(routed, stock, rtol=1e-4, atol=1e-4)
    for k, t in pools.state["gdn"].items():
        torch.testing.assert_close(t, stock_state[k], rtol=1e-4, atol=1e-4)


def test_routed_attention_mixed_and_verify_steps_match_the_reference(monkeypatch):
    """nn.attention's routed branch on the CPU (flash prefill falls back to its torch reference, the fixed-split
    decode kernel runs in the interpreter): a mixed step and a verify step equal the torch paged attention, and a
    verify row equals the decode row of its position bit for bit."""
    from dgpp.engine.runner import build_batch
    from dgpp.engine.work import SeqWork
    from dgpp.nn.attention import _routed_attention, paged_attention
    from dgpp.step.cache_spec import PagedKV
    from dgpp.step.pools import CachePools

    torch.manual_seed(7)
    spec = {"kv": PagedKV(num_kv_heads=2, head_dim=16, dtype=torch.float32)}
    pools = CachePools(spec, 16, 4, 4)
    k_cache, v_cache = pools.kv["kv"]
    k_cache.copy_(torch.randn_like(k_cache))
    v_cache.copy_(torch.randn_like(v_cache))
    works = [
        SeqWork(0, [0, 1, 2], 6, [1]),
        SeqWork(1, [3, 4, 5], 2, [1, 2, 3, 4]),
        SeqWork(2, [6, 7], 4, [1, 2]),
    ]
    batch = build_batch(works, pools)
    q = torch.randn(batch.num_tokens, 4, 16)
    ref = paged_attention(q, k_cache, v_cache, batch, 0.25)
    for verify in (0, 1):
        batch.route = route_for(batch.q_lens_cpu, "cpu", per_row=bool(verify))
        out = _routed_attention(q, k_cache, v_cache, batch, 0.25)
        torch.testing.assert_close(out, ref, rtol=1e-4, atol=1e-4)
    # verify rows of sequence 1 (positions 2..5) == its decode rows
    for j in range(4):
        alone = build_batch([SeqWork(1, [3, 4, 5], 2 + j, [1])], pools)
        alone.route = route_for(alone.q_lens_cpu, "cpu")
        row = _routed_attention(q[1 + j : 2 + j], k_cache, v_cache, alone, 0.25)
        assert torch.equal(row, out[1 + j : 2 + j]), j


def test_fused_moe_rows_do_not_depend_on_the_token_count():
    from dgpp.kernels.moe import fused_moe_ref, fused_moe_triton

    torch.manual_seed(8)
    e, h, inter, top, t = 8, 32, 16, 2, 40
    gate_up, down = torch.randn(e, 2 * inter, h) / 6, torch.randn(e, h, inter) / 4
    x = torch.randn(t, h)
    ids = torch.stack([torch.randperm(e)[:top] for _ in range(t)])
    w = torch.rand(t, top)
    solo = torch.cat(
        [fused_moe_triton(x[r : r + 1], gate_up, down, w[r : r + 1], ids[r : r + 1]) for r in range(t)]
    )
    for m in (2, 5, t):  # 5 tokens: 10 assignments <= 4 * experts took 16-row blocks before the exact routing
        assert torch.equal(fused_moe_triton(x[:m], gate_up, down, w[:m], ids[:m]), solo[:m]), m
    torch.testing.assert_close(solo, fused_moe_ref(x, gate_up, down, w, ids), rtol=1e-4, atol=1e-4)


def test_prefill_chunks_in_place_equal_the_merged_chunks():
    """Several prefill chunks in one step: each chunk's products written into its rows of one output (and one
    SwiGLU pass) give what a call per chunk merged by copies gives, bit for bit; a decode row beside them stays
    canonical."""
    from dgpp.nn.exact import chunks

    g = torch.Generator().manual_seed(0)
    x = torch.randn(11, 32, generator=g)
    weights = [
        torch.randn(64, 32, generator=g),
        torch.randn(128, 32, generator=g),
    ]  # rows start 256-byte aligned
    route = route_for([4, 1, 6], "cpu")  # chunk rows 0..3, a decode row 4, chunk rows 5..10
    calls = []

    def bulk(rows):
        calls.append(rows.shape[0])
        return [torch.nn.functional.linear(rows, w) for w in weights]

    def exact(rows):
        return [torch.full((rows.shape[0], w.shape[0]), 7.0) for w in weights]

    with in_flight(route):
        merged = exact_cuda.route_rows(x, exact, bulk)
        assert calls == [4, 6]
        in_place = exact_cuda.route_rows(
            x, exact, bulk, lambda rows, ranges: chunks.chunk_linears(rows, weights, ranges)
        )
        assert calls == [4, 6]  # the chunks went through chunk_linears, not through bulk
        for a, b in zip(merged, in_place, strict=True):
            assert torch.equal(a, b)
        assert in_place[0][4].eq(7.0).all()
        gate, up = weights[0], torch.randn(64, 32, generator=g)
        fused = exact_cuda.route_rows(
            x,
            lambda rows: [rows.new_zeros(rows.shape[0], 64)],
            lambda rows: [chunks_ref(rows, gate, up)],
            lambda rows, ranges: chunks.chunk_gate_up_silu(rows, gate, up, ranges),
        )[0]
        for a, b in ((0, 4), (5, 11)):
            assert torch.equal(fused[a:b], chunks_ref(x[a:b], gate, up))
        assert fused[4].eq(0).all()
        # a chunk whose rows would start off the alignment cuBLAS sees for a fresh tensor: the copies instead
        assert chunks.chunk_linears(x, [torch.randn(48, 32, generator=g)], ((0, 4), (5, 11))) is None


def chunks_ref(rows, gate, up):
    from dgpp import kernels

    return kernels.silu_mul_pair(torch.nn.functional.linear(rows, gate), torch.nn.functional.linear(rows, up))
