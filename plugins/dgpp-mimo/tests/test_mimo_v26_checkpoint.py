"""A MiMo-V2.6 checkpoint seen under ``mimo_v2_flash`` names: the fused, pre-sharded FP8 ``qkv_proj`` split into
q/k/v with re-blocked scales, MXFP4 experts and FP8 dense projections decoding to exactly the values of the
dequantized twin (written independently by ``dgpp_mimo.testing_v26``), vision / audio tensors left out."""

from __future__ import annotations

import json

import pytest
import torch
from safetensors.torch import load_file, save_file

from dgpp.errors import CheckpointError
from dgpp_mimo.testing import build_tiny_mimo
from dgpp_mimo.testing_v26 import MIMO_V26_RELEASE, write_v26_checkpoint
from dgpp_mimo.v26_checkpoint import V26Reader, V26Scheme, qkv_geometry
from dgpp_mimo.v26_config import canonical_config


@pytest.fixture(scope="module")
def v26(tmp_path_factory):
    root = tmp_path_factory.mktemp("mimo_v26")
    flash = build_tiny_mimo(root / "flash", seed=4)
    v26_dir, twin_dir = write_v26_checkpoint(flash, root / "v26", root / "twin", mtp_layers=1, seed=5)
    raw = json.loads((v26_dir / "config.json").read_text())
    return v26_dir, raw, canonical_config(raw), load_file(str(twin_dir / "model.safetensors"))


def test_every_tensor_decodes_to_the_twins_value(v26):
    path, raw, canonical, twin = v26
    reader = V26Reader(path, canonical, raw["quantization_config"])
    scheme = V26Scheme(canonical, raw["quantization_config"], reader.names())
    weights = [n for n in reader.names() if n.endswith((".weight", ".attention_sink_bias", "_bias"))]
    assert set(weights) == set(twin)
    formats = {}
    for name in weights:
        module = name.rsplit(".", 1)[0]
        fmt = scheme.format_for(module) if name.endswith(".weight") else None
        if fmt is None:
            assert torch.equal(reader.get(name), twin[name]), name
            continue
        shape = tuple(twin[name].shape)
        stored = {suffix: reader.get(f"{module}.{suffix}") for suffix in fmt.tensor_shapes(shape)}
        fmt.check(stored, shape, module)
        assert torch.equal(fmt.decode(fmt.prepare(stored, shape), shape, torch.float32), twin[name]), name
        formats[name.split(".", 3)[-1] if ".mtp." not in name else "mtp." + name.split(".", 4)[-1]] = fmt.name
    assert formats["self_attn.q_proj.weight"] == formats["mlp.gate_proj.weight"] == "fp8_block"
    assert (
        formats["mlp.experts.3.down_proj.weight"] == "mxfp4"
        and formats["mtp.self_attn.k_proj.weight"] == "fp8_block"
    )
    assert (
        "model.layers.0.self_attn.o_proj.weight" in reader
        and scheme.format_for("model.layers.0.self_attn.o_proj") is None
    )
    # a rank's slice of a split tensor is the slice of the split
    part = reader.get_part("model.layers.1.self_attn.k_proj.weight", 0, 96, 96)
    assert torch.equal(part, reader.get("model.layers.1.self_attn.k_proj.weight")[96:])
    assert reader.shape("model.layers.1.self_attn.k_proj.weight_scale_inv") == (6, 1)


def test_vision_and_audio_tensors_are_skipped_with_one_log_line(v26, capfd):
    path, raw, canonical, _ = v26
    assert any(n.startswith("visual.") for n in load_file(str(path / "model.safetensors")))
    capfd.readouterr()
    reader = V26Reader(path, canonical, raw["quantization_config"])
    assert not any(n.startswith(("visual.", "audio_encoder.")) for n in reader.names())
    out = "".join(capfd.readouterr())
    assert out.count("vision / audio tensors skipped (text only)") == 1 and "tensors=2" in out


def test_release_qkv_split_blocks():
    canonical = canonical_config(MIMO_V26_RELEASE)
    quant = MIMO_V26_RELEASE["quantization_config"]
    # global layer 0: 1 KV head a chunk, K and V end mid-block; sliding layer 1: 2, every part on 128 rows
    for layer, kv, blocks in ((0, 1, [128, 64, 64]), (1, 2, [128, 128, 128])):
        fused = qkv_geometry(canonical, quant, f"model.layers.{layer}")
        assert (fused.chunks, fused.q_rows, fused.k_rows, fused.v_rows) == (4, 16 * 192, kv * 192, kv * 128)
        assert [fused.part_block(p)[0] for p in ("q_proj", "k_proj", "v_proj")] == blocks
    assert qkv_geometry(canonical, quant, "model.mtp.layers.0").k_rows == 2 * 192  # MTP attention slides


def test_a_scale_grid_not_tiled_per_chunk_is_a_checkpoint_error(v26, tmp_path):
    path, raw, canonical, _ = v26
    tensors = load_file(str(path / "model.safetensors"))
    name = "model.layers.0.self_attn.qkv_proj.weight_scale_inv"
    tensors[name] = tensors[name][:-1]  # one grid for the whole matrix, not one per chunk
    save_file(tensors, str(tmp_path / "model.safetensors"))
    reader = V26Reader(tmp_path, canonical, raw["quantization_config"])
    with pytest.raises(CheckpointError, match=r"qkv_proj\.weight_scale_inv.*scale rows"):
        reader.get("model.layers.0.self_attn.q_proj.weight_scale_inv")
