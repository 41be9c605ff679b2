"""The GLM-5.3-Flash benchmark geometry: the release's per-layer shapes and caches on ``meta``, and ``dgpp bench``
end to end on the tiny version on CPU (greedy through the padded decode batch equals eager)."""

from __future__ import annotations

from dataclasses import replace

import torch

from dgpp.step.cache_spec import CompressedKV, LatentKV
from dgpp.testing.bench_geometry import hf_config, new_model, run_bench, weight_bytes_per_step


def test_flash_bench_geometry_has_the_release_shapes():
    model = new_model(hf_config("glm-5.3-flash-6l", torch.bfloat16), "meta")
    spec = model.cache_spec()
    # a KDA layer's fp32 state: 64 heads x 128 x 128 (4 MiB a request), its conv history 3 rows of q, k and v
    assert spec["layers.0.self_attn"].tensors["recurrent"] == ((64, 128, 128), torch.float32)
    assert spec["layers.0.self_attn"].tensors["k_conv"] == ((3, 8192), torch.bfloat16)
    assert spec["layers.3.self_attn"] == LatentKV.of(512, 0, torch.bfloat16)
    assert spec["layers.3.self_attn.indexer"] == replace(
        CompressedKV.of(4, 128, torch.bfloat16), fp8_rows=True, index_keys=True
    )
    expert = 3 * 4096 * 2048
    moe = model.stack.layers[3].mlp
    assert 289 * expert < sum(p.numel() for p in moe.parameters()) < 290 * expert  # 288 routed + 1 shared
    assert weight_bytes_per_step(model) / 1e9 < 60  # 3 dense + 3 MoE layers in bf16 fit one H100 with room


def test_dgpp_bench_decodes_the_tiny_flash_on_cpu(capsys) -> None:
    rc = run_bench(
        [
            "--device",
            "cpu",
            "--geometry",
            "tiny-glm-5.3-flash",
            "--cases",
            "20x2x6",
            "--hf-cases",
            "",
            "--check-cases",
            "20x2x6",
        ]
    )
    out = capsys.readouterr().out
    assert rc == 0, out
    assert "greedy graph == eager for 20x2x6: True" in out and "geometry tiny-glm-5.3-flash" in out
