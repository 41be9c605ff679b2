"""MiMo-V2.6 as shipped under tensor parallelism (2 ranks, gloo on CPU), as the w2 template runs it: each rank
takes its chunks' share of the split FP8 q/k/v (scale blocks re-blocked where a rank's rows start mid-block), its
MXFP4 experts' intermediate slice and its heads' sinks; the MTP layer splits the same way. Every rank's logits,
greedy tokens and MTP draft logits equal the single-rank model's."""

from __future__ import annotations

import torch

from dgpp.family import World
from dgpp.plugin_api import EngineConfig
from dgpp.plugins import manager
from dgpp.startup.loading import load_context, load_model
from dgpp.testing.mtp import draft_logits
from dgpp.testing.tp_ranks import assert_rank_matches_single, compared_outputs, run_on_ranks
from dgpp_mimo.testing import build_tiny_mimo
from dgpp_mimo.testing_v26 import write_v26_checkpoint

WORLD = 2


@torch.inference_mode()
def _run(path: str, world: World) -> dict:
    model = load_model(path, world=world)
    drafter = manager().hook.dgpp_build_draft(
        ctx=load_context(path, EngineConfig(mtp=True), world=world), model=model
    )
    k_proj = model.model.layers[0].self_attn.k_proj
    tokens = torch.randint(
        0, model.info.vocab_size, (21,), generator=torch.Generator().manual_seed(41)
    ).tolist()
    return {
        **compared_outputs(model),
        "draft": draft_logits(model, drafter, tokens, [20]),
        "k_rows": k_proj.quant_method.local_shape(k_proj)[0],
    }


def test_tp2_matches_single_rank(tmp_path):
    # experts of 64 so a rank's down_proj keeps whole MXFP4 groups of 32 (the release: 2048 -> 1024 per rank)
    flash = build_tiny_mimo(tmp_path / "flash", seed=42, moe_intermediate_size=64)
    v26, _ = write_v26_checkpoint(flash, tmp_path / "v26", tmp_path / "twin", mtp_layers=1, seed=43)
    single = _run(str(v26), World())
    for rank, got in enumerate(run_on_ranks(_run, v26, tmp_path, WORLD)):
        assert got["k_rows"] == single["k_rows"] // 2 == 48  # one of the global layer's 2 KV heads of 48
        assert_rank_matches_single(rank, got, single)
        ref = single["draft"]
        torch.testing.assert_close(got["draft"], ref, rtol=1e-5, atol=1e-5 * float(ref.abs().max()))
