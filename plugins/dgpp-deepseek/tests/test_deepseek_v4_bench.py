"""The DeepSeek-V4-Flash benchmark geometry: the published model's size from its per-layer shape, the layer-scaled
version ``dgpp bench`` decodes on an H200, and ``dgpp bench`` end to end on the tiny version on CPU."""

from __future__ import annotations

import torch

from dgpp.testing.bench_geometry import (
    build_random_model,
    hf_config,
    new_model,
    run_bench,
    weight_bytes_per_step,
)
from dgpp_deepseek.testing import V4_FLASH_LAYERS

GEOMETRY = f"deepseek-v4-flash-{V4_FLASH_LAYERS}l"
CSA, HCA = "compressed_sparse_attention", "heavily_compressed_attention"


def test_v4_flash_geometry_is_the_published_model_and_the_scaled_one_fits_an_h200() -> None:
    raw = hf_config(GEOMETRY, torch.bfloat16)
    n = 43
    types = ["sliding_attention"] * 2 + [CSA if i % 2 == 0 else HCA for i in range(n - 2)]
    full = new_model(
        {
            **raw,
            "num_hidden_layers": n,
            "layer_types": types,
            "mlp_layer_types": ["hash_moe"] * 3 + ["moe"] * (n - 3),
        },
        "meta",
    )
    total = sum(p.numel() for p in full.parameters())
    expert = 3 * 4096 * 2048
    active = total - n * 256 * expert + n * 6 * expert - 129280 * 4096  # top-6 experts, no embedding table
    assert 283e9 < total < 286e9 and 13e9 < active < 13.6e9, (total, active)  # "284B, 13B active"
    scaled = new_model(raw, "meta")
    assert [layer.attn.compressor is None for layer in scaled.layers] == [True] * 2 + [False] * 6
    assert sum(layer.attn.indexer is not None for layer in scaled.layers) == 3
    assert weight_bytes_per_step(scaled) / 1e9 < 110  # leaves cache and workspace room on a 141 GB H200


def test_random_tiny_model_has_distinct_hash_experts_per_token() -> None:
    model = build_random_model("tiny-deepseek-v4", "cpu", torch.float32)
    table = model.layers[0].ffn.gate.tid2eid
    assert bool((table[:, 0] != table[:, 1]).all()) and int(table.max()) < 8
    embed = model.embed.weight
    assert weight_bytes_per_step(model) == sum(p.numel() * p.element_size() for p in model.parameters()) - (
        embed.numel() * embed.element_size() + table.numel() * table.element_size()
    )


def test_dgpp_bench_decodes_the_tiny_v4_on_cpu(capsys) -> None:
    rc = run_bench(
        [
            "--device",
            "cpu",
            "--geometry",
            "tiny-deepseek-v4",
            "--cases",
            "12x1x4,12x2x6",
            "--hf-cases",
            "",
            "--check-cases",
            "12x2x6",
        ]
    )
    out = capsys.readouterr().out
    assert rc == 0, out
    assert "greedy graph == eager for 12x2x6: True" in out and "geometry tiny-deepseek-v4" in out
