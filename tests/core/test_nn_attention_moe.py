"""Paged attention vs dense causal attention, and MoE routing vs transformers' routers."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
import transformers
from transformers.models.deepseek_v3 import modeling_deepseek_v3 as hf_dsv3
from transformers.models.qwen3_5_moe import modeling_qwen3_5_moe as hf_q35moe

from dgpp.engine.runner import build_batch
from dgpp.engine.work import SeqWork
from dgpp.nn.attention import PagedAttention
from dgpp.nn.moe import RoutingConfig, SparseMoE, TopKRouter
from dgpp.step.cache_spec import PagedKV
from dgpp.step.pools import CachePools

GEN = torch.Generator().manual_seed(0)


def dense_causal(q, k, v, scale):
    """[L, H, D] full sequences -> causal SDPA output [L, Hq, Dv], kv heads repeated for GQA."""
    group = q.shape[1] // k.shape[1]
    k, v = k.repeat_interleave(group, 1), v.repeat_interleave(group, 1)
    out = F.scaled_dot_product_attention(
        q.transpose(0, 1), k.transpose(0, 1), v.transpose(0, 1), is_causal=True, scale=scale
    )
    return out.transpose(0, 1)


def test_paged_attention_mixed_prefill_chunk_and_decode_matches_dense():
    hq, hkv, d, bs = 4, 2, 8, 4
    pools = CachePools(
        {"attn": PagedKV(hkv, d, torch.float32)}, num_blocks=16, block_size=bs, num_state_slots=1
    )
    layer = PagedAttention("attn", hq, hkv, d)
    lengths, contexts = [9, 13, 6], [0, 8, 5]  # a fresh prefill, a second chunk, a decode row
    perm = torch.randperm(16, generator=GEN).tolist()  # scattered, out-of-order blocks
    tables = [perm[0:3], perm[3:7], perm[7:9]]
    full = [
        (
            torch.randn(n, hq, d, generator=GEN),
            torch.randn(n, hkv, d, generator=GEN),
            torch.randn(n, hkv, d, generator=GEN),
        )
        for n in lengths
    ]
    # earlier tokens reach the cache through an earlier step
    earlier = [SeqWork(0, t, 0, [0] * c) for t, c in zip(tables, contexts, strict=True) if c]
    kept = [i for i, c in enumerate(contexts) if c]
    b0 = build_batch(earlier, pools)
    layer(
        torch.cat([full[i][0][: contexts[i]] for i in kept]),
        torch.cat([full[i][1][: contexts[i]] for i in kept]),
        torch.cat([full[i][2][: contexts[i]] for i in kept]),
        b0,
    )
    step = [SeqWork(0, t, c, [0] * (n - c)) for t, c, n in zip(tables, contexts, lengths, strict=True)]
    batch = build_batch(step, pools)
    q, k, v = (torch.cat([f[j][c:] for f, c in zip(full, contexts, strict=True)]) for j in range(3))
    out = layer(q, k, v, batch).view(-1, hq, d)
    rows = out.split([n - c for n, c in zip(lengths, contexts, strict=True)])
    for (fq, fk, fv), c, got in zip(full, contexts, rows, strict=True):
        torch.testing.assert_close(got, dense_causal(fq, fk, fv, d**-0.5)[c:], rtol=1e-5, atol=1e-6)


def test_slot_mapping_minus_one_writes_nothing():
    pools = CachePools({"attn": PagedKV(1, 4, torch.float32)}, num_blocks=2, block_size=2, num_state_slots=1)
    batch = build_batch([SeqWork(0, [1], 0, [3, 4])], pools)
    batch.slot_mapping[1] = -1
    PagedAttention("attn", 1, 1, 4)(torch.ones(2, 1, 4), torch.ones(2, 1, 4), torch.ones(2, 1, 4), batch)
    k_cache = pools.kv["attn"][0]
    assert k_cache[1, 0].sum() == 4 and k_cache[1, 1].sum() == 0 and k_cache[0].sum() == 0


def test_group_limited_sigmoid_router_matches_deepseek_v3():
    cfg = transformers.DeepseekV3Config(
        hidden_size=32,
        n_routed_experts=16,
        num_experts_per_tok=4,
        n_group=4,
        topk_group=2,
        routed_scaling_factor=2.5,
        norm_topk_prob=True,
    )
    ref = hf_dsv3.DeepseekV3TopkRouter(cfg)
    routing = RoutingConfig(
        num_experts=16,
        top_k=4,
        scoring="sigmoid",
        renormalize=True,
        routed_scaling_factor=2.5,
        correction_bias=True,
        n_group=4,
        topk_group=2,
        router_fp32=True,
    )
    ours = TopKRouter(32, routing, dtype=torch.float32)
    with torch.no_grad():
        ref.weight.copy_(torch.randn(16, 32, generator=GEN))
        ref.e_score_correction_bias.copy_(torch.randn(16, generator=GEN) * 0.3)
        ours.weight.copy_(ref.weight)
        ours.e_score_correction_bias.copy_(ref.e_score_correction_bias)
    x = torch.randn(40, 32, generator=GEN)
    _, ref_w, ref_ids = ref(x)
    w, ids = ours(x)
    order, ref_order = ids.sort(-1), ref_ids.sort(-1)
    assert torch.equal(order.values, ref_order.values)
    torch.testing.assert_close(
        w.gather(1, order.indices), ref_w.gather(1, ref_order.indices), rtol=1e-6, atol=0
    )
    assert all(len(set((row // 4).tolist())) <= 2 for row in ids)  # experts from at most topk_group groups


def test_softmax_moe_with_gated_shared_expert_matches_qwen3_5_moe_block():
    cfg = transformers.Qwen3_5MoeTextConfig(
        hidden_size=32,
        num_experts=8,
        num_experts_per_tok=2,
        moe_intermediate_size=16,
        shared_expert_intermediate_size=24,
    )
    ref = hf_q35moe.Qwen3_5MoeSparseMoeBlock(cfg).eval()
    routing = RoutingConfig(num_experts=8, top_k=2, scoring="softmax", renormalize=True)
    ours = SparseMoE(32, 16, routing, dtype=torch.float32, shared_intermediate_size=24, shared_gate=True)
    with torch.no_grad():
        for p in ref.parameters():
            p.copy_(torch.randn(p.shape, generator=GEN) * 0.3)
        ours.gate.weight.copy_(ref.gate.weight)
        ours.experts.gate_up_proj.copy_(ref.experts.gate_up_proj)
        ours.experts.down_proj.copy_(ref.experts.down_proj)
        for name in ("gate_proj", "up_proj", "down_proj"):
            getattr(ours.shared_expert, name).weight.copy_(getattr(ref.shared_expert, name).weight)
        ours.shared_expert_gate.weight.copy_(ref.shared_expert_gate.weight)
        x = torch.randn(1, 10, 32, generator=GEN)
        torch.testing.assert_close(ours(x[0]), ref(x)[0], rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("renormalize", [True, False])
def test_softmax_router_weights(renormalize):
    router = TopKRouter(
        8, RoutingConfig(num_experts=6, top_k=2, renormalize=renormalize), dtype=torch.float32
    )
    with torch.no_grad():
        router.weight.copy_(torch.randn(6, 8, generator=GEN))
    x = torch.randn(5, 8, generator=GEN)
    w, ids = router(x)
    probs = torch.softmax(x @ router.weight.T, -1)
    expected = probs.gather(1, ids)
    if renormalize:
        expected = expected / expected.sum(-1, keepdim=True)
    torch.testing.assert_close(w, expected)
    assert torch.equal(ids[:, 0], probs.argmax(-1))
