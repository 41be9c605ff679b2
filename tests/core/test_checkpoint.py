"""Checkpoint reading and loading: clear errors naming tensor and file, sharded index, fused experts,
per-rank slicing hooks."""

from __future__ import annotations

import json
import shutil

import pytest
import torch
from safetensors.torch import load_file, save_file

from dgpp.checkpoint import CheckpointReader, load_weights
from dgpp.errors import CheckpointError
from dgpp.family import World
from dgpp.nn.linear import Linear
from dgpp.nn.moe import FusedExperts
from dgpp.nn.weights import default_weight_loader
from dgpp.startup.loading import load_model
from dgpp.testing import conformance as conf
from dgpp.testing.builders import build_tiny_checkpoint


@pytest.fixture(scope="module")
def qwen3_dir(tmp_path_factory):
    return build_tiny_checkpoint("qwen3", tmp_path_factory.mktemp("qwen3"))


def _edited_copy(src, dst, edit):
    shutil.copytree(src, dst)
    tensors = load_file(str(dst / "model.safetensors"))
    edit(tensors)
    save_file(tensors, str(dst / "model.safetensors"), metadata={"format": "pt"})
    return dst


def test_missing_tensor_names_tensor_and_checkpoint(qwen3_dir, tmp_path):
    name = "model.layers.1.self_attn.k_norm.weight"
    path = _edited_copy(qwen3_dir, tmp_path / "ckpt", lambda t: t.pop(name))
    with pytest.raises(
        CheckpointError, match=rf"'{name}'.*missing from {tmp_path / 'ckpt'}/model\.safetensors$"
    ):
        load_model(path)


def test_missing_tensor_in_sharded_checkpoint_names_the_index(tmp_path):
    path = build_tiny_checkpoint("qwen3", tmp_path, seed=1, max_shard_size="60KB")
    index = json.loads((path / "model.safetensors.index.json").read_text())
    del index["weight_map"]["model.norm.weight"]
    (path / "model.safetensors.index.json").write_text(json.dumps(index))
    with pytest.raises(
        CheckpointError, match=r"'model\.norm\.weight'.*missing from .*model\.safetensors\.index\.json"
    ):
        load_model(path)


def test_wrong_shape_names_tensor_file_and_shapes(qwen3_dir, tmp_path):
    name = "model.layers.0.self_attn.q_proj.weight"

    def shrink(t):
        t[name] = t[name][:63]

    path = _edited_copy(qwen3_dir, tmp_path / "ckpt", shrink)
    with pytest.raises(
        CheckpointError, match=rf"'{name}' in .*model\.safetensors: shape \[63, 64\] .* \[64, 64\]"
    ):
        load_model(path)


def test_integer_tensor_for_float_parameter_is_refused(qwen3_dir, tmp_path):
    name = "model.norm.weight"

    def to_int(t):
        t[name] = t[name].to(torch.int8)

    path = _edited_copy(qwen3_dir, tmp_path / "ckpt", to_int)
    with pytest.raises(CheckpointError, match=rf"'{name}'.*dtype torch.int8"):
        load_model(path)


def test_index_naming_an_absent_shard(qwen3_dir, tmp_path):
    path = shutil.copytree(qwen3_dir, tmp_path / "ckpt")
    names = CheckpointReader(path).names()
    weight_map = {
        n: ("model-00002-of-00002.safetensors" if i % 2 else "model.safetensors") for i, n in enumerate(names)
    }
    (path / "model.safetensors.index.json").write_text(json.dumps({"metadata": {}, "weight_map": weight_map}))
    with pytest.raises(CheckpointError, match="model-00002-of-00002.safetensors.*missing"):
        CheckpointReader(path)


def test_empty_directory_and_missing_config(tmp_path):
    with pytest.raises(CheckpointError, match=r"no \*\.safetensors"):
        CheckpointReader(tmp_path)
    with pytest.raises(CheckpointError, match="config.json"):
        load_model(tmp_path)
    with pytest.raises(CheckpointError, match="does not exist"):
        CheckpointReader(tmp_path / "nope")


