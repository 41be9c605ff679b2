"""Benchmark geometries for the Qwen3.5 hybrids (dense 27B, 122B-A10B-shaped MoE): their published shapes,
the bytes a decode step reads (checked against hand formulas on the tiny versions), the HF/dgpp weight
pairing, and ``dgpp bench`` end to end on CPU."""

from __future__ import annotations

import torch

from dgpp.bench.cli import main as bench_main
from dgpp.bench.decode import hf_tok_s, run_case
from dgpp.bench.models import (
    build_model_like,
    build_pair,
    build_random_model,
    geometries,
    hf_config,
    new_model,
)
from dgpp.bench.step_bytes import RouterTap, decode_step_bytes, expected_distinct_experts
from dgpp.engine.runner import ModelRunner
from dgpp.engine.work import SeqWork
from dgpp_qwen.testing_qwen3 import MOE_122B_LAYERS, _hybrid_layer_types

MOE_GEOMETRY = f"qwen3.5-122b-a10b-{MOE_122B_LAYERS}l"
FP32 = 4  # bytes per element of the CPU (fp32) fixtures


def _params(model: torch.nn.Module, skip: str = "embed_tokens") -> int:
    return sum(p.numel() for n, p in model.named_parameters() if skip not in n)


def test_qwen3_5_27b_geometry_is_the_published_model() -> None:
    raw = hf_config("qwen3.5-27b", torch.bfloat16)
    model = new_model(raw, "meta")  # shapes only
    cfg = model.cfg
    assert (cfg.num_layers, cfg.hidden_size, cfg.intermediate_size, cfg.vocab_size) == (
        64,
        5120,
        17408,
        248320,
    )
    assert (
        cfg.layer_types.count("linear_attention") == 48 and cfg.layer_types[3::4] == ("full_attention",) * 16
    )
    assert (cfg.num_heads, cfg.num_kv_heads, cfg.head_dim, cfg.rope.rotary_dim) == (24, 4, 256, 64)
    gdn = cfg.linear_attn
    assert (gdn.num_key_heads, gdn.num_value_heads, gdn.key_head_dim, gdn.value_head_dim) == (
        16,
        48,
        128,
        128,
    )
    total = sum(p.numel() for p in model.parameters())
    assert 26.5e9 < total < 27.5e9, total  # "27B"
    # bf16 weights a decode step reads (no embedding table): the original engine's "a T=1 step streams 27 GB" at FP8
    assert 51e9 < _params(model) * 2 < 52e9  # 51.2 GB


def test_qwen3_5_122b_geometry_has_the_published_layer_and_scaled_depth() -> None:
    raw = hf_config(MOE_GEOMETRY, torch.bfloat16)
    full = new_model({**raw, "num_hidden_layers": 48, "layer_types": _hybrid_layer_types(48)}, "meta")
    cfg = full.cfg
    assert (cfg.hidden_size, cfg.num_heads, cfg.num_kv_heads, cfg.moe.num_experts, cfg.moe.top_k) == (
        3072,
        32,
        2,
        256,
        8,
    )
    assert cfg.moe.intermediate_size == cfg.moe.shared_expert_intermediate_size == 1024
    assert (cfg.linear_attn.num_key_heads, cfg.linear_attn.num_value_heads) == (16, 64)
    total = sum(p.numel() for p in full.parameters())
    expert = 3 * 3072 * 1024
    active = total - 48 * 256 * expert + 48 * 8 * expert
    assert 121e9 < total < 123e9 and 9.5e9 < active < 10.5e9, (total, active)  # "122B-A10B"
    scaled = new_model(raw, "meta")
    assert scaled.cfg.num_layers == 24 and scaled.cfg.layer_types.count("full_attention") == 6
    weights_gb = sum(p.numel() for p in scaled.parameters()) * 2 / 1e9
    assert weights_gb < 125, weights_gb  # leaves K/V and workspace room on a 141 GB H200


def _tiny_hybrid_bytes(moe: bool, experts_read: float) -> tuple[int, int, int]:
    """(weights, K/V bytes per token, state bytes per sequence) of tiny-qwen3.5(-moe), by hand."""
    hidden, vocab, heads, kv_heads, head_dim = 64, 512, 4, 2, 16
    k_heads, v_heads, dk, dv, conv = 2, 4, 16, 16, 4
    conv_dim = 2 * k_heads * dk + v_heads * dv
    gdn = (
        conv_dim * hidden
        + 2 * (v_heads * dv) * hidden
        + 2 * v_heads * hidden
        + conv_dim * conv
        + 2 * v_heads
        + dv
    )
    attn = (
        2 * heads * head_dim * hidden
        + 2 * kv_heads * head_dim * hidden
        + heads * head_dim * hidden
        + 2 * head_dim
    )
    if moe:
        experts, inter, shared = 8, 32, 32
        mlp = experts * hidden + experts_read * 3 * hidden * inter + 3 * hidden * shared + hidden
    else:
        mlp = 3 * hidden * 128
    weights = 3 * gdn + attn + 4 * (mlp + 2 * hidden) + hidden + vocab * hidden
    kv = 2 * kv_heads * head_dim * FP32  # one full-attention layer
    state = 3 * (v_heads * dk * dv * FP32 + (conv - 1) * conv_dim * FP32)  # read and written: x2 per step
    return int(weights * FP32), kv, state


