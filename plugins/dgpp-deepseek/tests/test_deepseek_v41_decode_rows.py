"""DeepSeek-V4.1-Flash's decode rows in batched device form (``dgpp_deepseek.v41_decode_rows``, Engram's device
hash) give exactly the bits of the per-sequence forms they replace: the tiny fp32 fixture (every layer kind,
candidates, Engram) decoded both ways, on the torch path and through the fused kernels (Triton interpreter)."""

from __future__ import annotations

import pytest
import torch
from test_deepseek_v41 import build_fp32_fixture

from dgpp.kernels._triton import HAS_TRITON
from dgpp.offline import engine_all_logits, greedy_generate, make_prompts
from dgpp.plugin_api import load_model
from dgpp_deepseek.v41_attention import DeepseekV41Attention
from dgpp_deepseek.v41_engram import EngramV41
from dgpp_deepseek.v41_indexer import CompressorV41, IndexerV41


@pytest.fixture(scope="module")
def model(tmp_path_factory):
    return load_model(build_fp32_fixture(tmp_path_factory.mktemp("deepseek_v41_decode_rows")))


def set_paths(model, *, batched: bool, fused: bool | None) -> None:
    """``batched``: decode steps in the batched device forms (else per sequence); ``fused``: the fused kernels."""
    for module in model.modules():
        if isinstance(module, (CompressorV41, IndexerV41, EngramV41)):
            module.batched_decode = batched
        if isinstance(module, DeepseekV41Attention):
            module.fused_decode = fused


def decode_both_ways(model, fused: bool | None, monkeypatch) -> None:
    taken = []
    real = IndexerV41._decode_picks

    def counted(self, *args):
        taken.append(1)
        return real(self, *args)

    monkeypatch.setattr(IndexerV41, "_decode_picks", counted)
    prompts = make_prompts(model.info.vocab_size, (7, 19, 12), seed=5)
    results = []
    for batched in (False, True):
        set_paths(model, batched=batched, fused=fused)
        try:
            tokens = greedy_generate(model, prompts, 9, stop_at_eos=False)
            logits = engine_all_logits(model, prompts, chunk_size=1)
        finally:
            set_paths(model, batched=True, fused=None)
        results.append((tokens, logits))
        assert bool(taken) == batched  # the batched form ran exactly when asked
    (ref_tokens, ref_logits), (tokens, logits) = results
    assert tokens == ref_tokens
    for a, b in zip(logits, ref_logits, strict=True):
        assert torch.equal(a, b)


def test_batched_decode_rows_match_the_per_sequence_forms(model, monkeypatch):
    decode_both_ways(model, False, monkeypatch)


@pytest.mark.skipif(not HAS_TRITON, reason="needs triton (the interpreter runs on the CPU)")
def test_batched_decode_rows_match_through_the_fused_kernels(model, monkeypatch):
    decode_both_ways(model, True, monkeypatch)
