"""MiMo-V2.6-Flash at release size: the w2 template validates, and its memory plan (model and MTP layer built
on meta for one rank with the release's formats: FP8 q/k/v and dense MLP, MXFP4 experts, BF16 o_proj / head)
counts paged K/V for the 9 global layers only and a 127-position ring per request for each of the 39 sliding
layers, and fits a 128 GB node."""

from __future__ import annotations

import json
from pathlib import Path

import msgspec
import torch
from safetensors.torch import save_file

from dgpp.config import load_config
from dgpp.family import LoadContext, World
from dgpp.plugins import build_manager
from dgpp.startup.kv_format import refuse_unstored_kv
from dgpp.startup.memory_plan import plan_for
from dgpp.step.memory import GiB
from dgpp_mimo.testing_v26 import MIMO_V26_RELEASE

TEMPLATE = Path(__file__).resolve().parents[3] / "deploy" / "mimo-v2.6-flash_mxfp4-fp8_w2.json"
BF16 = 2


def _plan(tmp_path, engine):
    (tmp_path / "config.json").write_text(json.dumps(MIMO_V26_RELEASE))
    save_file({"lm_head.weight": torch.zeros(1)}, tmp_path / "model.safetensors")  # names only
    ctx = LoadContext(
        tmp_path,
        MIMO_V26_RELEASE,
        "mimo",
        "MiMoV2ForCausalLM",
        engine=engine,
        world=World(0, 2),
        dtype=torch.bfloat16,
    )
    return plan_for(build_manager(), ctx)


def test_template_validates():
    deploy = load_config(TEMPLATE)
    assert TEMPLATE.is_symlink() and deploy.model == "XiaomiMiMo/MiMo-V2.6-Flash-RL" and deploy.world == 2
    assert deploy.engine.mtp and deploy.engine.mtp_depth == 1 and deploy.engine.bf16_weights == "bf12"
    refuse_unstored_kv(deploy.engine, torch.bfloat16)  # a K/V format this build stores (dgpp check and serve)


def test_w2_plan_counts_window_bounded_kv_and_fits_a_node(tmp_path):
    deploy = load_config(TEMPLATE)
    plan = _plan(tmp_path, deploy.engine)
    per_head = (192 + 128) * BF16
    # 9 global layers x 2 of 4 KV heads per rank, plus the MTP layer's paged K/V (4 of its 8 heads)
    assert plan.kv_per_token == 9 * 2 * per_head + 4 * per_head == 14_080
    # 39 sliding layers x 127 ring positions x 4 of 8 KV heads per rank
    assert plan.state_per_request == 39 * 127 * 4 * per_head
    # kv_dtype fp8: 1 byte per K/V value plus an fp32 scale per K row and per V row, pool, rings and MTP layer alike
    plan8 = _plan(tmp_path, msgspec.structs.replace(deploy.engine, kv_dtype="fp8"))
    assert plan8.kv_per_token == (9 * 2 + 4) * (192 + 128 + 8) == 7_216
    assert plan8.state_per_request == 39 * 127 * 4 * (192 + 128 + 8) == 6_498_336
    # experts: 47 layers x 256 x 3 projections of 4096 x 2048 at 4.25 bits, half per rank
    experts = 47 * 256 * 3 * 4096 * 2048 * (0.5 + 1 / 32) / 2
    assert experts < plan.weights < experts + 8 * GiB
    assert 84e9 < plan.weights < 87e9  # the original engine: ~86 GB of weights per rank at w2
    assert 0 < plan.drafter < 1 * GiB  # MTP layer 0: FP8 attention and MLP, BF16 eh_proj / o_proj
    assert plan.fits(121 * GiB)
