"""qwen4_exp's MTP layer (``mtp.*``), loaded through the Qwen plugin's ``dgpp_build_draft`` hook, vs a float64
reference: transformers has no MTP module for qwen4_exp, so the reference runs transformers' own decoder-layer
and gated-residual classes in float64 on the ``mtp.*`` tensors, glued as the spec says (draft.py)."""

from __future__ import annotations

import pytest
import torch
from safetensors.torch import load_file

from dgpp.family import LoadContext
from dgpp.plugins import manager
from dgpp.startup.loading import load_model, read_hf_config
from dgpp.testing.mtp import draft_logits
from dgpp_qwen.qwen4_exp_mtp import Qwen4ExpMTPDrafter
from dgpp_qwen.testing_qwen4_exp import build_tiny_qwen4_exp, mtp_reference_logits

RTOL = 1e-4


@pytest.fixture(scope="module")
def loaded(tmp_path_factory):
    path = build_tiny_qwen4_exp(tmp_path_factory.mktemp("qwen4_exp_mtp"), seed=13, with_mtp=True)
    model = load_model(path)
    ctx = LoadContext(path, read_hf_config(path), "qwen", "Qwen4ExpForCausalLM")
    drafter = manager().hook.dgpp_build_draft(ctx=ctx, model=model)
    return path, model, drafter


def test_drafter_loads_mtp_tensors(loaded):
    path, _, drafter = loaded
    assert isinstance(drafter, Qwen4ExpMTPDrafter)
    assert set(drafter.cache_spec()) == {
        "mtp.layers.0",
        "mtp.layers.0.indexer",
        "mtp.layers.0.indexer.blocks",
    }
    stored = load_file(str(path / "model.safetensors"))
    torch.testing.assert_close(drafter.fc.weight, stored["mtp.fc.weight"], rtol=0, atol=0)
    indexer = drafter.layers[0].self_attn.indexer.index_qk_proj.weight
    torch.testing.assert_close(
        indexer, stored["mtp.layers.0.self_attn.indexer.index_qk_proj.weight"], rtol=0, atol=0
    )


@pytest.mark.parametrize("chunks", [[30], [7, 12, 11]], ids=["one_shot", "chunked"])
def test_mtp_logits_match_float64_reference(loaded, chunks):
    """30 positions: past the indexer's dense limit (19), so the MTP layer's QSA runs sparse too."""
    path, model, drafter = loaded
    tokens = torch.randint(0, 512, (31,), generator=torch.Generator().manual_seed(14)).tolist()
    ours = draft_logits(model, drafter, tokens, chunks).double()
    theirs = mtp_reference_logits(path, tokens)
    worst = float(((ours - theirs).abs().max(-1).values / theirs.abs().max()).max())
    assert worst < RTOL, f"MTP logits differ from the float64 reference by {worst:.3g} relative"


def test_checkpoint_without_mtp_has_no_drafter(tmp_path):
    path = build_tiny_qwen4_exp(tmp_path, seed=15)
    ctx = LoadContext(path, read_hf_config(path), "qwen", "Qwen4ExpForCausalLM")
    assert manager().hook.dgpp_build_draft(ctx=ctx, model=load_model(path)) is None
