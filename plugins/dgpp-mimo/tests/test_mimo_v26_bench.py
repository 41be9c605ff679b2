"""The MiMo-V2.6-Flash benchmark geometry (the release's own config keys, 8 of its 48 layers) has the published
shapes and fits one H200 in bf16, and ``dgpp bench`` decodes its tiny CPU version end to end."""

from __future__ import annotations

import torch

from dgpp.testing.bench_geometry import geometries, hf_config, new_model, run_bench
from dgpp_mimo.testing_v26 import MIMO_V26_LAYERS, _mimo_v26_pattern

GEOMETRY = f"mimo-v2.6-flash-{MIMO_V26_LAYERS}l"


def test_geometry_is_the_release_at_scaled_depth():
    raw = hf_config(GEOMETRY, torch.bfloat16)
    full = new_model(
        {
            **raw,
            "num_hidden_layers": 48,
            "hybrid_layer_pattern": _mimo_v26_pattern(48),
            "moe_layer_freq": [0] + [1] * 47,
        },
        "meta",
    )
    cfg = full.config
    assert [i for i, t in enumerate(cfg.layer_types) if t == "full_attention"] == [
        0,
        5,
        11,
        17,
        23,
        29,
        35,
        41,
        47,
    ]
    assert (
        cfg.attention["sliding_attention"].num_kv_heads,
        cfg.attention["full_attention"].num_kv_heads,
    ) == (8, 4)
    assert cfg.sliding_window == 128 and cfg.n_routed_experts == 256 and cfg.num_experts_per_tok == 8
    total = sum(p.numel() for p in full.parameters())
    assert 305e9 < total < 312e9, total  # "309B"
    scaled = new_model(raw, "meta")
    assert scaled.config.num_hidden_layers == 8 and scaled.config.layer_types.count("full_attention") == 2
    weights_gb = sum(p.numel() for p in scaled.parameters()) * 2 / 1e9
    assert 90 < weights_gb < 100, weights_gb  # leaves K/V and workspace room on a 141 GB H200


def test_dgpp_bench_decodes_the_tiny_mimo_v26_on_cpu(capsys):
    rc = run_bench(
        [
            "--device",
            "cpu",
            "--geometry",
            "tiny-mimo-v2.6",
            "--cases",
            "8x1x4,8x2x4",
            "--hf-cases",
            "",
            "--check-cases",
            "8x2x4",
        ]
    )
    out = capsys.readouterr().out
    assert rc == 0, out
    assert "greedy graph == eager for 8x2x4: True" in out and "geometry tiny-mimo-v2.6" in out
    assert "MoE bytes/step count only the routed experts read" in out
    assert {GEOMETRY, "tiny-mimo-v2.6"} <= set(geometries())
