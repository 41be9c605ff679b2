"""GLM-5.3-Flash's k-pooled indexer decode selection on its CUDA path (Triton interpreter, fp32) against the torch
path: the same positions, counts and sparse flags for padding rows, dense rows (fewer complete pools than kept,
exactly as many, a few tokens more), sparse rows with and without an open tail, a row at the table's end, exact
score ties (to the lower pool), and e4m3 pooled keys with row scales. Keys, queries and weights are small
integers, so both paths compute every score exactly and any difference is a difference in picks."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

from dgpp.kernels.pooled_selection import pooled_positions_triton
from dgpp_glm import glm5_next_indexer_decode as decode

KPOOL, KEEP, HEADS, DIM, BLOCK, COLUMNS = 4, 3, 4, 16, 8, 6
SEQ_LENS = [0, 5, 12, 13, 16, 47, 48, 30]  # pad; dense x3; sparse, tail 0 / 3; the table's end; ties


def _step(
    quantized: bool, tail: bool, seed: int
) -> tuple[SimpleNamespace, torch.Tensor, torch.Tensor, SimpleNamespace]:
    g = torch.Generator().manual_seed(seed)
    rows, blocks = len(SEQ_LENS), len(SEQ_LENS) * COLUMNS
    keys = torch.randint(-3, 4, (blocks, BLOCK // KPOOL, DIM), generator=g).float()
    tables = torch.randperm(blocks, generator=g).view(rows, COLUMNS).to(torch.int32)
    tables[0] = -1  # a padding row's table
    flat = keys.view(-1, DIM)
    last = tables[-1].long()
    for pool in (1, 2, 5, 6):  # the last row: four pools with one key, so their scores tie exactly
        flat[last[pool * KPOOL // BLOCK] * (BLOCK // KPOOL) + pool % (BLOCK // KPOOL)] = flat[last[0] * 2]
    scales: dict[str, list[torch.Tensor]] = {}
    cache = keys
    if quantized:  # e4m3 codes (small integers are exact) with power-of-two row scales
        cache = keys.to(torch.float8_e4m3fn)
        exponents = torch.randint(-2, 2, (blocks, BLOCK // KPOOL, 1), generator=g).float()
        scales["pooled"] = [torch.pow(2.0, exponents)]
    batch = SimpleNamespace(
        cache=SimpleNamespace(kv={"pooled": [cache]}, kv_scales=scales, block_size=BLOCK),
        block_tables=tables,
        seq_lens=torch.tensor(SEQ_LENS, dtype=torch.int32),
    )
    indexer = SimpleNamespace(
        kpool=KPOOL, select_pools=KEEP, select_tail=tail, cache_name="pooled", dtype=torch.float32
    )
    q = torch.randint(-2, 3, (rows, HEADS, DIM), generator=g).float()
    weights = torch.randint(-2, 3, (rows, HEADS), generator=g).float()
    return indexer, q, weights, batch


def _select(monkeypatch: pytest.MonkeyPatch, fused: bool, *step: object):  # type: ignore[no-untyped-def]
    monkeypatch.setattr(decode, "use_triton", lambda x: fused)
    return decode.select_decode(*step)  # type: ignore[arg-type]


@pytest.mark.parametrize("quantized", [False, True])
@pytest.mark.parametrize("tail", [True, False])
def test_fused_selection_equals_the_torch_path(
    monkeypatch: pytest.MonkeyPatch, quantized: bool, tail: bool
) -> None:
    step = _step(quantized, tail, seed=3 + quantized)
    got = _select(monkeypatch, True, *step)
    want = _select(monkeypatch, False, *step)
    assert torch.equal(got.sparse, want.sparse)
    assert got.sparse.tolist() == [0, 0, 0, 0, 1, 1, 1, 1]
    assert torch.equal(got.counts, want.counts)
    for r in range(len(SEQ_LENS)):
        assert torch.equal(got.positions[r], want.positions[r]), r


def test_ties_go_to_the_lower_pool(monkeypatch: pytest.MonkeyPatch) -> None:
    """The last row sees 7 pools; pools 0, 1, 2, 5 and 6 share one key. Whichever three that key's score ranks
    among, exact ties keep the lowest pools, the stable descending sort's order."""
    indexer, q, weights, batch = _step(False, True, seed=5)
    got = _select(monkeypatch, True, indexer, q, weights, batch)
    keys = batch.cache.kv["pooled"][0].view(-1, DIM)
    table = batch.block_tables[-1].long()
    pooled = torch.stack([keys[table[p * KPOOL // BLOCK] * 2 + p % 2] for p in range(7)])
    scores = (torch.relu(q[-1] @ pooled.t() * DIM**-0.5).t() @ weights[-1]).tolist()
    order = sorted(range(7), key=lambda p: (-scores[p], p))[:KEEP]
    picked = sorted(order)
    want = [p * KPOOL + i for p in picked for i in range(KPOOL)] + [28, 29]
    assert got.positions[-1, : int(got.counts[-1])].tolist() == want


def test_pooled_positions_expand_picks_and_tail() -> None:
    """The expansion alone: picked pools' tokens, then the open tail; dense rows count every visible token."""
    pools = torch.tensor([[0, 2, 5], [1, 3, 4], [0, 1, 2]], dtype=torch.int32)
    seq_lens = torch.tensor([27, 7, 0], dtype=torch.int32)
    positions, count, sparse = pooled_positions_triton(pools, seq_lens, KPOOL, True)
    assert sparse.tolist() == [1, 0, 0] and count.tolist() == [15, 7, 0]
    assert positions[0].tolist() == [0, 1, 2, 3, 8, 9, 10, 11, 20, 21, 22, 23, 24, 25, 26]
    assert positions[1].tolist() == [0, 1, 2, 3, 4, 5, 6] + [0] * 8
    assert positions[2].tolist() == [0] * 15
