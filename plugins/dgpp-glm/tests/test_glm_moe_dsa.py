"""Full GLM-5.3 (glm_moe_dsa) vs transformers on tiny random checkpoints: MLA over a latent cache, a DSA
indexer on layers 0 and 2 (layers 1 and 3 reuse its selection), index_topk 8 below every prompt so the
sparse path is live, 16 indexer heads, one dense layer then GLM's MoE."""

from __future__ import annotations

import pytest
import torch
import transformers

from dgpp.engine.runner import ModelRunner
from dgpp.engine.work import SeqWork
from dgpp.errors import ConfigError
from dgpp.offline import greedy_generate, make_pools
from dgpp.startup.loading import load_model
from dgpp.step.cache_spec import LatentKV, PagedKV, stored_as
from dgpp.testing import conformance as conf
from dgpp.testing.builders import load_reference
from dgpp.testing.latent_lever import LatentKVLever
from dgpp.testing.suite import FamilyConformance, tiny_checkpoint_fixtures
from dgpp_glm.glm5 import GlmMoeDsaForCausalLM
from dgpp_glm.testing_glm5 import build_tiny_glm_moe_dsa

transformers.logging.set_verbosity_error()


checkpoint, fp32_pair = tiny_checkpoint_fixtures(build_tiny_glm_moe_dsa, "glm_moe_dsa")


def test_loads_with_indexer_on_full_layers_and_latent_cache(fp32_pair):
    model, _ = fp32_pair
    assert isinstance(model, GlmMoeDsaForCausalLM)
    assert [layer.self_attn.indexer is not None for layer in model.model.layers] == [True, False, True, False]
    assert [type(layer.mlp).__name__ for layer in model.model.layers] == [
        "SwiGLUMLP",
        "SparseMoE",
        "SparseMoE",
        "SparseMoE",
    ]
    spec = model.cache_spec()
    assert spec["layers.1.self_attn"] == LatentKV.of(32, 8, torch.float32)
    assert spec["layers.0.self_attn.indexer"] == PagedKV(
        1, 16, torch.float32, v_head_dim=0, fp8_rows=True, index_keys=True
    )
    assert "layers.1.self_attn.indexer" not in spec
    # per token: 4 x (latent 32 + rope 8) + 2 indexer keys of 16, fp32
    assert sum(s.bytes_per_token() for s in spec.values()) == (4 * 40 + 2 * 16) * 4


class TestGlmMoeDsaConformance(FamilyConformance):
    """The logits also on a 30-token prompt, far past ``index_topk`` (8)."""

    logits_lengths = (5, 12, 23, 30)


