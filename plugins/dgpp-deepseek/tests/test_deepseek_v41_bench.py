"""The DeepSeek-V4.1-Flash benchmark geometry: 8 of the release's 40 layers with every CSA2 role, built in the
release's packed formats (built on meta here, nothing allocated) within 70 GB with the cache pools of 64 x 256
tokens; random packed weights that keep 8 layers' logits finite; the decode roofline counting packed bytes, the
routed experts and Engram's rows; and ``dgpp bench`` end to end on the tiny twin on CPU."""

from __future__ import annotations

import math

import pytest
import torch

from dgpp.bench.decode import DecodeSession, random_prompts
from dgpp.bench.packed_random import E2M1_RMS
from dgpp.bench.step_bytes import decode_step_bytes, kv_bytes_per_token, state_bytes_per_request
from dgpp.engine.work import SeqWork
from dgpp.quant.codecs import e2m1_unpack
from dgpp.quant.fp4 import FP4Grouped
from dgpp.quant.fp8 import FP8Block
from dgpp.quant.moe import QuantExperts
from dgpp.testing.bench_geometry import build_random_model, hf_config, run_bench, weight_bytes_per_step
from dgpp_deepseek.v41_bench import V41_FLASH_LAYERS, cache_bytes, packed_model, part_bytes
from dgpp_deepseek.v41_config import DeepseekV41ArchConfig
from dgpp_deepseek.v41_engram import EngramV41

GEOMETRY = f"deepseek-v4.1-flash-{V41_FLASH_LAYERS}l"
TINY = "tiny-deepseek-v41"


def test_the_8_layers_keep_every_role_of_the_40() -> None:
    cfg = DeepseekV41ArchConfig.from_hf_config(hf_config(GEOMETRY, torch.bfloat16))
    layers = range(cfg.num_hidden_layers)
    assert (cfg.hidden_size, cfg.n_routed_experts, cfg.moe_intermediate_size, cfg.vocab_size) == (
        5120,
        384,
        2304,
        129280,
    )
    assert [cfg.ratio(i) for i in layers] == [0, 0, 2, 2, 2, 1, 1, 1]  # window-only, ratio 2, ratio 1
    assert [cfg.kv_source_of(i) for i in layers] == [-1, -1, 2, 3, 3, 5, 5, 5]  # sources and sharing layers
    assert cfg.decoder_first_layer == 5  # layers 0-4 the causal encoder, 5-7 the decoder
    assert [cfg.is_index_source(i) for i in (2, 4, 6, 7)] == [True, False, False, True]  # 4 and 6 reuse
    assert [cfg.uses_candidates(i) for i in (5, 7)] == [False, True]  # 7 re-indexes inside 5's candidates
    assert cfg.engram_layer_ids == (1, 3) and cfg.hc_mult == 4 and cfg.engram_rows_per_token == 24


def test_the_8_layer_geometry_is_packed_as_released_and_fits_70_gb() -> None:
    raw = hf_config(GEOMETRY, torch.bfloat16)
    cfg = DeepseekV41ArchConfig.from_hf_config(raw)
    model = packed_model(raw, "meta")
    experts = [m for m in model.modules() if isinstance(m, QuantExperts)]
    assert len(experts) == 8
    assert all(isinstance(e.fmt, FP4Grouped) and e.fmt.scale_kind == "e8m0" for e in experts)  # MXFP4
    layer = model.layers[5]
    for linear in (layer.attn.wq_a, layer.attn.wq_b, layer.attn.wo_b, layer.ffn.shared_expert.down_proj):
        fmt = linear.quant_method.fmt
        assert isinstance(fmt, FP8Block) and fmt.block == (32, 32) and fmt.scale_format == "e8m0"
    assert model.embed.weight.dtype == model.head.weight.dtype == torch.bfloat16
    parts = part_bytes(model, cfg)
    elements = 8 * 384 * 3 * 5120 * 2304
    assert parts["routed experts"] == elements // 2 + elements // 32  # E2M1 pairs and an E8M0 per 32
    assert parts["embedding + head"] == 2 * 129280 * 5120 * 2
    # the bench-sized Engram tables, on the host: 24 buckets of ~262K rows of 256 E4M3 + 8 E8M0 bytes a layer
    assert 3e9 < parts["engram tables (host)"] < 3.5e9
    on_device = sum(size for name, size in parts.items() if "host" not in name)
    assert 61e9 < on_device < 63e9, parts
    assert on_device + cache_bytes(model, 64, 256) < 70e9


