"""DeepSeek-V4.1-Flash's DSpark draft stages as a block drafter (``engine.mtp``) on the tiny release-layout fixture
with three stages added (``add_dspark_stages_v41``: FP8 blocks, MXFP4 experts, BF16 heads): the features are the
stream means entering the target layers' attention (against the float64 reference's trace); a block's base
logits, collapsed rows, Markov drafts and confidences match the float64 reference
(``deepseek_v41_reference_dspark``); greedy transcripts with the drafter equal plain greedy (chunked or not,
solo or batched, several depths, blocks that stand several drafts deep); the memory plan counts the stages and
their context rows; bad settings name their key."""

from __future__ import annotations

import functools
import json

import pytest
import torch
from deepseek_v41_fixture import add_dspark_stages_v41, fit_markov_bigrams
from deepseek_v41_reference import load_reference
from deepseek_v41_reference_dspark import DSparkReference
from test_deepseek_v41 import build_fp32_fixture

from dgpp.engine.block_draft import BlockDraftDecoder
from dgpp.engine.runner import ModelRunner
from dgpp.family import LoadContext
from dgpp.plugin_api import CheckpointError, ConfigError, EngineConfig
from dgpp.plugins import build_manager, manager
from dgpp.startup.loading import load_context, load_model, read_hf_config
from dgpp.startup.memory_plan import plan_for
from dgpp.step.pools import CachePools
from dgpp.testing.block_draft import (
    check_blocks,
    check_drafted_together_equals_alone,
    check_exact_with_drafts,
    prefill_features,
    serve_greedy,
)
from dgpp_deepseek.v41_draft_stages import DSparkV41Config
from dgpp_deepseek.v41_dspark import DSparkV41Drafter

BS, BLOCKS, BLOCK, TARGETS = 4, 160, 4, (7, 8, 9)
_GEN = torch.Generator().manual_seed(23)
_SHARED = torch.randint(3, 500, (12,), generator=_GEN).tolist()
PROMPTS = [torch.randint(3, 500, (n,), generator=_GEN).tolist() for n in (5, 11, 17)] + [
    _SHARED + [7, 8],
    _SHARED + [9, 10, 11],
]
MAX_TOKENS = [14, 10, 12, 9, 11]
MTP = EngineConfig(mtp=True, mtp_depth=BLOCK)


def _with_drafter(path):
    model = load_model(path, MTP)
    hf = read_hf_config(path)
    ctx = LoadContext(path, hf, "deepseek", "DeepseekV41ForCausalLM", engine=MTP)
    drafter = manager().hook.dgpp_build_draft(ctx=ctx, model=model)
    assert isinstance(drafter, DSparkV41Drafter)
    return path, model, drafter


@pytest.fixture(scope="module")
def dsv41(tmp_path_factory):
    """Stages whose Markov head holds the bigrams of the plain greedy transcripts of the first three prompts:
    their blocks stand where the target repeats those bigrams, the other two prompts' are mostly cut."""
    path = build_fp32_fixture(tmp_path_factory.mktemp("v41_dspark"))
    add_dspark_stages_v41(path, block_size=BLOCK, target_layer_ids=TARGETS, rank=64, repeat_bias=0, seed=4)
    transcripts = serve(load_model(path), chunk=4)[0]
    fit_markov_bigrams(path, [PROMPTS[i] + transcripts[f"r{i}"] for i in range(3)])
    return _with_drafter(path)


@pytest.fixture(scope="module")
def dsv41_free(tmp_path_factory):
    """Stages with a plain random Markov head: every draft follows the block's own logits."""
    path = build_fp32_fixture(tmp_path_factory.mktemp("v41_dspark_free"))
    return _with_drafter(
        add_dspark_stages_v41(path, block_size=BLOCK, target_layer_ids=TARGETS, repeat_bias=0, seed=6)
    )


def _prefill_features(model, drafter, prompts):
    return prefill_features(model, drafter, prompts, blocks=BLOCKS, block_size=BS, spare=BLOCK + 1)


def test_features_are_the_stream_means_entering_the_target_layers(dsv41):
    """Against the float64 reference's streams after the layer before each target (no Engram on the targets)."""
    path, model, drafter = dsv41
    _, _, features = _prefill_features(model, drafter, [PROMPTS[2]])
    session = load_reference(path).new_session(trace=True)
    session.extend(PROMPTS[2])
    expected = torch.cat([session.trace[t - 1]["streams"].mean(dim=1) for t in TARGETS], dim=-1)
    assert (features[0].double() - expected).abs().max() < 1e-4 * expected.abs().max()


def test_block_matches_the_float64_reference(dsv41_free):
    """Two requests drafted in one call: one with a context longer than the window (6: cut), one shorter."""
    path, model, drafter = dsv41_free
    # 17 tokens (past the window of 6: cut) and 5; the window and the block matter (a stale context moves them)
    check_blocks(
        model,
        drafter,
        [PROMPTS[2], PROMPTS[0]],
        [41, 77],
        DSparkReference(path).draft_block,
        blocks=BLOCKS,
        block_size=BS,
    )


def test_blocks_drafted_together_equal_each_drafted_alone(dsv41_free):
    """One masked attention over the batch (packed context rows decoded in one call): contexts cut by the window
    (17, 11 tokens), shorter (5) and of two tokens give each request the drafts and confidences of its block
    drafted alone."""
    _, model, drafter = dsv41_free
    prompts = [PROMPTS[2], PROMPTS[0], PROMPTS[1], PROMPTS[0][:2]]
    check_drafted_together_equals_alone(model, drafter, prompts, [41, 77, 5, 9], blocks=BLOCKS, block_size=BS)