@torch.inference_mode()
def _greedy_on_shared_prefix(
    model, prefix: list[int], suffixes: list[list[int]], new_tokens: int, block_size: int = 4
):
    """Run ``prefix + suffixes[0]``, then each later suffix on the first's cached prefix blocks (a prefix-cache hit:
    latent and indexer-key rows are read from blocks another sequence wrote); greedy tokens of each."""
    assert len(prefix) % block_size == 0
    totals = [len(prefix) + len(s) + new_tokens for s in suffixes]
    pools, blocks, slots = make_pools(model, totals, block_size)
    runner = ModelRunner(model, pools)
    shared = None
    results = []
    for suffix, total in zip(suffixes, totals, strict=True):
        if shared is None:
            table = blocks.allocate(blocks.blocks_for_tokens(total))
            shared, cached, feed = table[: len(prefix) // block_size], 0, prefix + suffix
        else:
            table = shared + blocks.allocate(blocks.blocks_for_tokens(total) - len(shared))
            cached, feed = len(prefix), list(suffix)
        slot, out = slots.allocate(), []
        while len(out) < new_tokens:
            logits = runner.step([SeqWork(slot, table, cached, feed)])
            cached += len(feed)
            out.append(int(torch.argmax(logits[0])))
            feed = [out[-1]]
        results.append(out)
    return results


def test_prefix_cache_hit_equals_cold(fp32_pair):
    model, _ = fp32_pair
    prefix, a, b = conf.make_prompts(model.info.vocab_size, (16, 5, 9), seed=4)
    warm = _greedy_on_shared_prefix(model, prefix, [a, b], 12)
    assert warm[1] == greedy_generate(model, [prefix + b], 12, stop_at_eos=False)[0]


def test_absorbed_mla_equals_expanded(fp32_pair):
    model, _ = fp32_pair
    prompts = conf.make_prompts(model.info.vocab_size, (6, 21), seed=5)
    absorbed = conf.engine_all_logits(model, prompts)
    try:
        for layer in model.model.layers:
            layer.self_attn.absorbed = False
        expanded = conf.engine_all_logits(model, prompts)
    finally:
        for layer in model.model.layers:
            layer.self_attn.absorbed = True
    for ours, ref in zip(absorbed, expanded, strict=True):
        assert (ours - ref).abs().max() <= 1e-5 * ref.abs().max()


def _moved(model, prompts, toggle) -> float:
    base = conf.engine_all_logits(model, prompts)
    undo = toggle(model)
    try:
        changed = conf.engine_all_logits(model, prompts)
    finally:
        undo()
    return max(float((x - y).abs().max()) for x, y in zip(base, changed, strict=True))


def test_dense_selection_moves_logits(fp32_pair):
    """The sparse path is live: letting every indexer keep all tokens changes the logits."""
    model, _ = fp32_pair
    indexers = [
        layer.self_attn.indexer for layer in model.model.layers if layer.self_attn.indexer is not None
    ]

    def dense(_):
        for ix in indexers:
            ix.topk = 10**6
        return lambda: [setattr(ix, "topk", 8) for ix in indexers]

    assert _moved(model, conf.make_prompts(model.info.vocab_size, (23,), seed=6), dense) > 1e-3


def test_shared_layers_reuse_the_selection(fp32_pair):
    """Shared layers attend over the previous full layer's picks: making them dense changes the logits."""
    model, _ = fp32_pair
    shared = [layer.self_attn for layer in model.model.layers if layer.self_attn.indexer is None]

    def drop_reuse(_):
        for attn in shared:
            attn.reuses_selection = False
        return lambda: [setattr(attn, "reuses_selection", True) for attn in shared]

    assert _moved(model, conf.make_prompts(model.info.vocab_size, (23,), seed=6), drop_reuse) > 1e-3


def test_yarn_rope_and_softmax_mscale_match_transformers(tmp_path):
    """YaRN frequencies on both the MLA rope dims and the indexer's, the rope magnitude, and the softmax scale
    times mscale(mscale_all_dim)²: against transformers on prompts longer than the original context."""
    yarn = {
        "rope_type": "yarn",
        "rope_theta": 10000.0,
        "factor": 4.0,
        "original_max_position_embeddings": 16,
        "mscale": 0.707,
        "mscale_all_dim": 1.0,
        "beta_fast": 32.0,
        "beta_slow": 1.0,
    }
    path = build_tiny_glm_moe_dsa(tmp_path, seed=3, rope_parameters=yarn)
    model, ref = load_model(path), load_reference(path)
    assert model.model.layers[0].self_attn.scale > (16 + 8) ** -0.5
    conf.check_logits(model, ref, conf.make_prompts(model.info.vocab_size, (9, 40), seed=7), rtol=1e-4)


class TestGlmMoeDsaLatentKV(LatentKVLever):
    """``engine.kv_dtype`` fp8 / fp4: e4m3 or packed fp4 latents, e4m3 index keys; prompts past index_topk (8) so
    the indexer selects over quantized keys and attention reads quantized latents on sparse rows."""


def test_quantized_latent_and_index_bytes_per_token(fp32_pair):
    """Per token (4 MLA layers: latent 32 + rope 8; 2 indexer layers: keys of 16; fp32): bf16 rows are the
    compute dtype's; fp8 latents 32 codes + a 4-byte scale beside the fp32 rope; fp4 latents one packed row (16
    code bytes and 2 block scales, padded to 32 bytes) + a scale; index keys e4m3 + a scale under both."""
    model, _ = fp32_pair
    spec = model.cache_spec()
    per_token = {
        kv: sum(s.bytes_per_token() for s in stored_as(spec, kv).values()) for kv in ("auto", "fp8", "fp4")
    }
    assert per_token == {
        "auto": (4 * 40 + 2 * 16) * 4,
        "fp8": 4 * (32 + 4 + 8 * 4) + 2 * (16 + 4),
        "fp4": 4 * (32 + 4 + 8 * 4) + 2 * (16 + 4),
    }
    with pytest.raises(
        ConfigError, match=r"'fp4' stores MLA latents.*attn \(PagedKV\) have no fp4 form.*\"fp8\""
    ):
        stored_as({"attn": PagedKV(2, 16, torch.float32, fp8_rows=True)}, "fp4")
    with pytest.raises(ConfigError, match="latent width 40 is not a multiple of it"):
        stored_as({"attn": LatentKV.of(40, 8, torch.float32)}, "fp4")