def test_step_bytes_of_the_tiny_dense_hybrid_match_the_formula() -> None:
    model = build_random_model("tiny-qwen3.5", "cpu", torch.float32)
    weights, kv, state = _tiny_hybrid_bytes(moe=False, experts_read=0)
    for batch, context in ((1, 10.0), (3, 37.5)):
        assert decode_step_bytes(model, batch, context) == weights + batch * context * kv + 2 * batch * state


def test_step_bytes_of_the_tiny_moe_count_only_routed_experts() -> None:
    model = build_random_model("tiny-qwen3.5-moe", "cpu", torch.float32)
    weights, kv, state = _tiny_hybrid_bytes(moe=True, experts_read=2)  # batch 1: exactly top_k = 2
    assert decode_step_bytes(model, 1, 10.0) == weights + 10.0 * kv + 2 * state
    weights5, _, _ = _tiny_hybrid_bytes(moe=True, experts_read=5)
    assert decode_step_bytes(model, 4, 10.0, experts_read=5) == weights5 + 40.0 * kv + 8 * state
    # unmeasured: the uniform expectation, never above the whole stack
    assert expected_distinct_experts(8, 2, 1) == 2
    all8, _, _ = _tiny_hybrid_bytes(moe=True, experts_read=8)
    assert decode_step_bytes(model, 10_000, 0.0) <= all8 + 2 * 10_000 * state


def test_router_tap_counts_distinct_experts_of_real_rows_only() -> None:
    model = build_random_model("tiny-qwen3.5-moe", "cpu", torch.float32)
    res = run_case(model, 6, 1, 3, graph=False, copy_gbs=1.0)
    assert res.experts_read == 2.0  # batch 1 routes to exactly top_k experts in every layer
    res = run_case(model, 6, 5, 3, graph=False, copy_gbs=1.0)
    assert 2.0 <= res.experts_read <= 8.0
    with RouterTap(model, rows=1) as tap:
        runner = ModelRunner(model, _pools(model))
        runner.step([SeqWork(0, [0], 0, [1, 2, 3])])  # a 3-token prefill, counted as its first row only
    assert tap.distinct == [2, 2, 2, 2]


def _pools(model):
    from dgpp.step.pools import CachePools

    return CachePools(model.cache_spec(), 4, 16, 1)


def test_build_pair_runs_transformers_weights_and_can_share_them() -> None:
    ours, hf = build_pair("tiny-qwen3.5-moe", "cpu", torch.float32)
    ids = torch.tensor([[5, 17, 300, 2, 9, 44]])
    with torch.inference_mode():
        want = hf(ids).logits[0, -1].float()
        runner = ModelRunner(ours, _pools(ours))
        got = runner.step([SeqWork(0, [0], 0, ids[0].tolist())])[0]
        assert torch.allclose(got, want, rtol=1e-4, atol=1e-4), float((got - want).abs().max())
        shared = build_model_like(
            hf_config("tiny-qwen3.5-moe", torch.float32), hf.state_dict(), "cpu", share=True
        )
        name = "model.layers.0.mlp.experts.gate_up_proj"
        assert dict(shared.named_parameters())[name].data_ptr() == hf.state_dict()[name].data_ptr()
        again = ModelRunner(shared, _pools(shared)).step([SeqWork(0, [0], 0, ids[0].tolist())])[0]
    assert torch.equal(again, got)


def test_random_hybrid_init_and_missing_transformers_model() -> None:
    ours, hf = build_pair("tiny-qwen3.5", "cpu", torch.float32, with_hf=False)
    assert hf is None and hf_tok_s(hf, 4, 1, 4, 512) == 0.0
    params = dict(ours.named_parameters())
    assert torch.all(params["model.norm.weight"] == 0)  # (1 + w) norm at identity
    assert torch.all(params["model.layers.0.linear_attn.norm.weight"] == 1)  # plain gated norm
    decay = params["model.layers.0.linear_attn.A_log"].exp()
    assert torch.all((decay >= 1) & (decay <= 16))


