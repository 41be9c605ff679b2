"""DeepSeek-V4.1-Flash's decode rows in batched device form (``dgpp_deepseek.v41_decode_rows``, Engram's device
hash) give exactly the bits of the per-sequence forms they replace: the tiny fp32 fixture (every layer kind,
candidates, Engram) decoded both ways, on the torch path and through the fused kernels (Triton interpreter), and
Engram's row ids and token ring from both hashes."""

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


@pytest.mark.parametrize("wrapping", [False, True])
def test_engram_device_hash_gives_the_host_rows_and_ring(model, monkeypatch, wrapping) -> None:
    """Random rings and tokens, rows at positions 0 .. 40 (before the n-gram fills: the pad class) and a padding
    row: the device hash's row ids and ring equal the per-sequence hash's. ``wrapping``: multipliers near 2^62,
    so the products wrap around int64 and the hashes go negative before the floored ``%``."""
    from dgpp.engine.runner import build_batch
    from dgpp.engine.work import SeqWork
    from dgpp.step.pools import CachePools

    engram = next(m for m in model.modules() if isinstance(m, EngramV41))
    if wrapping:
        big = (1 << 62) + 2 * torch.arange(engram.ngram, dtype=torch.int64) + 1
        monkeypatch.setattr(engram, "multipliers", big)
        monkeypatch.setattr(engram, "_device_hash", None)
    positions = [0, 1, 2, 3, 7, 40]
    pools = CachePools(model.cache_spec(), len(positions) * 4, 16, len(positions) + 1, "cpu")
    ring = pools.state[engram.cache_name]["tokens"]
    gen = torch.Generator().manual_seed(11)
    ring.copy_(torch.randint(0, model.info.vocab_size, ring.shape, generator=gen))
    tokens = torch.randint(0, model.info.vocab_size, (len(positions),), generator=gen).tolist()
    work = [SeqWork(i, [4 * i + j for j in range(4)], p, [tokens[i]]) for i, p in enumerate(positions)]
    before = ring.clone()
    host = engram.row_ids(build_batch(work, pools))
    host_ring = ring.clone()
    ring.copy_(before)
    # a padding row as the decode graphs pad one: it reads slot 0 harmlessly and writes nothing
    padded = build_batch([*work, SeqWork(0, [0], 0, [0])], pools)
    padded.state_slots[-1], padded.seq_lens[-1], padded.positions[-1] = -1, 0, 0
    device = engram.decode_row_ids(padded)
    assert torch.equal(device[: len(positions)], host)
    assert torch.equal(ring, host_ring)
