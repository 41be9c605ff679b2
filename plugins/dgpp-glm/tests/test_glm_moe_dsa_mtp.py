"""Full GLM-5.3's MTP layer (``model.layers.{num_hidden_layers}``: an MLA + DSA indexer + MoE block with GLM's
MTP-only tensors), loaded through the plugin's draft hook and judged against transformers' own decoder block
holding the same tensors, fed the post-final-norm hidden of transformers' main model."""

from __future__ import annotations

import json

import pytest
import torch
import transformers

from dgpp.errors import CheckpointError
from dgpp.family import LoadContext
from dgpp.plugins import manager
from dgpp.startup.loading import load_model, read_hf_config
from dgpp.step.cache_spec import LatentKV, PagedKV
from dgpp.testing.builders import load_reference
from dgpp.testing.mtp import draft_logits
from dgpp_glm.glm5_draft import GlmMoeDsaMTPDrafter
from dgpp_glm.testing_glm5 import build_tiny_glm_moe_dsa

transformers.logging.set_verbosity_error()
LAYERS = 4  # the tiny stack; the MTP layer is model.layers.4


def _ctx(path) -> LoadContext:
    return LoadContext(path, read_hf_config(path), "glm", "GlmMoeDsaForCausalLM")


@pytest.fixture(scope="module", params=[False, True], ids=["shares_main_head", "own_head"])
def loaded(request, tmp_path_factory):
    path = build_tiny_glm_moe_dsa(
        tmp_path_factory.mktemp("glm5_mtp"), seed=31, mtp_layers=1, mtp_own_head=request.param
    )
    model = load_model(path)
    return path, model, manager().hook.dgpp_build_draft(ctx=_ctx(path), model=model)


def _rms(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps) * weight


@torch.no_grad()
def _reference_logits(path, tokens: list[int]) -> torch.Tensor:
    """transformers' main model gives the hidden rows; a one-block transformers model holding the MTP layer's
    tensors (its norm = ``shared_head.norm``, its head the MTP head or the main one) runs the block over
    ``eh_proj([enorm(embed(token p + 1)) | hnorm(hidden p)])``."""
    from safetensors.torch import load_file, save_file

    main = load_reference(path)
    ids = torch.tensor(tokens)
    hidden = main.model(input_ids=ids[None, :-1]).last_hidden_state[0]
    weights = load_file(path / "model.safetensors")
    mtp = f"model.layers.{LAYERS}."
    # the block as a one-layer checkpoint, so transformers reads its per-expert tensors as it reads the release's
    block_dir = path.parent / (path.name + "_mtp_block")
    block_dir.mkdir(exist_ok=True)
    mtp_only = ("enorm.", "hnorm.", "eh_proj.", "shared_head.", "embed_tokens.")
    state = {
        k.replace(mtp, "model.layers.0."): v.clone()
        for k, v in weights.items()
        if k.startswith(mtp) and not k[len(mtp) :].startswith(mtp_only)
    }
    state["model.norm.weight"] = weights[mtp + "shared_head.norm.weight"]
    state["lm_head.weight"] = weights.get(mtp + "shared_head.head.weight", weights["lm_head.weight"])
    state["model.embed_tokens.weight"] = weights["model.embed_tokens.weight"]
    save_file(state, block_dir / "model.safetensors", metadata={"format": "pt"})
    cfg = json.loads((path / "config.json").read_text())
    cfg.update(
        num_hidden_layers=1,
        indexer_types=["full"],
        mlp_layer_types=["sparse"],
        layer_types=["indexed_attention"],
    )
    (block_dir / "config.json").write_text(json.dumps(cfg))
    block = load_reference(block_dir)
    eps = cfg["rms_norm_eps"]
    embed = weights.get(mtp + "embed_tokens.weight", weights["model.embed_tokens.weight"])
    x = (
        torch.cat(
            [
                _rms(embed[ids[1:]], weights[mtp + "enorm.weight"], eps),
                _rms(hidden, weights[mtp + "hnorm.weight"], eps),
            ],
            dim=-1,
        )
        @ weights[mtp + "eh_proj.weight"].t()
    )
    return block(inputs_embeds=x[None]).logits[0].float()


def test_drafter_is_the_latent_block_with_its_indexer(loaded):
    path, _, drafter = loaded
    assert isinstance(drafter, GlmMoeDsaMTPDrafter) and len(drafter.layers) == 1
    layer = drafter.layers[0]
    assert layer.self_attn.indexer is not None and type(layer.mlp).__name__ == "SparseMoE"
    own = "shared_head.head.weight" in json.dumps(list(drafter.state_dict()))
    assert (layer.shared_head.head is not None) == own == (layer.embed_tokens is not None)
    assert drafter.cache_spec() == {
        "mtp.0.self_attn": LatentKV.of(32, 8, torch.float32),
        "mtp.0.self_attn.indexer": PagedKV(
            1, 16, torch.float32, v_head_dim=0, fp8_rows=True, index_keys=True
        ),
    }


def test_mtp_logits_match_transformers_block(loaded):
    """21 tokens: 20 drafted rows over an index_topk of 8, so the MTP block's own sparse selection is live."""
    path, model, drafter = loaded
    tokens = torch.randint(3, 512, (21,), generator=torch.Generator().manual_seed(32)).tolist()
    ours = draft_logits(model, drafter, tokens, [20])
    ref = _reference_logits(path, tokens)
    rel = float((ours - ref).abs().max() / ref.abs().max())
    assert rel < 1e-4, f"MTP logits differ from transformers' block by {rel:.3g} relative"
    indexer = drafter.layers[0].self_attn.indexer
    indexer.topk = 10**6  # the block attending densely instead moves its logits (the selection is live)
    try:
        dense = draft_logits(model, drafter, tokens, [20])
    finally:
        indexer.topk = 8
    assert float((dense - ref).abs().max() / ref.abs().max()) > 1e-3


def test_mtp_chunked_prefill_equals_one_shot(loaded):
    _, model, drafter = loaded
    tokens = torch.randint(3, 512, (18,), generator=torch.Generator().manual_seed(33)).tolist()
    one_shot = draft_logits(model, drafter, tokens, [17])
    assert torch.equal(draft_logits(model, drafter, tokens, [5, 1, 11]), one_shot)


def test_missing_mtp_tensor_is_a_checkpoint_error(tmp_path):
    path = build_tiny_glm_moe_dsa(tmp_path, seed=3)
    model = load_model(path)
    assert manager().hook.dgpp_build_draft(ctx=_ctx(path), model=model) is None
    cfg = json.loads((path / "config.json").read_text())
    cfg["num_nextn_predict_layers"] = 1
    (path / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(CheckpointError, match=r"model\.layers\.4\.eh_proj\.weight"):
        manager().hook.dgpp_build_draft(ctx=_ctx(path), model=load_model(path))
