"""GLM-5.3-Flash (glm5_next) vs transformers on a tiny random ConditionalGeneration checkpoint (the reference is
``Glm5NextForConditionalGeneration`` on text input: its ``Glm5NextTextModel`` and ``lm_head``): KDA layers 0 and 3,
indexed MLA layers 1, 2 (reusing layer 1's selection) and 4 with the k-pooled indexer (kpool 4, index_topk 8: two
pools, so prompts of 12 tokens and more run sparse), mHC over 4 streams, a dense layer then MoE."""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import replace

import torch
import transformers

from dgpp.engine.runner import ModelRunner
from dgpp.engine.work import SeqWork
from dgpp.nn.kimi_delta_attention import KimiDeltaAttention
from dgpp.offline import greedy_generate, make_pools
from dgpp.step.cache_spec import CompressedKV, LatentKV, StateSpec, WindowBuffer
from dgpp.testing import conformance as conf
from dgpp.testing.latent_lever import LatentKVLever
from dgpp.testing.suite import HybridConformance, tiny_checkpoint_fixtures
from dgpp_glm.glm5_next import Glm5NextAttention, Glm5NextForCausalLM, StreamMean
from dgpp_glm.testing_glm5_next import build_tiny_glm5_next

transformers.logging.set_verbosity_error()

checkpoint, fp32_pair = tiny_checkpoint_fixtures(build_tiny_glm5_next, "glm5_next")

SPARSE = (23, 40)  # far past index_topk: rows pick 2 of up to 10 pools


def test_loads_kda_and_indexed_layers_with_their_caches(fp32_pair):
    model, _ = fp32_pair
    assert isinstance(model, Glm5NextForCausalLM)
    layers = model.stack.layers
    assert [type(layer.self_attn).__name__ for layer in layers] == [
        "KimiDeltaAttention",
        "Glm5NextAttention",
        "Glm5NextAttention",
        "KimiDeltaAttention",
        "Glm5NextAttention",
    ]
    assert [getattr(layer.self_attn, "indexer", None) is not None for layer in layers] == [
        False,
        True,
        False,
        False,
        True,
    ]
    assert [type(layer.mlp).__name__ for layer in layers] == ["SwiGLUMLP"] + ["SparseMoE"] * 4
    spec = model.cache_spec()
    assert spec["layers.1.self_attn"] == LatentKV.of(32, 0, torch.float32)
    assert spec["layers.1.self_attn.indexer"] == replace(
        CompressedKV.of(4, 16, torch.float32), fp8_rows=True, index_keys=True
    )
    assert spec["layers.1.self_attn.indexer.buffer"] == WindowBuffer(rows=4, width=16, dtype=torch.float32)
    assert "layers.2.self_attn.indexer" not in spec
    kda = spec["layers.0.self_attn"]
    assert isinstance(kda, StateSpec)
    assert kda.tensors["recurrent"] == ((4, 16, 16), torch.float32)
    assert kda.tensors["q_conv"] == ((3, 64), torch.float32)
    assert model.info.hybrid


class TestGlm5NextConformance(HybridConformance):
    """Prompts shorter and longer than index_topk (dense and sparse rows); prefill chunks of 3, 5 and 6 cut inside
    the 4-token pools, so a pool is completed by a later chunk from the rows its ring kept."""

    logits_lengths = (5, 11, 12, 23, 40)
    greedy_lengths = (7, 26)
    chunked_lengths, chunk_sizes = (11, 30), (1, 3, 6)
    invariance_lengths, invariance_chunk_sizes = (4, 23, 13, 1), (1, 5, 6)
    snapshot_length, snapshot_split = 30, 18  # the split inside a pool: the ring is part of the snapshot


class TestGlm5NextLatentKV(LatentKVLever):
    """``engine.kv_dtype`` fp8 / fp4 on the NoPE latents and the pooled index keys (e4m3 rows, written when their
    pool completes, in the prefill row path and the decode step alike)."""

    kv_fp8_lengths = (11, 23, 40, 1)


