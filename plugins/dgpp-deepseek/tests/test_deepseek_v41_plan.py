"""DeepSeek-V4.1-Flash at release shapes: the config as shipped (root ``deepseek_v41``, backbone under
``text_config``) parses into its layer roles, and the w4 template's memory plan (built on meta in the release's
formats, nothing read) counts the kv sources' entries per token, the window rings per request, the Engram tables
apart from the GPU under ``engine.ngram_table: mmap``, and fits a 128 GB node (121 GiB usable)."""

from __future__ import annotations

import copy
import json
from pathlib import Path

import msgspec
import pytest
import torch
from safetensors.torch import save_file

from dgpp.config import load_config
from dgpp.errors import ConfigError
from dgpp.family import LoadContext, World
from dgpp.plugins import build_manager
from dgpp.startup.memory_plan import plan_for
from dgpp.step.memory import GiB
from dgpp_deepseek.v41_config import DeepseekV41ArchConfig
from dgpp_deepseek.v41_release import RELEASE_QUANTIZATION, RELEASE_TEXT_SHAPE

ENGRAM_ROWS = 384_006_168  # per Engram layer: 24 prime buckets just above 16M
V41_TEXT = {
    **RELEASE_TEXT_SHAPE,
    "num_hidden_layers": 40,
    "compress_ratios": [0, 0] + [2] * 18 + [1] * 20 + [0] * 3,  # the last 3: the DSpark draft stages
    "kv_source_layer_ids": [2, 8, 14, 20],
    "index_source_layer_ids": [2, 8, 14, 20, 24, 28, 32, 36],
    "candidate_source_layer_id": 20,
    "engram_layer_ids": [1, 14],
    "engram_num_embeddings": [ENGRAM_ROWS, ENGRAM_ROWS],
    "engram_vocab_size": 16_000_000,
    "num_nextn_predict_layers": 3,
    "dspark_block_size": 5,
    "dspark_noise_token_id": 128799,
    "dspark_target_layer_ids": [37, 38, 39],
    "dspark_markov_rank": 256,
    "dspark_n_routed_experts": 128,
    "dspark_num_experts_per_tok": 3,
}
V41_FLASH = {
    "architectures": ["DeepseekV41ForCausalLM"],
    "model_type": "deepseek_v41",
    "text_config": V41_TEXT,
    "torch_dtype": "bfloat16",
    "bos_token_id": 0,
    "eos_token_id": 1,
    "pad_token_id": 2,
    "tie_word_embeddings": False,
    "quantization_config": RELEASE_QUANTIZATION,
}
TEMPLATE = Path(__file__).resolve().parents[3] / "deploy" / "deepseek-v4.1-flash_mxfp4-fp8_w4.json"


def test_release_config_parses_into_its_roles():
    cfg = DeepseekV41ArchConfig.from_hf_config(V41_FLASH)
    assert cfg.num_hidden_layers == 40 and cfg.decoder_first_layer == 20
    assert [cfg.kv_source_of(layer) for layer in (0, 1, 2, 7, 8, 19, 20, 39)] == [-1, -1, 2, 2, 8, 14, 20, 20]
    assert [cfg.uses_candidates(layer) for layer in (20, 24, 25, 36)] == [False, True, False, True]
    assert cfg.engram_rows_per_token == 24 and cfg.rms_norm_eps == 1e-20


@pytest.mark.parametrize(
    "key,value,named",
    [
        ("compress_ratios", [0, 0] + [4] * 38, "compress_ratios"),
        ("kv_source_layer_ids", [2, 8, 14], "kv_source_layer_ids"),
        ("index_source_layer_ids", [8, 14, 20], "index_source_layer_ids"),
        ("candidate_source_layer_id", 21, "candidate_source_layer_id"),
        ("index_topk", 500, "index_topk"),
        ("scoring_func", "softmax", "scoring_func"),
    ],
)
def test_a_bad_role_is_refused_naming_the_key(key, value, named):
    bad = copy.deepcopy(V41_FLASH)
    bad["text_config"][key] = value
    with pytest.raises(ConfigError, match=named):
        DeepseekV41ArchConfig.from_hf_config(bad)


def _plan(tmp_path: Path, **engine: object):
    (tmp_path / "config.json").write_text(json.dumps(V41_FLASH))
    save_file({"head.weight": torch.zeros(1)}, tmp_path / "model.safetensors")  # names only
    deploy = load_config(TEMPLATE)
    deploy_engine = msgspec.structs.replace(deploy.engine, **engine)
    ctx = LoadContext(
        tmp_path, V41_FLASH, "deepseek", "DeepseekV41ForCausalLM", engine=deploy_engine, world=World(0, 4)
    )
    return deploy, plan_for(build_manager(), ctx)


def test_template_plan_fits_a_node(tmp_path):
    deploy, plan = _plan(tmp_path)
    assert deploy.world == 4 and deploy.engine.max_concurrency == 6 and deploy.engine.kv_capacity == 131072
    assert deploy.engine.ngram_table == "mmap"
    # the release ships the three DSpark stages: the template drafts a whole block of 5, scheduled by confidence
    assert deploy.engine.mtp and deploy.engine.mtp_depth == 5 and deploy.engine.mtp_schedule
    # per token, packed as the release stores it: each ratio-2 source a 512-wide FP4 entry (256 bytes + 32 E4M3
    # scales) and a 128-wide FP4 index key (64 bytes + 4 E8M0 scales) per 2 tokens, the ratio-1 source both per
    # token: the release's 890 bytes; and a context latent for each of the 3 DSpark stages, packed FP8 as the
    # window ring holds it (512 E4M3 codes + 16 E8M0 scales)
    assert plan.kv_per_token == 3 * (288 + 68) // 2 + (288 + 68) + 3 * (512 + 16) == 890 + 1584
    # routed experts are the bulk: 40 layers x 384 and 3 stages x 128, x 3 x 5120 x 2304 MXFP4 (0.5 B + one E8M0
    # per 32) / world
    experts = (40 * 384 + 3 * 128) * 3 * 5120 * 2304 * 17 // 32 // 4
    assert experts < plan.weights < experts + 16 * GiB
    assert any("memory-mapped" in note for note in plan.notes)
    assert plan.fits(121 * GiB), plan.describe()


def test_without_drafts_the_plan_holds_the_packed_890_bytes(tmp_path):
    _, drafting = _plan(tmp_path)
    _, plain = _plan(tmp_path, mtp=False)
    assert plain.kv_per_token == 890
    assert "compressed entries and index keys (packed FP4) 890 B/token" in plain.notes[1]
    assert drafting.notes[1].endswith("DSpark context rows (packed FP8) 1584 B/token")
    # the three stages (128 MXFP4 experts top-3 each, FP8 attention, BF16 Markov heads) as this rank holds them
    assert 2 * GiB < drafting.weights - plain.weights < 2.5 * GiB


def test_resident_engram_tables_count_with_the_weights(tmp_path):
    _, mapped = _plan(tmp_path, ngram_table="mmap")
    _, resident = _plan(tmp_path, ngram_table="resident")
    assert resident.weights - mapped.weights == 2 * ENGRAM_ROWS * (256 + 8)
