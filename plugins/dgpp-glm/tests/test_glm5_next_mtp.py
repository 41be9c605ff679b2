"""GLM-5.3-Flash's MTP layer as the release ships it (``model.language_model.layers.{num_hidden_layers}``, FP8 in both
releases), loaded through the plugin's draft hook and judged against the float64 reference written from the layout
(``glm5_next_reference.py``), fed the pre-final-norm streams' mean of transformers' main model on the dequantized twin."""

from __future__ import annotations

import json

import pytest
import torch
import transformers
from glm5_next_reference import mtp_logits
from glm_reference import load_f64

from dgpp.errors import CheckpointError
from dgpp.family import World
from dgpp.plugin_api import EngineConfig
from dgpp.plugins import manager
from dgpp.quant.fp8 import FP8Block
from dgpp.startup.loading import load_context, load_model
from dgpp.step.cache_spec import CompressedKV, LatentKV, WindowBuffer
from dgpp.testing.builders import load_reference
from dgpp.testing.mtp import draft_logits
from dgpp.testing.tp_ranks import assert_rank_matches_single, compared_outputs, run_on_ranks
from dgpp_glm.glm5_next_config import Glm5NextArchConfig
from dgpp_glm.glm5_next_draft import Glm5NextMTPDrafter
from dgpp_glm.testing_glm5_next_release import write_release_checkpoint

transformers.logging.set_verbosity_error()
RTOL = 1e-4


@pytest.fixture(scope="module")
def release(tmp_path_factory):
    root = tmp_path_factory.mktemp("glm5_next_mtp")
    packed, twin = write_release_checkpoint(root / "packed", root / "twin", seed=41)
    model = load_model(packed)
    drafter = manager().hook.dgpp_build_draft(ctx=load_context(packed, EngineConfig(mtp=True)), model=model)
    cfg = Glm5NextArchConfig.from_hf_config(json.loads((packed / "config.json").read_text()))
    return model, drafter, cfg, twin, packed


@torch.no_grad()
def _pre_norm_mean(twin, tokens: list[int]) -> torch.Tensor:
    """transformers' streams' mean after the last layer (the final norm's input) for ``tokens``."""
    reference = load_reference(twin)
    seen: list[torch.Tensor] = []
    hook = reference.model.language_model.norm.register_forward_hook(
        lambda _m, args, _out: seen.append(args[0])
    )
    try:
        reference.model.language_model(input_ids=torch.tensor([tokens]))
    finally:
        hook.remove()
    return seen[0][0].double()


def test_drafter_is_the_fp8_latent_block_with_its_pooled_indexer(release):
    _, drafter, cfg, _, _ = release
    assert isinstance(drafter, Glm5NextMTPDrafter) and len(drafter.layers) == 1
    layer = drafter.layers[0]
    assert layer.self_attn.indexer is not None and layer.shared_head.head is None
    assert isinstance(layer.self_attn.q_a_proj.quant_method.fmt, FP8Block)
    assert isinstance(layer.mlp.experts.fmt, FP8Block)  # the MTP layer's experts stay FP8 under dgpp_mixed
    spec = drafter.cache_spec()
    assert spec["mtp.0.self_attn"] == LatentKV.of(cfg.kv_lora_rank, 0, torch.float32)
    assert isinstance(spec["mtp.0.self_attn.indexer"], CompressedKV)
    assert isinstance(spec["mtp.0.self_attn.indexer.buffer"], WindowBuffer)


def test_mtp_logits_match_the_float64_reference(release):
    """21 tokens: 20 drafted rows, 5 pools of 4 against 2 selected, so the block's own sparse selection is live
    from row 11; the reference is fed transformers' pre-final-norm mean, so a drafter fed the post-norm hidden fails."""
    model, drafter, cfg, twin, _ = release
    tokens = torch.randint(3, cfg.vocab_size, (21,), generator=torch.Generator().manual_seed(42)).tolist()
    ours = draft_logits(model, drafter, tokens, [20]).double()
    weights = load_f64(twin / "model.safetensors")
    ref = mtp_logits(weights, _pre_norm_mean(twin, tokens[:-1]), torch.tensor(tokens[1:]), cfg)
    rel = float((ours - ref).abs().max() / ref.abs().max())
    assert rel < RTOL, f"MTP logits differ from the float64 reference by {rel:.3g} relative"
    indexer = drafter.layers[0].self_attn.indexer
    select = indexer.select_pools
    indexer.select_pools = (
        10**6
    )  # the block attending densely instead moves its logits (the selection is live)
    try:
        dense = draft_logits(model, drafter, tokens, [20]).double()
    finally:
        indexer.select_pools = select
    assert float((dense - ref).abs().max() / ref.abs().max()) > 1e-3


def test_mtp_chunked_prefill_equals_one_shot(release):
    """Chunks that end mid-pool: the open pool's rows wait in the block's ring and pool the same way."""
    model, drafter, cfg, _, _ = release
    tokens = torch.randint(3, cfg.vocab_size, (19,), generator=torch.Generator().manual_seed(43)).tolist()
    one_shot = draft_logits(model, drafter, tokens, [18])
    assert torch.equal(draft_logits(model, drafter, tokens, [5, 1, 6, 6]), one_shot)


def test_a_missing_mtp_tensor_is_a_checkpoint_error(release, tmp_path):
    from safetensors.torch import load_file, save_file

    _, _, cfg, twin, _ = release
    tensors = load_file(twin / "model.safetensors")
    del tensors[f"model.language_model.layers.{cfg.num_hidden_layers}.eh_proj.weight"]
    save_file(tensors, tmp_path / "model.safetensors", metadata={"format": "pt"})
    (tmp_path / "config.json").write_text((twin / "config.json").read_text())
    with pytest.raises(CheckpointError, match=r"layers\.5\.eh_proj\.weight"):
        manager().hook.dgpp_build_draft(
            ctx=load_context(tmp_path, EngineConfig(mtp=True)), model=load_model(tmp_path)
        )


@torch.inference_mode()
def _tp_run(path: str, world: World) -> dict:
    """The packed release and its drafter on one rank of ``world``: the main model's logits and greedy tokens, the
    drafter's logits of every row."""
    model = load_model(path, world=world)
    drafter = manager().hook.dgpp_build_draft(
        ctx=load_context(path, EngineConfig(mtp=True), world=world), model=model
    )
    tokens = torch.randint(
        3, model.info.vocab_size, (21,), generator=torch.Generator().manual_seed(44)
    ).tolist()
    return {
        **compared_outputs(model, lengths=(6, 27)),
        "draft": draft_logits(model, drafter, tokens, [20]),
        "mtp_heads": drafter.layers[0].self_attn.num_heads,
    }


def test_tp2_release_and_drafter_match_the_single_rank(release, tmp_path):
    """NVFP4 experts and FP8 blocks sliced over 2 ranks (the MTP layer's MLA heads and FP8 experts too): every rank's
    logits, greedy tokens and draft logits equal the single rank's."""
    packed = release[4]
    single = _tp_run(str(packed), World())
    for rank, got in enumerate(run_on_ranks(_tp_run, packed, tmp_path, 2)):
        assert got["mtp_heads"] == single["mtp_heads"] // 2
        assert_rank_matches_single(rank, got, single)
        torch.testing.assert_close(
            got["draft"], single["draft"], rtol=1e-5, atol=1e-5 * float(single["draft"].abs().max())
        )