@torch.inference_mode()
def test_left_padded_reference_pools_from_the_first_real_token(fp32_pair):
    """transformers with pad positions before the prompt (masked) starts its pools at the first real token; the
    engine's unpadded run must match those rows (a pool cut at slot 0 would group pads with tokens)."""
    model, ref = fp32_pair
    prompt = conf.make_prompts(model.info.vocab_size, (26,), seed=9)[0]
    ours = conf.engine_all_logits(model, [prompt])[0]
    for pads in (1, 3):
        ids = torch.tensor([[0] * pads + prompt])
        mask = torch.tensor([[0] * pads + [1] * len(prompt)])
        theirs = ref(input_ids=ids, attention_mask=mask).logits[0, pads:].float()
        assert float((ours - theirs).abs().max() / theirs.abs().max()) < 1e-4


@torch.inference_mode()
def _greedy_on_shared_prefix(
    model, prefix: list[int], suffixes: list[list[int]], new_tokens: int, block: int = 4
):
    """Prefill ``prefix`` once and snapshot its state; run each ``prefix + suffix`` from the shared prefix blocks and
    a copy of the snapshot (what a prefix-cache hit does: latent rows and pooled index keys read from blocks the
    first sequence wrote, KDA state and the open pool's ring restored); greedy tokens of each."""
    totals = [len(prefix) + len(s) + new_tokens for s in suffixes]
    pools, blocks, slots = make_pools(model, [len(prefix), *totals], block)
    runner = ModelRunner(model, pools)
    shared = blocks.allocate(len(prefix) // block)
    snapshot = slots.allocate()
    runner.step([SeqWork(snapshot, shared, 0, prefix, want_logits=False)])
    results = []
    for suffix, total in zip(suffixes, totals, strict=True):
        table = shared + blocks.allocate(blocks.blocks_for_tokens(total) - len(shared))
        slot = slots.allocate()
        pools.copy_state(snapshot, slot)
        cached, feed, out = len(prefix), list(suffix), []
        while len(out) < new_tokens:
            logits = runner.step([SeqWork(slot, table, cached, feed)])
            cached += len(feed)
            out.append(int(torch.argmax(logits[0])))
            feed = [out[-1]]
        results.append(out)
    return results


def test_prefix_cache_hit_equals_cold(fp32_pair):
    model, _ = fp32_pair
    prefix, a, b = conf.make_prompts(model.info.vocab_size, (16, 5, 13), seed=4)
    warm = _greedy_on_shared_prefix(model, prefix, [a, b], 12)
    cold = greedy_generate(model, [prefix + a, prefix + b], 12, stop_at_eos=False)
    assert warm == cold


def _worst(model, ref, prompts) -> float:
    return max(
        float(((ours - conf.reference_logits(ref, p)).abs().max(-1).values / ours.abs().max()).max())
        for ours, p in zip(conf.engine_all_logits(model, prompts), prompts, strict=True)
    )


@contextmanager
def _zeroed(params: list[torch.Tensor]) -> Iterator[None]:
    """``params`` zeroed in place for the block, restored after."""
    saved = [p.clone() for p in params]
    try:
        for p in params:
            p.zero_()
        yield
    finally:
        for p, old in zip(params, saved, strict=True):
            p.copy_(old)


def _indexers(model):
    attns = [
        layer.self_attn for layer in model.stack.layers if isinstance(layer.self_attn, Glm5NextAttention)
    ]
    return [a.indexer for a in attns if a.indexer is not None]


def test_pool_gate_tail_and_stream_mean_each_decide_the_match(fp32_pair, monkeypatch):
    """Each piece the reference computes, turned off, breaks the match on sparse prompts: the learned pool gate
    (pooling becomes a plain mean), the open pool's tail (sparse rows lose their newest tokens) and the streams'
    mean at the head (the first stream alone)."""
    model, ref = fp32_pair
    prompts = conf.make_prompts(model.info.vocab_size, SPARSE, seed=6)
    assert _worst(model, ref, prompts) < 1e-4
    with _zeroed(
        [p for ix in _indexers(model) for p in (ix.index_kpool_compress_gate, ix.index_kpool_compress_ape)]
    ):
        assert _worst(model, ref, prompts) > 1e-3
    with monkeypatch.context() as m:
        for ix in _indexers(model):
            m.setattr(ix, "select_tail", False)
        assert _worst(model, ref, prompts) > 1e-3
    with monkeypatch.context() as m:
        m.setattr(StreamMean, "forward", lambda self, streams: streams[:, 0])
        assert _worst(model, ref, prompts) > 1e-3
    assert _worst(model, ref, prompts) < 1e-4


def test_sparse_selection_and_shared_reuse_move_the_logits(fp32_pair, monkeypatch):
    """The sparse path is live (keeping every pool changes the logits) and layer 2 attends over layer 1's picks
    (attending densely there changes them too)."""
    model, ref = fp32_pair
    prompts = conf.make_prompts(model.info.vocab_size, SPARSE, seed=6)
    with monkeypatch.context() as m:
        for ix in _indexers(model):
            m.setattr(ix, "select_pools", 10**6)
        assert _worst(model, ref, prompts) > 1e-3
    shared = model.stack.layers[2].self_attn
    with monkeypatch.context() as m:
        dense = lambda x, batch, previous: (shared.attend(shared.prepare(x, batch), batch), None)  # noqa: E731
        m.setattr(shared, "select_and_attend", dense)
        assert _worst(model, ref, prompts) > 1e-3


def test_kda_chunked_form_equals_its_recurrent_step(fp32_pair):
    """A 40-token prompt through the chunked delta rule (chunk 64 and 16) and token by token give the same
    logits to fp32 rounding: the per-channel decay is applied alike in both forms."""
    model, _ = fp32_pair
    prompt = conf.make_prompts(model.info.vocab_size, (40,), seed=8)
    kdas = [
        layer.self_attn for layer in model.stack.layers if isinstance(layer.self_attn, KimiDeltaAttention)
    ]
    whole = conf.engine_all_logits(model, prompt)[0]
    stepped = conf.engine_all_logits(model, prompt, chunk_size=1)[0]
    try:
        for kda in kdas:
            kda.chunk_size = 16
        small_chunks = conf.engine_all_logits(model, prompt)[0]
    finally:
        for kda in kdas:
            kda.chunk_size = 64
    scale = float(whole.abs().max())
    assert float((stepped - whole).abs().max()) < 1e-5 * scale
    assert float((small_chunks - whole).abs().max()) < 1e-5 * scale


def test_softplus_decay_form_matches_transformers(tmp_path):
    """Without a gate lower bound the decay is ``-exp(A_log) · softplus(...)`` (``linear_attn_config`` with
    ``safe_gate`` false and no bound)."""
    from dgpp.startup.loading import load_model
    from dgpp.testing.builders import load_reference

    path = build_tiny_glm5_next(
        tmp_path, seed=2, linear_attn_config={"safe_gate": False, "gate_lower_bound": None}
    )
    model = load_model(path)
    assert all(
        layer.self_attn.lower_bound is None
        for layer in model.stack.layers
        if isinstance(layer.self_attn, KimiDeltaAttention)
    )
    conf.check_logits(model, load_reference(path), conf.make_prompts(512, (9, 30), seed=3), rtol=1e-4)


@torch.inference_mode()
def test_the_reference_is_transformers_text_model(fp32_pair):
    """On text input the reference's logits are its ``Glm5NextTextModel`` and ``lm_head`` alone (the vision tower
    takes no part), so the checks above compare with transformers' text model."""
    from transformers import Glm5NextTextModel

    _, ref = fp32_pair
    text = ref.model.language_model
    assert isinstance(text, Glm5NextTextModel)
    ids = torch.tensor(conf.make_prompts(512, (23,), seed=12))
    assert torch.equal(ref.lm_head(text(input_ids=ids).last_hidden_state), ref(ids).logits)
