"""GLM-4.7's MTP layer (``model.layers.{num_hidden_layers}``): loaded through the plugin's draft hook and
judged against the float64 reference written from the spec (``reference.py``), fed the post-final-norm
hidden of the main model."""

from __future__ import annotations

import json

import pytest
import torch
from glm_reference import load_f64, main_hidden, mtp_logits

from dgpp.errors import CheckpointError
from dgpp.family import LoadContext
from dgpp.startup.loading import load_model, read_hf_config
from dgpp.testing.mtp import draft_logits as _draft_logits
from dgpp_glm.config import Glm4MoeArchConfig
from dgpp_glm.draft import Glm4MoeMTPDrafter, build_draft
from dgpp_glm.testing_glm4 import build_tiny_glm4_moe

RTOL = 1e-4


def _ctx(path) -> LoadContext:
    return LoadContext(path, read_hf_config(path), "glm", "Glm4MoeForCausalLM")


@pytest.fixture(scope="module", params=[False, True], ids=["shares_main_head", "own_head"])
def loaded(request, tmp_path_factory):
    path = build_tiny_glm4_moe(tmp_path_factory.mktemp("glm_mtp"), seed=11, mtp_own_head=request.param)
    model = load_model(path)
    drafter = build_draft(_ctx(path), model)
    cfg = Glm4MoeArchConfig.from_hf_config(json.loads((path / "config.json").read_text()))
    return model, drafter, cfg, load_f64(path / "model.safetensors")


def _reference(weights, cfg, tokens: list[int]) -> torch.Tensor:
    ids = torch.tensor(tokens)
    hidden = main_hidden(weights, ids[:-1], cfg)
    return mtp_logits(weights, hidden, ids[1:], torch.arange(len(tokens) - 1), cfg)


def test_drafter_loads_mtp_tensors(loaded):
    model, drafter, cfg, weights = loaded
    assert isinstance(drafter, Glm4MoeMTPDrafter) and cfg.num_mtp_layers == 1
    layer = drafter.layers[0]
    own = f"model.layers.{cfg.num_hidden_layers}.shared_head.head.weight" in weights
    assert (layer.shared_head.head is not None) == own and (layer.embed_tokens is not None) == own
    torch.testing.assert_close(
        layer.eh_proj.weight.double(), weights[f"model.layers.{cfg.num_hidden_layers}.eh_proj.weight"]
    )
    assert set(drafter.cache_spec()) == {"mtp.0.self_attn"}


def test_mtp_logits_match_float64_reference(loaded):
    model, drafter, cfg, weights = loaded
    tokens = torch.randint(0, cfg.vocab_size, (21,), generator=torch.Generator().manual_seed(12)).tolist()
    ours = _draft_logits(model, drafter, tokens, [20])
    ref = _reference(weights, cfg, tokens)
    rel = float((ours.double() - ref).abs().max() / ref.abs().max())
    assert rel < RTOL, f"MTP logits differ from the float64 reference by {rel:.3g} relative"


def test_mtp_chunked_prefill_equals_one_shot(loaded):
    model, drafter, cfg, _ = loaded
    tokens = torch.randint(0, cfg.vocab_size, (15,), generator=torch.Generator().manual_seed(13)).tolist()
    one_shot = _draft_logits(model, drafter, tokens, [14])
    chunked = _draft_logits(model, drafter, tokens, [5, 1, 8])
    assert torch.equal(one_shot.argmax(-1), chunked.argmax(-1))
    torch.testing.assert_close(chunked, one_shot, rtol=1e-5, atol=1e-5)


def test_missing_mtp_tensor_is_a_checkpoint_error(tmp_path):
    path = build_tiny_glm4_moe(tmp_path, seed=3, num_nextn_predict_layers=0)
    cfg = json.loads((path / "config.json").read_text())
    assert build_draft(_ctx(path), load_model(path)) is None
    cfg["num_nextn_predict_layers"] = 1
    (path / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(CheckpointError, match=r"model\.layers\.3\.eh_proj\.weight"):
        build_draft(_ctx(path), load_model(path))
