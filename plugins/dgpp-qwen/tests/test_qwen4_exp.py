"""Qwen3.8-Flash-Next (qwen4_exp) vs transformers on a tiny random fp32 checkpoint: cache spec, logits of
prompts below and above the QSA indexer's dense limit (some with EOS inside, which cuts the n-gram
segments), proof that the sparse path and PLE matter, 32 greedy tokens, and the n-gram hash constants."""

from __future__ import annotations

import pytest
import torch

from dgpp.startup.loading import load_model
from dgpp.step.cache_spec import CompressedKV, PagedKV, StateSpec
from dgpp.testing import conformance as conf
from dgpp.testing.builders import load_reference
from dgpp_qwen.layers.ngram import hash_multipliers, head_vocab_sizes
from dgpp_qwen.testing_qwen4_exp import EOS, build_tiny_qwen4_exp

DENSE_LIMIT = 19  # (budget 16 / ratio 4 + 1) blocks of 4 tokens, minus one


@pytest.fixture(scope="module")
def pair(tmp_path_factory):
    path = build_tiny_qwen4_exp(tmp_path_factory.mktemp("qwen4_exp"))
    return load_model(path), load_reference(path)


def prompts_with_eos(model, lengths, seed):
    prompts = conf.make_prompts(model.info.vocab_size, lengths, seed=seed)
    for prompt in prompts:
        if len(prompt) > 12:
            prompt[6] = prompt[10] = prompt[11] = EOS  # segments of 1 and 0 tokens between EOS
    return prompts


def test_cache_spec_names_every_pool_entry(pair):
    model, _ = pair
    spec = model.cache_spec()
    assert set(spec) == {
        "layers.0",
        "layers.0.ple",
        "layers.1",
        "layers.1.indexer",
        "layers.1.indexer.blocks",
        "layers.2",
        "layers.2.ple",
        "layers.3",
        "layers.3.indexer",
        "layers.3.indexer.blocks",
    }
    assert spec["layers.1"] == PagedKV(num_kv_heads=2, head_dim=16, dtype=torch.float32)
    assert spec["layers.1.indexer"] == PagedKV(num_kv_heads=1, head_dim=16, dtype=torch.float32, v_head_dim=0)
    assert spec["layers.1.indexer.blocks"] == CompressedKV.of(4, 16, torch.float32)  # a key per 4-token block
    ple = spec["layers.0.ple"]
    assert isinstance(ple, StateSpec)
    assert ple.tensors == {"ngram_context": ((2,), torch.int64), "conv": ((9, 4 * 64), torch.float32)}
    assert model.model.layers[1].self_attn.indexer.dense_limit() == DENSE_LIMIT
    assert model.info.hybrid


def test_logits_match_transformers_below_and_above_the_dense_limit(pair):
    model, ref = pair
    prompts = prompts_with_eos(model, (9, DENSE_LIMIT, DENSE_LIMIT + 1, 45, 70), seed=1)
    assert conf.check_logits(model, ref, prompts, rtol=1e-4) < 1e-4


@torch.inference_mode()
def test_sparse_selection_and_ple_change_the_logits(pair, monkeypatch):
    """The comparison above has teeth: attending densely, or dropping PLE, moves long-prompt logits well
    past its tolerance, and the indexer keeps budget + tail tokens, not everything."""
    model, _ = pair
    prompt = conf.make_prompts(model.info.vocab_size, (50,), seed=2)
    base = conf.engine_all_logits(model, prompt)[0]
    indexer = model.model.layers[1].self_attn.indexer
    picked = []
    original_select = indexer._select
    monkeypatch.setattr(indexer, "_select", lambda *a: picked.append(original_select(*a)) or picked[-1])
    conf.engine_all_logits(model, prompt)
    assert [len(p) for p in picked] == [16 + (pos + 1) % 4 for pos in range(DENSE_LIMIT, 50)]
    monkeypatch.undo()
    scale = base.abs().max()
    for layer in (model.model.layers[1], model.model.layers[3]):
        monkeypatch.setattr(layer.self_attn.indexer, "dense_limit", lambda: 10**9)
    dense = conf.engine_all_logits(model, prompt)[0]
    assert torch.equal(dense[:DENSE_LIMIT], base[:DENSE_LIMIT])
    assert (dense[DENSE_LIMIT:] - base[DENSE_LIMIT:]).abs().max() / scale > 1e-3
    monkeypatch.undo()
    monkeypatch.setattr(model.model.layers[0].ple, "forward", lambda hyper, batch: hyper)  # no PLE
    assert (conf.engine_all_logits(model, prompt)[0] - base).abs().max() / scale > 1e-3


def test_32_greedy_tokens_match_transformers_generate(pair):
    model, ref = pair
    conf.check_greedy(model, ref, prompts_with_eos(model, (7, 40), seed=3), max_new_tokens=32)


