"""The memory plan (what ``dgpp check`` prints and startup enforces): arithmetic, refusal, generic estimate."""

from __future__ import annotations

import json
import struct

import torch

from dgpp.checkpoint.headers import tensor_bytes
from dgpp.config import parse_config
from dgpp.startup.memory_estimate import estimate_memory_plan
from dgpp.step.cache_spec import PagedKV, StateSpec
from dgpp.step.memory import GiB, MemoryPlan

MiB = 1 << 20


def test_items_total_fits_and_largest_kv_capacity():
    plan = MemoryPlan(
        weights=10 * GiB,
        kv_per_token=1000,
        state_per_request=MiB,
        activations_per_token=4096,
        drafter=GiB,
        kv_capacity=1_000_000,
        max_concurrency=8,
        prefill_tokens=256,
    )
    items = plan.items()
    assert (
        items["kv_pool"] == 1_000_000_000
        and items["request_state"] == 8 * MiB
        and items["activations"] == 256 * 4096
    )
    assert list(items)[0] == "weights"  # largest first
    assert plan.total() == sum(items.values())
    assert plan.fits(plan.total() + 4 * GiB) and not plan.fits(plan.total() + 4 * GiB - 1)
    free = 16 * GiB
    cap = plan.max_kv_capacity(free, headroom=GiB, block_size=16)
    assert cap % 16 == 0
    assert MemoryPlan(**{**plan.__dict__, "kv_capacity": cap}).fits(free, GiB)
    assert not MemoryPlan(**{**plan.__dict__, "kv_capacity": cap + 16}).fits(free, GiB)
    msg = plan.refusal(12 * GiB, headroom=4 * GiB, block_size=16)
    assert "memory plan does not fit" in msg and "weights 10.00 GiB" in msg and "no kv_capacity fits" in msg


def test_from_cache_spec_sums_paged_and_state_layers():
    spec = {
        "l0": PagedKV(2, 16, torch.bfloat16),
        "l1": PagedKV(2, 16, torch.bfloat16, v_head_dim=8),
        "l2": StateSpec({"rec": ((4, 16, 16), torch.float32), "conv": ((3, 96), torch.bfloat16)}),
    }
    plan = MemoryPlan.from_cache_spec(
        spec, weights=100, activations_per_token=8, kv_capacity=10, max_concurrency=2
    )
    assert plan.kv_per_token == 2 * 32 * 2 + 2 * 24 * 2
    assert plan.state_per_request == 4 * 16 * 16 * 4 + 3 * 96 * 2
    assert plan.items()["kv_pool"] == 10 * plan.kv_per_token


def write_safetensors_header(path, tensors: dict[str, tuple[str, list[int]]]):
    """A safetensors file with the given header (dtype, shape) and zero bytes of data."""
    bits = {"BF16": 16, "F32": 32, "F8_E4M3": 8, "U8": 8}
    header, offset = {}, 0
    for name, (dtype, shape) in tensors.items():
        n = bits[dtype] // 8
        for d in shape:
            n *= d
        header[name] = {"dtype": dtype, "shape": shape, "data_offsets": [offset, offset + n]}
        offset += n
    raw = json.dumps(header).encode()
    path.write_bytes(struct.pack("<Q", len(raw)) + raw + bytes(offset))