serve = functools.partial(serve_greedy, prompts=PROMPTS, max_tokens=MAX_TOKENS, blocks=BLOCKS, block_size=BS)


@pytest.fixture(scope="module")
def plain(dsv41):
    _, model, _ = dsv41
    return {chunk: serve(model, chunk=chunk)[0] for chunk in (4, 64)}


def test_plain_greedy_does_not_depend_on_the_chunk(plain):
    assert plain[4] == plain[64]


@pytest.mark.parametrize(("depth", "chunk", "concurrency"), [(1, 8, 3), (2, 4, 1), (4, 64, 3), (3, 4, 3)])
def test_greedy_with_dspark_equals_plain_greedy(dsv41, plain, depth, chunk, concurrency):
    _, model, drafter = dsv41
    out, sched = serve(model, drafter, depth, chunk=chunk, concurrency=concurrency)
    check_exact_with_drafts(out, plain[4], sched)


@pytest.mark.parametrize(("right", "chunk", "concurrency"), [(BLOCK, 8, 3), (2, 4, 3)])
def test_deep_blocks_that_stand_keep_greedy_exact(dsv41, plain, right, chunk, concurrency):
    """Several drafts stand per pass (many context rows written at once, the compressors' open pairs and the
    Engram context re-run after a partial block) and the transcript is still the plain one."""
    _, model, drafter = dsv41
    out, sched = serve(model, drafter, BLOCK, chunk=chunk, concurrency=concurrency, oracle=(plain[4], right))
    check_exact_with_drafts(out, plain[4], sched, right)


def test_depth_beyond_the_block_is_refused(dsv41):
    _, model, drafter = dsv41
    runner = ModelRunner(model, CachePools(model.cache_spec(), BLOCKS, BS, 4))
    with pytest.raises(ValueError, match="engine.mtp_depth 5 exceeds the 4 drafts"):
        BlockDraftDecoder(runner, drafter, BLOCK + 1)


def test_without_mtp_the_stages_are_not_built(dsv41):
    path, _, _ = dsv41
    assert getattr(load_model(path), "mtp", None) is None


def test_the_bounded_prefill_is_refused_with_the_drafter(dsv41):
    path, _, _ = dsv41
    engine = EngineConfig(mtp=True, mtp_depth=2, prefill_mode="bounded")
    model = load_model(path, engine)
    ctx = LoadContext(path, read_hf_config(path), "deepseek", "DeepseekV41ForCausalLM", engine=engine)
    with pytest.raises(ConfigError, match="prefill_mode"):
        manager().hook.dgpp_build_draft(ctx=ctx, model=model)


@pytest.mark.parametrize(
    ("change", "key"),
    [
        ({"dspark_markov_rank": 0}, "dspark_markov_rank"),
        ({"dspark_num_experts_per_tok": 5}, "dspark_num_experts_per_tok"),
        ({"compress_ratios": [0, 0, 2, 2, 2, 2, 1, 1, 1, 1, 0, 1, 0]}, "compress_ratios"),
        ({"dspark_target_layer_ids": [10]}, "dspark_target_layer_ids"),
    ],
)
def test_bad_dspark_keys_name_the_key(dsv41, change, key):
    path, model, _ = dsv41
    text = {**read_hf_config(path)["text_config"], **change}
    with pytest.raises(CheckpointError, match=key):
        DSparkV41Config.from_text_config(text, model.config)


def test_the_plan_counts_the_stages_and_their_context_rows(dsv41):
    path, model, drafter = dsv41
    pm = build_manager()
    plain = plan_for(pm, load_context(path, pm=pm))
    spec = plan_for(pm, load_context(path, MTP, pm=pm))
    # one packed FP8 latent per token and stage: 64 E4M3 codes and 2 E8M0 scales
    assert spec.kv_per_token - plain.kv_per_token == len(drafter.stages) * (64 + 2)
    for name, entry in drafter.cache_spec().items():
        assert (entry.head_dim, entry.dtype) == (66, torch.uint8), name
    stage_bytes = sum(p.numel() * p.element_size() for p in model.mtp.parameters())  # as loaded: packed
    assert spec.weights - plain.weights == stage_bytes


def test_the_release_config_names_three_stages():
    """The release's ``text_config`` (``num_nextn_predict_layers`` 3, blocks of 5, 128 experts top-3, rank 256)
    parses into the stages the deploy template turns on."""
    from test_deepseek_v41_plan import V41_FLASH

    from dgpp_deepseek.v41_config import DeepseekV41ArchConfig

    text = json.loads(json.dumps(V41_FLASH["text_config"]))
    text.update(
        dspark_block_size=5,
        dspark_noise_token_id=128799,
        dspark_target_layer_ids=[37, 38, 39],
        dspark_markov_rank=256,
        dspark_n_routed_experts=128,
        dspark_num_experts_per_tok=3,
    )
    dspark = DSparkV41Config.from_text_config(text, DeepseekV41ArchConfig.from_hf_config(V41_FLASH))
    assert dspark is not None
    assert (dspark.stages, dspark.common.block_size, dspark.experts, dspark.experts_per_tok) == (3, 5, 128, 3)


def test_stages_named_by_the_config_but_not_shipped_name_the_missing_tensor(tmp_path):
    path = build_fp32_fixture(tmp_path / "ckpt")
    config = json.loads((path / "config.json").read_text())
    config["text_config"].update(
        num_nextn_predict_layers=3, dspark_block_size=4, dspark_noise_token_id=5, dspark_target_layer_ids=[7]
    )
    (path / "config.json").write_text(json.dumps(config))
    with pytest.raises(CheckpointError, match=r"tensor 'mtp\.0\..*' .* is missing from .*model\.safetensors"):
        load_model(path, MTP)