def test_reader_shapes_dtypes_and_unused_tensors(qwen3_dir, tmp_path):
    path = _edited_copy(
        qwen3_dir, tmp_path / "ckpt", lambda t: t.update({"mtp.fc.weight": torch.zeros(2, 2)})
    )
    reader = CheckpointReader(path)
    assert reader.shape("lm_head.weight") == (512, 64) and reader.dtype("lm_head.weight") == torch.float32
    model = load_model(qwen3_dir)
    report = load_weights(model, reader)
    assert report.unused == ["mtp.fc.weight"]
    assert len(report.loaded) == len(list(model.parameters()))


def test_fused_expert_layout_loads_like_per_expert(tmp_path):
    per_expert = build_tiny_checkpoint("qwen3_moe", tmp_path / "a", seed=3)

    def fuse(t):
        for layer in range(2):
            p = f"model.layers.{layer}.mlp.experts"
            experts = range(8)
            gate = torch.stack([t.pop(f"{p}.{e}.gate_proj.weight") for e in experts])
            up = torch.stack([t.pop(f"{p}.{e}.up_proj.weight") for e in experts])
            t[f"{p}.gate_up_proj"] = torch.cat([gate, up], dim=1)
            t[f"{p}.down_proj"] = torch.stack([t.pop(f"{p}.{e}.down_proj.weight") for e in experts])

    fused = _edited_copy(per_expert, tmp_path / "b", fuse)
    prompts = conf.make_prompts(512, (7,), seed=1)
    a = conf.engine_all_logits(load_model(per_expert), prompts)[0]
    assert torch.equal(conf.engine_all_logits(load_model(fused), prompts)[0], a)


def test_default_weight_loader_slices_for_the_rank():
    full = torch.arange(8 * 6, dtype=torch.float32).view(8, 6)
    col = Linear(6, 8, parallel="column", world=World(rank=1, size=2))
    default_weight_loader(col.weight, full)
    assert torch.equal(col.weight, full[4:])
    row = Linear(6, 8, parallel="row", world=World(rank=1, size=2))
    default_weight_loader(row.weight, full)
    assert torch.equal(row.weight, full[:, 3:])
    with pytest.raises(ValueError, match=r"shape \[8, 4\] does not match the expected \[8, 6\]"):
        default_weight_loader(row.weight, full[:, :4])


def test_fused_experts_slice_each_half_for_the_rank():
    experts = FusedExperts(2, 4, 6, dtype=torch.float32, world=World(rank=1, size=2))
    gate = torch.randn(2, 6, 4)
    up = torch.randn(2, 6, 4)
    down = torch.randn(2, 4, 6)
    experts.gate_up_proj.weight_loader(experts.gate_up_proj, torch.cat([gate, up], dim=1))
    assert torch.equal(experts.gate_up_proj, torch.cat([gate[:, 3:], up[:, 3:]], dim=1))
    experts.down_proj.weight_loader(experts.down_proj, down[1], 1)
    assert torch.equal(experts.down_proj[1], down[1][:, 3:])


def test_tp_rank_reads_only_its_slice(qwen3_dir):
    reader = CheckpointReader(qwen3_dir)
    name = "model.layers.0.mlp.down_proj.weight"
    full = reader.get(name)
    assert torch.equal(reader.get_part(name, 1, 64, 64), full[:, 64:])
    model_rank1 = load_model(qwen3_dir, world=World(rank=1, size=2))
    layer = model_rank1.model.layers[0]
    assert torch.equal(layer.mlp.down_proj.weight, full[:, 64:])
    assert torch.equal(
        layer.self_attn.q_proj.weight, reader.get("model.layers.0.self_attn.q_proj.weight")[32:]
    )