def test_hash_constants_equal_the_reference_at_release_scale():
    """Multipliers for the 248,320-token vocab and the first heads' primes after 19,999,999, vs transformers."""
    from transformers.models.qwen4_exp import modeling_qwen4_exp as hf

    for ple_index in (0, 1, 5):
        assert (
            hash_multipliers(248320, 3, ple_index, 1234)
            == hf._build_layer_multipliers(248320, 3, ple_index, 1234).tolist()
        )
    ours = head_vocab_sizes(
        20_000_000, 1, 3
    )  # heads 3..5 of the sequence (second PLE layer of 3-head layers)
    assert ours == [hf._find_nth_prime_after(19_999_999, n) for n in (4, 5, 6)]


def test_hash_multipliers_pinned():
    """The multipliers come from dgpp.splitmix; these values were produced by the PLE's former private copy."""
    assert hash_multipliers(512, 3, 0, 0) == [13859160516121295, 2456519431064331, 6598516710904673]
    assert hash_multipliers(151936, 4, 5, 12345) == [
        6593811459909,
        17271316155133,
        27733087130627,
        59352543803031,
    ]


@torch.inference_mode()
def test_indexer_ties_go_to_the_lower_block(pair):
    """All-zero scores (every ReLU clipped) tie every block: the lowest blocks win, plus the tail."""
    model, _ = pair
    indexer = model.model.layers[1].self_attn.indexer
    query = -torch.ones(16, 16)
    block_keys = torch.ones(10, 16)  # q·c < 0 for every head and block
    picked = indexer._select(query, block_keys, position=41)  # 10 complete blocks, tail 40..41
    assert picked.tolist() == [*range(16), 40, 41]
    block_keys[7] = -1.0  # one block now scores > 0: it takes the place of the highest tied block
    assert indexer._select(query, block_keys, position=41).tolist() == [*range(12), *range(28, 32), 40, 41]


@torch.inference_mode()
def test_all_rows_at_once_path_equals_row_by_row(pair, monkeypatch):
    """The CUDA form (one product and sort per sequence, masked attention), forced on the CPU: the same
    selection masks and logits within fp32 rounding of the row-by-row reference path, one-shot and chunked."""
    model, _ = pair
    indexer = model.model.layers[1].self_attn.indexer
    q = torch.randn(30, 16, 16, generator=torch.Generator().manual_seed(4))
    keys = torch.randn(12, 16, generator=torch.Generator().manual_seed(5))
    rows = indexer._select_rows(q, keys, context=18, length=48)
    assert torch.equal(indexer._select_all(q, keys, torch.arange(18, 48), 48), rows)
    prompts = prompts_with_eos(model, (12, 47), seed=6)
    reference = conf.engine_all_logits(model, prompts)
    for layer in (model.model.layers[1], model.model.layers[3]):
        monkeypatch.setattr(layer.self_attn.indexer, "vectorized", True)
    for chunk in (None, 9):
        for ours, theirs in zip(
            conf.engine_all_logits(model, prompts, chunk_size=chunk), reference, strict=True
        ):
            torch.testing.assert_close(ours, theirs, rtol=1e-5, atol=1e-5 * float(theirs.abs().max()))


@torch.inference_mode()
def test_masked_attention_in_row_blocks_equals_all_rows_at_once(monkeypatch):
    """The CUDA form's masked attention cut into blocks of query rows (the score matrix kept under a size): the
    same output as all rows in one block, with a causal mask and with a selection mask, to fp32 rounding (the
    CPU's fp32 GEMM may tile 5 rows otherwise than 37: an AVX-512 EPYC's differs in the last bit, an AMX Xeon's
    did not)."""
    from dgpp_qwen.layers import qsa

    g = torch.Generator().manual_seed(7)
    q, k, v = (
        torch.randn(37, 8, 16, generator=g),
        torch.randn(60, 2, 16, generator=g),
        torch.randn(60, 2, 16, generator=g),
    )
    selection = torch.rand(37, 60, generator=g) < 0.5
    selection[:, 0] = True  # every row keeps a key
    whole = [qsa.attend_masked(q, k, v, 23, mask, 0.25) for mask in (None, selection)]
    monkeypatch.setattr(qsa, "SCORE_BLOCK_BYTES", 8 * 60 * 4 * 5)  # five rows a block, the last one partial
    blocks = []
    one_block = qsa._attend_masked_rows
    monkeypatch.setattr(
        qsa, "_attend_masked_rows", lambda q, *rest: blocks.append(len(q)) or one_block(q, *rest)
    )
    for mask, expected in zip((None, selection), whole, strict=True):
        torch.testing.assert_close(qsa.attend_masked(q, k, v, 23, mask, 0.25), expected, rtol=1e-5, atol=1e-6)
    assert blocks == [5] * 7 + [2] + [5] * 7 + [2]
