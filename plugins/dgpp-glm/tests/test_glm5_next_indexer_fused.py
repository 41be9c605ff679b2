"""GLM-5.3-Flash's k-pooled indexer decode selection on its CUDA path (Triton interpreter, fp32) against the torch
path: the same positions, counts and sparse flags for padding rows, dense rows (fewer complete pools than kept,
exactly as many, a few tokens more), sparse rows with and without an open tail, a row at the table's end, exact
score ties (to the lower pool), e4m3 pooled keys with row scales, and pools spanning two cache blocks. Keys,
queries and weights are small integers, so both paths compute every score exactly and any difference is a
difference in picks."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

from dgpp.kernels.pooled_selection import pooled_positions_triton
from dgpp_glm import glm5_next_indexer_decode as decode

KPOOL, KEEP, HEADS, DIM, BLOCK, COLUMNS = 4, 3, 4, 16, 8, 6
SEQ_LENS = [0, 5, 12, 13, 16, 47, 48, 30]  # pad; dense x3; sparse, tail 0 / 3; the table's end; ties


def _pool_row(table: torch.Tensor, pool: int, block: int) -> int:
    """The flat cache row of pool ``pool`` of a sequence: in the block of the pool's last token."""
    last = (pool + 1) * KPOOL - 1
    return int(table[last // block]) * max(1, block // KPOOL) + (last % block) // KPOOL


def _step(
    quantized: bool, tail: bool, seed: int, block: int = BLOCK
) -> tuple[SimpleNamespace, torch.Tensor, torch.Tensor, SimpleNamespace]:
    g = torch.Generator().manual_seed(seed)
    columns = COLUMNS * BLOCK // block  # 12 pools a table
    rows, blocks, per_block = len(SEQ_LENS), len(SEQ_LENS) * columns, max(1, block // KPOOL)
    keys = torch.randint(-3, 4, (blocks, per_block, DIM), generator=g).float()
    tables = torch.randperm(blocks, generator=g).view(rows, columns).to(torch.int32)
    tables[0] = -1  # a padding row's table
    flat = keys.view(-1, DIM)
    for pool in (1, 2, 5, 6):  # the last row: four pools with pool 0's key, so their scores tie exactly
        flat[_pool_row(tables[-1], pool, block)] = flat[_pool_row(tables[-1], 0, block)]
    scales: dict[str, list[torch.Tensor]] = {}
    cache = keys
    if quantized:  # e4m3 codes (small integers are exact) with power-of-two row scales
        cache = keys.to(torch.float8_e4m3fn)
        exponents = torch.randint(-2, 2, (blocks, per_block, 1), generator=g).float()
        scales["pooled"] = [torch.pow(2.0, exponents)]
    batch = SimpleNamespace(
        cache=SimpleNamespace(kv={"pooled": [cache]}, kv_scales=scales, block_size=block),
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
@pytest.mark.parametrize("block", [BLOCK, 2])  # pools inside a block; a pool spanning two blocks
def test_fused_selection_equals_the_torch_path(
    monkeypatch: pytest.MonkeyPatch, quantized: bool, tail: bool, block: int
) -> None:
    step = _step(quantized, tail, seed=3 + quantized, block=block)
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
    pooled = torch.stack([keys[_pool_row(table, p, BLOCK)] for p in range(7)])
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


def test_row_path_scores_through_the_same_kernel(monkeypatch: pytest.MonkeyPatch) -> None:
    """A prefill chunk / speculative verify (several rows per sequence) on CUDA scores through the decode step's
    kernel: the same picks as its torch path, rows crossing from dense to sparse, a padding sequence selecting
    nothing; and a one-row sequence's picks equal the decode step's."""
    from dgpp_glm import glm5_next_indexer
    from dgpp_glm.glm5_next_indexer import KPoolIndexer

    indexer_ns, q, weights, batch = _step(True, True, seed=7)
    indexer = KPoolIndexer(8, 8, HEADS, DIM, KEEP * KPOOL, KPOOL, "pooled", dtype=torch.float32)
    q_lens = [0, 5, 1, 1, 4, 4, 1, 1]  # sequence 0 pads; 1, 4 and 5 carry a chunk each
    rows = sum(q_lens)
    batch.q_lens_cpu = q_lens
    batch.seq_lens_cpu = SEQ_LENS
    batch.context_lens_cpu = [n - q for n, q in zip(SEQ_LENS, q_lens, strict=True)]
    batch.state_slots = torch.tensor([-1, 1, 2, 3, 4, 5, 6, 7])
    g = torch.Generator().manual_seed(8)
    q_rows = torch.randint(-2, 3, (rows, HEADS, DIM), generator=g).float()
    w_rows = torch.randint(-2, 3, (rows, HEADS), generator=g).float()
    picks = {}
    for fused in (True, False):
        monkeypatch.setattr(glm5_next_indexer, "use_triton", lambda x, fused=fused: fused)
        picks[fused] = indexer.select_rows(q_rows, w_rows, batch)  # type: ignore[arg-type]
    assert [p is None for p in picks[True]] == [p is None for p in picks[False]]
    assert sum(p is not None for p in picks[True]) == 7  # 13..16 (the last row), 44..47 (all four), 48, 30
    for got, want in zip(picks[True], picks[False], strict=True):
        assert got is None or torch.equal(got, want)
    # the one-row sequences (lengths 12, 13, 48, 30) against the decode step
    decode_rows = [5, 6, 15, 16]
    one_row = SimpleNamespace(**vars(batch))
    keep_seqs = [2, 3, 6, 7]
    one_row.block_tables = batch.block_tables[keep_seqs]
    one_row.seq_lens = batch.seq_lens[keep_seqs]
    step = _select(monkeypatch, True, indexer_ns, q_rows[decode_rows], w_rows[decode_rows], one_row)
    for r, row in enumerate(decode_rows):
        want = picks[True][row]
        assert bool(step.sparse[r]) == (want is not None)
        if want is not None:
            assert step.positions[r, : int(step.counts[r])].tolist() == want.tolist()


@pytest.mark.parametrize("quantized", [False, True])
def test_fused_store_writes_the_torch_paths_bytes(monkeypatch: pytest.MonkeyPatch, quantized: bool) -> None:
    """The decode step's ring writes and pooled-key store on CUDA (masked-store launches, the quantized write)
    leave the ring and the pooled cache byte for byte as the torch path does: rows completing a pool store it,
    other rows only buffer, a padding row (slot -1) writes nothing."""
    from dgpp_glm.glm5_next_indexer import KPoolIndexer

    g = torch.Generator().manual_seed(11)
    indexer = KPoolIndexer(8, 8, HEADS, DIM, KEEP * KPOOL, KPOOL, "pooled", dtype=torch.float32)
    indexer.index_kpool_compress_ape.copy_(torch.randn(KPOOL, DIM, generator=g))
    positions = [0, 3, 7, 10, 15, 46, 9]  # completes pools at 3, 7, 15 (and 9 pads)
    slots = [0, 1, 2, 3, 4, 5, -1]
    rows, blocks = len(positions), len(positions) * COLUMNS
    ring_kv = torch.randn(rows - 1, KPOOL, DIM, generator=g)
    ring_gate = torch.randn(rows - 1, KPOOL, DIM, generator=g)
    cache = torch.randn(blocks, BLOCK // KPOOL, DIM, generator=g)
    scales: dict[str, list[torch.Tensor]] = {}
    if quantized:
        cache = cache.to(torch.float8_e4m3fn)
        scales["pooled"] = [torch.rand(blocks, BLOCK // KPOOL, 1, generator=g)]
    tables = torch.randperm(blocks, generator=g).view(rows, COLUMNS).to(torch.int32)
    kv, gate = torch.randn(rows, DIM, generator=g), torch.randn(rows, DIM, generator=g)
    results = []
    for fused in (True, False):
        monkeypatch.setattr(decode, "use_triton", lambda x, fused=fused: fused)
        state = {"kv": ring_kv.clone(), "gate": ring_gate.clone()}
        stored = cache.clone()
        row_scales = {k: [v[0].clone()] for k, v in scales.items()}
        batch = SimpleNamespace(
            cache=SimpleNamespace(
                kv={"pooled": [stored]},
                kv_scales=row_scales,
                block_size=BLOCK,
                state={indexer.buffer_name: state},
            ),
            block_tables=tables,
            state_slots=torch.tensor(slots, dtype=torch.int32),
            context_lens=torch.tensor(positions, dtype=torch.int32),
        )
        decode.store_decode(indexer, kv, gate, batch)  # type: ignore[arg-type]
        results.append((state["kv"], state["gate"], stored.view(torch.uint8), row_scales))
    fused_bytes, torch_bytes = results
    for got, want in zip(fused_bytes[:3], torch_bytes[:3], strict=True):
        assert torch.equal(got, want)
    if quantized:
        assert torch.equal(fused_bytes[3]["pooled"][0], torch_bytes[3]["pooled"][0])
    assert not torch.equal(torch_bytes[2], cache.view(torch.uint8))  # some pool was stored
    assert torch.equal(fused_bytes[0][5, 46 % KPOOL], kv[5]) and torch.equal(fused_bytes[0][0, 0], kv[0])