def _expert_stack(model: torch.nn.Module) -> QuantExperts:
    return next(m for m in model.modules() if isinstance(m, QuantExperts))


def test_random_packed_weights_are_uniform_codes_at_the_benchmark_spread() -> None:
    model = build_random_model(TINY, "cpu", torch.float32)
    std = hf_config(TINY, torch.float32)["text_config"]["initializer_range"]
    stack = _expert_stack(model).gate_proj
    codes = stack.weight
    counts = torch.bincount(torch.cat([codes.flatten() & 15, codes.flatten() >> 4]).long(), minlength=16)
    assert counts.min() > 0.8 * counts.float().mean()  # both nibbles uniform over the 16 E2M1 codes
    assert bool((stack.weight_scale == 127 + round(math.log2(std / E2M1_RMS))).all())
    values = e2m1_unpack(codes)
    assert values.isfinite().all()
    decoded = stack.fmt.decode(stack.expert_tensors(0), stack.shape, torch.float32)
    assert 0.7 * std < float(decoded.std()) < 1.45 * std
    wq_b = model.layers[2].attn.wq_b
    dense = wq_b.quant_method.fmt.decode(
        {n: getattr(wq_b, n) for n in wq_b.quant_tensor_names}, (wq_b.out_local, wq_b.in_local), torch.float32
    )
    assert dense.isfinite().all() and 0.9 * std < float(dense.std()) < 1.1 * std  # FP8: no NaN code


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_tiny_twin_decodes_finite_logits_through_every_layer(dtype: torch.dtype) -> None:
    """bf16 as the GPU bench runs it: the pooling compressors project in fp32 from bf16 rows."""
    model = build_random_model(TINY, "cpu", dtype)
    pooling = [m for m in model.modules() if getattr(m, "wgate", None) is not None]
    assert pooling and all(m.wkv.weight.dtype == m.wgate.weight.dtype == torch.float32 for m in pooling)
    assert all(m.table is not None for m in model.modules() if isinstance(m, EngramV41))
    session = DecodeSession(model, 2, 24, 16, graph=False)
    prompts = random_prompts(2, 14, model.info.vocab_size, 0)  # past the window, candidates and top-k
    logits = session.runner.step([SeqWork(b, session.tables[b], 0, p) for b, p in enumerate(prompts)])
    for step in range(4):
        assert logits.isfinite().all() and float(logits.std()) > 0
        last = logits.argmax(-1).tolist()
        logits = session.runner.step([SeqWork(b, session.tables[b], 14 + step, [last[b]]) for b in range(2)])
    assert logits.isfinite().all()


def test_step_bytes_count_packed_routed_experts_and_engram_rows() -> None:
    model = build_random_model(TINY, "cpu", torch.float32)
    cfg = model.config
    weights = weight_bytes_per_step(model)
    stack = sum(p.numel() * p.element_size() for p in _expert_stack(model).parameters())
    elements = 3 * cfg.n_routed_experts * cfg.hidden_size * cfg.moe_intermediate_size
    assert stack == elements // 2 + elements // 32  # the packed bytes, not a dense stack
    engram_rows = 2 * cfg.engram_rows_per_token * (cfg.engram_head_dim + cfg.engram_head_dim // 32)
    context, batch, picked = 20.0, 3, 2.0
    expected = (
        weights
        - 8 * stack * (1 - picked / cfg.n_routed_experts)  # only the experts the routers picked
        + batch * context * kv_bytes_per_token(model)
        + 2 * batch * state_bytes_per_request(model)
        + batch * engram_rows  # the rows looked up, not the tables
    )
    assert math.isclose(decode_step_bytes(model, batch, context, picked), expected, rel_tol=1e-12)


def test_dgpp_bench_decodes_the_tiny_v41_on_cpu(capsys) -> None:
    argv = ["--device", "cpu", "--geometry", TINY, "--cases", "12x1x4,12x2x6", "--hf-cases", ""]
    rc = run_bench([*argv, "--check-cases", "12x2x6"])
    out = capsys.readouterr().out
    assert rc == 0, out
    assert "greedy graph == eager for 12x2x6: True" in out and f"geometry {TINY}" in out
    assert "decodes eager" not in out  # its decode step is CUDA-graph safe