def test_dgpp_bench_runs_both_tiny_hybrids_on_cpu(capsys) -> None:
    for geometry in ("tiny-qwen3.5", "tiny-qwen3.5-moe"):
        rc = bench_main(
            [
                "--device",
                "cpu",
                "--geometry",
                geometry,
                "--cases",
                "8x1x4,8x2x4",
                "--hf-cases",
                "8x1x4",
                "--check-cases",
                "8x2x4",
            ]
        )
        out = capsys.readouterr().out
        assert rc == 0, out
        assert "greedy graph == eager for 8x2x4: True" in out
        assert f"geometry {geometry}" in out
        assert ("MoE bytes/step count only the routed experts read" in out) == geometry.endswith("moe")
    assert set(geometries()) >= {"qwen3.5-27b", MOE_GEOMETRY, "tiny-qwen3.5", "tiny-qwen3.5-moe"}


def test_padded_graph_path_of_the_tiny_moe_hybrid_equals_eager() -> None:
    """The bench's graph path on CPU (DecodeGraphs without capture): 3 sequences padded to 4 rows, the padding
    row on state slot -1 and no blocks, decode the same greedy tokens as the plain eager runner."""
    from dgpp.bench.decode import DecodeSession, random_prompts
    from dgpp.engine.graphs import DecodeGraphs

    model = build_random_model("tiny-qwen3.5-moe", "cpu", torch.float32)
    prompts = random_prompts(3, 7, model.info.vocab_size, seed=3)
    runs = []
    for padded in (False, True):
        session = DecodeSession(model, 3, 7 + 6, 16, graph=False)
        if padded:
            session.runner.graphs = DecodeGraphs(
                model, session.pools, 4, session.blocks_per_seq, capture=False
            )
        runs.append(session.decode(session.prefill(prompts), 7, 5))
        if padded:
            assert session.runner.graphs.stats.by_size == {4: 5}
    assert runs[0] == runs[1]


def test_geometry_cut_to_its_first_layers_keeps_their_kinds() -> None:
    whole = hf_config("deepseek-v4-flash-8l", torch.bfloat16)
    cut = hf_config("deepseek-v4-flash-8l@4", torch.bfloat16)
    assert cut["num_hidden_layers"] == 4
    assert cut["layer_types"] == whole["layer_types"][:4]
    assert cut["mlp_layer_types"] == whole["mlp_layer_types"][:4]
    assert {k: v for k, v in cut.items() if not isinstance(v, list) and k != "num_hidden_layers"} == {
        k: v for k, v in whole.items() if not isinstance(v, list) and k != "num_hidden_layers"
    }
    # MiMo's hybrid pattern and MoE frequency are per-layer lists too
    mimo = hf_config("tiny-mimo-v2.6@3", torch.float32)
    assert len(mimo["hybrid_layer_pattern"]) == len(mimo["moe_layer_freq"]) == 3
    model = build_random_model("tiny-qwen3.5-moe@2", "cpu", torch.float32)
    assert model.cfg.num_layers == 2


def test_geometry_cut_refuses_bad_counts_and_own_builders() -> None:
    for name, words in (
        ("qwen3-8b@0", "positive integer"),
        ("qwen3-8b@x", "positive integer"),
        ("qwen3-8b@99", "has 36 layers"),
        ("deepseek-v4.1-flash-8l@4", "builds its own random model"),
    ):
        try:
            hf_config(name, torch.bfloat16)
        except ValueError as e:
            assert words in str(e), (name, e)
        else:
            raise AssertionError(f"{name} was accepted")


def test_prefill_flops_count_routed_experts_by_their_top_k_share() -> None:
    from dgpp.bench.decode import prefill_flops
    from dgpp.bench.step_bytes import moe_layers

    model = build_random_model("tiny-qwen3.5-moe", "cpu", torch.float32)
    flops, with_attention = prefill_flops(model, 64)
    assert not with_attention  # GDN layers: the causal-attention square would overcount them
    weights = sum(p.numel() for name, p in model.named_parameters() if "embed_tokens" not in name)
    routed = 0.0
    for moe in moe_layers(model):
        stack = sum(p.numel() for p in moe.experts.parameters())
        routed += stack * (1 - moe.gate.cfg.top_k / moe.experts.num_experts)
    assert routed > 0
    # every weight element but the embedding, minus the experts a token does not pick
    expected = 2 * 64 * (weights - routed)
    assert abs(flops - expected) <= 2 * 64 * len(moe_layers(model))
    dense, attention = prefill_flops(build_random_model("tiny", "cpu", torch.float32), 64)
    assert attention and dense > 0