def test_generic_estimate_reads_headers_only(tmp_path):
    hf = {
        "architectures": ["X"],
        "num_hidden_layers": 2,
        "hidden_size": 64,
        "num_attention_heads": 4,
        "num_key_value_heads": 2,
        "head_dim": 16,
        "intermediate_size": 128,
        "vocab_size": 512,
        "max_position_embeddings": 4096,
        "dtype": "bfloat16",
    }
    write_safetensors_header(
        tmp_path / "model.safetensors",
        {
            "model.layers.0.w": ("BF16", [64, 64]),
            "model.layers.1.w": ("F8_E4M3", [64, 64]),
            "model.layers.2.w": ("BF16", [64, 64]),  # past num_hidden_layers: an MTP layer
            "mtp.head": ("F32", [10]),
        },
    )
    assert sum(tensor_bytes(tmp_path).values()) == 64 * 64 * 2 + 64 * 64 + 64 * 64 * 2 + 40
    cfg = parse_config({"model": "m", "engine": {"kv_capacity": 1000, "mtp": True, "max_concurrency": 2}})
    plan = estimate_memory_plan(tmp_path, hf, cfg.engine, world_size=1)
    assert plan.weights == 64 * 64 * 3 and plan.drafter == 64 * 64 * 2 + 40
    assert plan.kv_per_token == 2 * 2 * (16 + 16) * 2  # layers * kv heads * (K+V dims) * bf16
    assert plan.state_per_request == 0 and plan.prefix_cache == 0 and plan.prefill_tokens == 8192
    two = estimate_memory_plan(
        tmp_path, hf, parse_config({"model": "m", "engine": {"kv_dtype": "bf16"}}).engine, world_size=2
    )
    assert (
        two.kv_per_token == 2 * 1 * (16 + 16) * 2 and two.drafter == 0
    )  # kv heads split over 2 ranks; mtp off


def test_generic_estimate_counts_hybrid_state_and_mla(tmp_path):
    write_safetensors_header(tmp_path / "model.safetensors", {"w": ("BF16", [4])})
    hybrid = {
        "num_hidden_layers": 4,
        "hidden_size": 64,
        "num_attention_heads": 4,
        "num_key_value_heads": 2,
        "head_dim": 16,
        "layer_types": ["linear_attention", "full_attention"] * 2,
        "linear_num_value_heads": 4,
        "linear_num_key_heads": 2,
        "linear_key_head_dim": 16,
        "linear_value_head_dim": 16,
        "linear_conv_kernel_dim": 4,
        "dtype": "float32",
    }
    eng = parse_config({"model": "m"}).engine
    plan = estimate_memory_plan(tmp_path, {"text_config": hybrid}, eng)
    assert plan.kv_per_token == 2 * 2 * 32 * 4  # only the two full-attention layers, fp32
    assert plan.state_per_request == 2 * (4 * 16 * 16 * 4 + (2 * 2 * 16 + 4 * 16) * 3 * 4)
    assert plan.prefix_cache == int(1.5 * GiB)  # hybrid prefix snapshots need their own arena
    mla = {
        "num_hidden_layers": 3,
        "hidden_size": 64,
        "num_attention_heads": 4,
        "kv_lora_rank": 32,
        "qk_rope_head_dim": 8,
        "dtype": "bfloat16",
    }
    assert estimate_memory_plan(tmp_path, mla, eng).kv_per_token == 3 * 40 * 2


def test_the_plan_counts_every_verify_row():
    """A verify step runs 1 + depth rows per request, MTP or prompt-lookup drafts: its fp32 logits and its
    activation rows are in the plan (a step of 16 requests 16 drafts deep outgrows a small prefill budget)."""
    from dgpp.step.memory import ModelMemory, plan_memory

    model = ModelMemory(
        weights=GiB,
        kv_per_token=100,
        state_per_request=0,
        activations_per_token=10,
        vocab_size=1000,
        max_position=4096,
    )
    base = {"max_concurrency": 16, "prefill_budget_tokens": 64, "prefill_idle_budget_tokens": 64}
    cases = [
        ({}, 16),
        ({"draft": "lookup", "draft_depth": 3}, 16 * 4),
        ({"mtp": True, "mtp_depth": 16}, 16 * 17),
    ]
    for keys, rows in cases:
        plan = plan_memory(model, parse_config({"model": "m", "engine": {**base, **keys}}).engine)
        assert plan.extra["logits"] == 4 * 1000 * rows, keys
        assert plan.prefill_tokens == max(64, rows), keys
