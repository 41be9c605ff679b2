"""The Qwen3.8-Flash-Next benchmark geometry: the release's per-layer shapes and caches on ``meta`` (at full depth,
the published parameter count), its memory plan without a checkpoint, the random n-gram table of random-weight
builds, and ``dgpp bench`` end to end on the tiny version on CPU (without a transformers pairing, which would
leave the table empty)."""

from __future__ import annotations

import torch

from dgpp.bench.decode import DecodeSession, random_prompts
from dgpp.bench.models import build_random_model, hf_config, new_model, weight_bytes_per_step
from dgpp.step.cache_spec import PagedKV
from dgpp.testing.bench_smoke import bench_on_cpu
from dgpp_qwen.layers.ngram import PLELayer, head_vocab_sizes
from dgpp_qwen.testing_qwen3 import _hybrid_layer_types
from dgpp_qwen.testing_qwen4_exp import QWEN4_EXP_BENCH_NGRAM_BASE, QWEN4_EXP_LAYERS

GEOMETRY = f"qwen3.8-flash-next-{QWEN4_EXP_LAYERS}l"
HIDDEN, EXPERTS, EXPERT_WIDTH = 2560, 512, 640


def _ple_layers(model: torch.nn.Module) -> list[PLELayer]:
    return [m for m in model.modules() if isinstance(m, PLELayer)]


def _release_depth(raw: dict, layers: int = 48) -> dict:
    text = {**raw["text_config"], "num_hidden_layers": layers, "layer_types": _hybrid_layer_types(layers)}
    return {**raw, "text_config": text}


def test_geometry_is_the_release_at_scaled_depth():
    raw = hf_config(GEOMETRY, torch.bfloat16)
    full = new_model(_release_depth(raw), "meta")
    base = full.cfg.base
    assert (base.hidden_size, base.vocab_size, base.num_heads, base.num_kv_heads, base.head_dim) == (
        HIDDEN,
        248320,
        24,
        2,
        256,
    )
    assert (
        base.layer_types.count("linear_attention") == 36
        and base.layer_types[3::4] == ("full_attention",) * 12
    )
    gdn, moe = base.linear_attn, base.moe
    assert (gdn.num_key_heads, gdn.num_value_heads, gdn.key_head_dim, gdn.value_head_dim) == (
        16,
        48,
        128,
        128,
    )
    assert (moe.num_experts, moe.top_k, moe.intermediate_size, moe.shared_expert_intermediate_size) == (
        EXPERTS,
        10,
        EXPERT_WIDTH,
        EXPERT_WIDTH,
    )
    assert full.cfg.gdn_output_gate == "sigmoid" and (full.cfg.hc_count, full.cfg.hc_lowrank) == (4, 320)
    assert full.cfg.indexer.block_topk == 512 and full.cfg.ngram.layer_ids == (1,)
    expert = 3 * HIDDEN * EXPERT_WIDTH
    # one layer's MoE: the routed experts, the router, the shared expert and its one-output gate
    moe_params = EXPERTS * expert + EXPERTS * HIDDEN + expert + HIDDEN
    assert sum(p.numel() for p in full.model.layers[0].mlp.parameters()) == moe_params
    total = sum(p.numel() for p in full.parameters())  # the n-gram table is not a parameter
    assert 125e9 < total < 126.5e9, total  # "125B"

    scaled = new_model(raw, "meta")
    assert scaled.cfg.base.num_layers == 8 and scaled.cfg.base.layer_types.count("full_attention") == 2
    spec = scaled.cache_spec()
    assert spec["layers.0"].tensors["recurrent"] == ((48, 128, 128), torch.float32)
    assert spec["layers.3"] == PagedKV(num_kv_heads=2, head_dim=256, dtype=torch.bfloat16)
    assert set(spec["layers.1.ple"].tensors) == {"ngram_context", "conv"}
    (ple,) = _ple_layers(scaled)
    # the scaled hash: 16 heads of 160 over the 16 primes from the scaled base, padded to 128 rows
    assert ple.ple_embedding.dim == 160
    rows = sum(head_vocab_sizes(QWEN4_EXP_BENCH_NGRAM_BASE, 0, 16))
    assert ple.table_rows == -(-rows // 128) * 128 and 3.2e6 < rows < 3.21e6
    weights = weight_bytes_per_step(scaled)
    assert weights == 2 * (sum(p.numel() for p in scaled.parameters()) - 248320 * HIDDEN)
    assert 42e9 < weights < 44e9, weights  # 8 layers of 5.0 GB experts + the LM head: room on one H100


def test_memory_plan_of_the_geometry_counts_its_table_from_the_config(tmp_path):
    from dgpp.config import EngineConfig
    from dgpp.family import LoadContext
    from dgpp.plugins import manager
    from dgpp.startup.memory_plan import plan_for

    raw = hf_config(GEOMETRY, torch.bfloat16)
    plan = plan_for(
        manager(), LoadContext(tmp_path, raw, "qwen", "Qwen4ExpForConditionalGeneration", EngineConfig())
    )
    model = new_model(raw, "meta")
    (ple,) = _ple_layers(model)
    table = ple.table_rows * 160 * 2
    assert plan.weights == sum(p.numel() * 2 for p in model.parameters()) + table
    # per QSA layer: K+V of 2 kv heads x 256, one 128-wide index key and a quarter of a block key, bf16
    assert plan.kv_per_token == 2 * (2 * 2 * 256 + 128 + 128 // 4) * 2


@torch.inference_mode()
def test_random_build_fills_the_ngram_table_and_decodes():
    model = build_random_model("tiny-qwen3.8-flash-next", "cpu", torch.float32, seed=3)
    tables = [ple.ple_embedding.table for ple in _ple_layers(model)]
    assert [t.shape[0] for t in tables] == [ple.table_rows for ple in _ple_layers(model)]
    assert all(0.01 < float(t.std()) < 0.03 for t in tables)  # N(0, 0.02), as the parameters
    prompts = random_prompts(2, 9, model.info.vocab_size, seed=4)

    def decode() -> list[list[int]]:
        session = DecodeSession(model, 2, 9 + 5, 16, graph=False)
        return session.decode(session.prefill(prompts), 9, 4)

    first = decode()
    assert first == decode()
    for table in tables:  # the table's rows reach the logits
        table.mul_(50)
    assert decode() != first


def test_dgpp_bench_decodes_the_tiny_geometry_on_cpu():
    out = bench_on_cpu("tiny-qwen3.8-flash-next", "20x2x6", "20x2x6", hf_cases="20x2x6")
    # transformers' state dict has no tensor of dgpp's n-gram table by name: no HF pairing, said once
    assert "keeps tables outside its parameters" in out
