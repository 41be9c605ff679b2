"""The Flint benchmark geometries: the release's shapes, and ``dgpp bench --quant release`` packing the tiny one's
routed experts per layer and projection as the export does, decoded end to end on the CPU."""

from __future__ import annotations

import re

import torch

from dgpp.testing.bench_geometry import geometries, hf_config, new_model, run_bench


def test_geometry_is_the_release():
    raw = hf_config("flint", torch.bfloat16)
    assert (
        "quantization_config" not in raw
    )  # the dense source; the release's formats come with --quant release
    model = new_model(raw, "meta")
    cfg = model.config
    assert (cfg.num_hidden_layers, cfg.num_experts, cfg.num_experts_per_tok) == (49, 256, 6)
    total = sum(p.numel() for p in model.parameters())
    assert 39e9 < total < 41e9, total  # 80 GB in bf16: benchmarked cut to its first layers (flint@N)
    assert {"flint", "tiny-flint"} <= set(geometries())


def test_dgpp_bench_decodes_the_tiny_flint_release_layout_on_cpu(tmp_path, capsys):
    out = tmp_path / "table.md"
    argv = ["--device", "cpu", "--geometry", "tiny-flint", "--quant", "bf16,release", "--cases", "8x2x4"]
    rc = run_bench([*argv, "--hf-cases", "8x2x4", "--check-cases", "8x2x4", "--out", str(out)])
    printed = capsys.readouterr().out
    assert rc == 0, printed
    assert "release greedy graph == eager for 8x2x4: True" in printed
    # the packed experts are what the step reads, and transformers ran their decoded values (an HF rate)
    packed, dense = map(
        int, re.search(r"weights read per step (\d+) bytes \(dense: (\d+)\)", printed).groups()
    )
    assert packed < 0.7 * dense
    for variant in ("fp32", "release"):
        row = rf"^\| 8 \| 2 \| 4 \| {variant} graph \| .* \| -?\d+\.\d \| \S+ \|$"
        assert re.search(row, out.read_text(), re.M), out.read_text()
