"""The release's ``mtp.<s>.*`` draft stages are loaded and named (every tensor finds its module), never run:
the logits are those of the same checkpoint without them, and the memory plan counts them."""

from __future__ import annotations

import json
import shutil

import pytest
import torch
from safetensors.torch import load_file, save_file

from dgpp.plugin_api import CheckpointReader, load_weights
from dgpp.plugins import build_manager
from dgpp.startup.loading import load_context, load_model
from dgpp.startup.memory_plan import plan_for
from dgpp.testing import conformance as conf
from dgpp_deepseek.loader import checkpoint_name
from dgpp_deepseek.testing import build_tiny_deepseek_v4


def _add_stages(src, dst) -> dict[str, torch.Tensor]:
    """``src`` plus two draft stages: stage 0 a copy of layer 3 (CSA, learned routing) with V4-Flash's MTP
    tensors, stage 1 of layer 1 (HCA; its hash table swapped for a router bias) with DSpark-style heads."""
    shutil.copytree(src, dst)
    tensors = load_file(dst / "model.safetensors")
    gen = torch.Generator().manual_seed(7)
    hidden = tensors["embed.weight"].shape[1]
    vocab = tensors["embed.weight"].shape[0]
    extra: dict[str, torch.Tensor] = {}
    for stage, layer in ((0, 3), (1, 1)):
        for name, t in tensors.items():
            if name.startswith(f"layers.{layer}.") and not name.endswith("tid2eid"):
                extra[f"mtp.{stage}." + name.removeprefix(f"layers.{layer}.")] = t.clone()
        extra[f"mtp.{stage}.ffn.gate.bias"] = torch.randn(8, generator=gen)
        for part, shape in (
            ("enorm.weight", (hidden,)),
            ("hnorm.weight", (hidden,)),
            ("norm.weight", (hidden,)),
            ("e_proj.weight", (hidden, hidden)),
            ("h_proj.weight", (hidden, hidden)),
            ("hc_head_fn", (4, 4 * hidden)),
            ("hc_head_base", (4,)),
            ("hc_head_scale", (1,)),
        ):
            extra[f"mtp.{stage}.{part}"] = torch.randn(shape, generator=gen)
    extra["mtp.1.markov_head.markov_w1"] = torch.randn(vocab, 8, generator=gen)
    extra["mtp.1.confidence_head.proj.weight"] = torch.randn(1, hidden + 8, generator=gen)
    save_file({**tensors, **extra}, dst / "model.safetensors", metadata={"format": "pt"})
    return extra


@pytest.fixture(scope="module")
def pair(tmp_path_factory):
    root = tmp_path_factory.mktemp("dsv4_mtp")
    plain = build_tiny_deepseek_v4(root / "plain", seed=5)
    extra = _add_stages(plain, root / "with_mtp")
    return plain, root / "with_mtp", extra


def test_every_draft_tensor_is_loaded_and_named(pair):
    _, with_mtp, extra = pair
    model = load_model(with_mtp)
    assert len(model.mtp) == 2
    assert model.mtp[0].attn.indexer is not None and model.mtp[1].attn.compressor is not None
    assert model.mtp[1].attn.indexer is None and type(model.mtp[0].ffn.gate).__name__ == "TopKRouter"
    reader = CheckpointReader(with_mtp)
    try:  # loading again reports every checkpoint tensor used: the draft stages' included
        assert load_weights(model, reader, rename=checkpoint_name).unused == []
    finally:
        reader.close()
    stage0, stage1 = model.mtp
    assert torch.equal(stage0.e_proj.weight, extra["mtp.0.e_proj.weight"])
    assert torch.equal(stage0.enorm.weight, extra["mtp.0.enorm.weight"])
    assert torch.equal(stage0.hc_head.hc_fn, extra["mtp.0.hc_head_fn"])
    assert torch.equal(stage0.attn.wq_a.weight, extra["mtp.0.attn.wq_a.weight"])
    assert torch.equal(stage0.ffn.gate.e_score_correction_bias, extra["mtp.0.ffn.gate.bias"])
    gate_up = torch.cat([extra["mtp.0.ffn.experts.5.w1.weight"], extra["mtp.0.ffn.experts.5.w3.weight"]])
    assert torch.equal(stage0.ffn.experts.gate_up_proj[5], gate_up)
    assert torch.equal(stage1.markov_head.markov_w1, extra["mtp.1.markov_head.markov_w1"])
    assert torch.equal(stage1.confidence_head.proj.weight, extra["mtp.1.confidence_head.proj.weight"])


def test_draft_stages_do_not_change_the_logits_and_are_planned(pair):
    plain, with_mtp, _ = pair
    a, b = load_model(plain), load_model(with_mtp)
    prompts = conf.make_prompts(a.info.vocab_size, (6, 21), seed=1)
    for x, y in zip(conf.engine_all_logits(a, prompts), conf.engine_all_logits(b, prompts), strict=True):
        assert torch.equal(x, y)
    pm = build_manager()
    grown = (
        plan_for(pm, load_context(with_mtp, pm=pm)).weights - plan_for(pm, load_context(plain, pm=pm)).weights
    )
    stages = sum(p.numel() * p.element_size() for p in b.mtp.parameters())
    assert grown == stages > 0
    assert json.loads((with_mtp / "config.json").read_text())["model_type"] == "deepseek_v4"
