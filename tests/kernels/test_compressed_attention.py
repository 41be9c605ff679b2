"""Compressed sink attention (DeepSeek-V4's CSA / HCA prefill): the Triton kernel (interpreter, fp32) and the
batched torch form against the per-row reference, over three sequences in several chunks whose cuts fall inside
compression windows; with windows and entry lists longer than one kernel tile. Each feature the kernel must keep
(the sinks, the CSA selection, causal masking) has a case that fails without it."""

from __future__ import annotations

import functools

import pytest
import torch

from dgpp.engine.runner import build_batch
from dgpp.engine.work import SeqWork
from dgpp.kernels.compressed_attention import (
    CompressedAttentionInputs,
    compressed_attention_torch,
    compressed_attention_triton,
)
from dgpp.kernels.ring_write import RingWriteInputs, ring_write_ref
from dgpp.nn.compressed_attention import sparse_window_attention_ref
from dgpp.nn.compressed_prefill import attention_inputs
from dgpp.step.cache_spec import CompressedKV, WindowKV
from dgpp.step.pools import CachePools

HEADS, DIM, WINDOW, RATIO, TOPK, BLOCK = 4, 32, 40, 2, 6, 8
PROMPTS = (70, 33, 50)
CHUNKS = ((70, 33, 50), (37, 20, 33), (1, 7, 50))  # per step, rows of each sequence (one shot, then cuts)


def _setup(seed: int):
    g = torch.Generator().manual_seed(seed)
    spec = {
        "attn": WindowKV(num_kv_heads=1, head_dim=DIM, dtype=torch.float32, window=WINDOW, v_head_dim=0),
        "attn.compressor": CompressedKV.of(RATIO, DIM, torch.float32),
    }
    tables, start = [], 0
    for n in PROMPTS:
        tables.append(list(range(start, start + -(-n // BLOCK))))
        start += len(tables[-1])
    pools = CachePools(spec, start, BLOCK, len(PROMPTS))
    pools.kv["attn.compressor"][0].copy_(torch.randn(pools.kv["attn.compressor"][0].shape, generator=g))
    rows = {
        "q": [torch.randn(n, HEADS, DIM, generator=g) for n in PROMPTS],
        "kv": [torch.randn(n, DIM, generator=g) for n in PROMPTS],
        "picks": [torch.rand(n, max(PROMPTS), generator=g) for n in PROMPTS],  # random scores to pick by
    }
    return pools, tables, rows, torch.randn(HEADS, generator=g)


def _picks(scores: torch.Tensor, positions: torch.Tensor) -> tuple[list[torch.Tensor | None], torch.Tensor]:
    """Per row: TOPK random visible entries (ascending; None when the row sees at most TOPK), and [T, TOPK]."""
    selection: list[torch.Tensor | None] = []
    dense = torch.arange(TOPK).repeat(positions.shape[0], 1)
    for i, p in enumerate(positions.tolist()):
        visible = (p + 1) // RATIO
        chosen = None
        if visible > TOPK:
            chosen = scores[i, :visible].topk(TOPK).indices.sort().values
            dense[i] = chosen
        selection.append(chosen)
    return selection, dense


@functools.cache
def _run(seed: int, sparse: bool, chunks=CHUNKS[0], sinks_on: bool = True, select: bool = True):
    """(reference, torch form, kernel) outputs of every row of every sequence, the prompts fed in ``chunks``."""
    pools, tables, rows, sinks = _setup(seed)
    if not sinks_on:
        sinks = torch.full_like(sinks, -1e30)
    ring = pools.state["attn"]["k"]
    pool = pools.kv["attn.compressor"][0]
    outs: dict[str, list[list[torch.Tensor]]] = {}
    done = [0] * len(PROMPTS)
    while any(d < n for d, n in zip(done, PROMPTS, strict=True)):
        live = [i for i, n in enumerate(PROMPTS) if done[i] < n]
        take = [min(chunks[i], PROMPTS[i] - done[i]) for i in live]
        batch = build_batch(
            [SeqWork(i, tables[i], done[i], [0] * t) for i, t in zip(live, take, strict=True)], pools
        )
        q = torch.cat([rows["q"][i][done[i] : done[i] + t] for i, t in zip(live, take, strict=True)])
        kv = torch.cat([rows["kv"][i][done[i] : done[i] + t] for i, t in zip(live, take, strict=True)])
        scores = torch.cat([rows["picks"][i][done[i] : done[i] + t] for i, t in zip(live, take, strict=True)])
        selection: list[torch.Tensor | None] = [None] * q.shape[0]
        picks = None
        if sparse:
            selection, dense = _picks(scores, batch.positions)
            picks = (dense, ((batch.positions + 1) // RATIO).clamp(max=TOPK))
        if not select:
            selection = [None] * q.shape[0]
        inputs = attention_inputs(q, kv, ring, pool, batch, sinks, DIM**-0.5, WINDOW, RATIO, picks)
        results = {
            "ref": sparse_window_attention_ref(
                q, kv, ring, pool, batch, sinks, DIM**-0.5, WINDOW, RATIO, selection
            )
        }
        if sinks_on and select:  # the others are references with a feature removed
            results["torch"] = compressed_attention_torch(inputs)
            results["kernel"] = compressed_attention_triton(inputs)
        for name, out in results.items():
            for i, part in zip(live, out.split(take), strict=True):
                outs.setdefault(name, [[] for _ in PROMPTS])[i].append(part)
        latent = kv[:, None, :]
        ring_write_ref(RingWriteInputs(latent, latent, ring, ring, batch.state_slots, *lens(batch)))
        for i, t in zip(live, take, strict=True):
            done[i] += t
    return {name: torch.cat([torch.cat(parts) for parts in per_seq]) for name, per_seq in outs.items()}


def lens(batch):
    return batch.query_start_loc, batch.context_lens, batch.seq_lens


@pytest.mark.parametrize("sparse", [False, True], ids=["hca", "csa"])
def test_kernel_and_torch_form_match_the_reference_in_chunks(sparse: bool) -> None:
    """The torch form has the reference's bits (the same per-row products, batched); the kernel is within fp32
    rounding (its online softmax sums in tiles); one shot and two sets of cuts give the kernel the same bits."""
    whole = _run(1, sparse)
    assert torch.equal(whole["torch"], whole["ref"])
    torch.testing.assert_close(whole["kernel"], whole["ref"], rtol=1e-5, atol=1e-5)
    for chunks in CHUNKS[1:]:
        cut = _run(1, sparse, chunks)
        assert torch.equal(cut["kernel"], whole["kernel"]) and torch.equal(cut["torch"], whole["torch"])
        assert torch.equal(cut["ref"], whole["ref"])


@pytest.mark.parametrize("sparse", [False, True], ids=["hca", "csa"])
def test_the_sinks_matter(sparse: bool) -> None:
    """Without the sinks the reference moves far past the tolerance the kernel keeps."""
    got = _run(1, sparse)["kernel"]
    assert float((_run(1, sparse, sinks_on=False)["ref"] - got).abs().max()) > 1e-2


def test_the_selection_matters() -> None:
    """The kernel attends the picks only: every complete entry instead moves the rows that pick."""
    got = _run(1, True)["kernel"]
    assert float((_run(1, True, select=False)["ref"] - got).abs().max()) > 1e-2


def test_rows_do_not_see_later_rows() -> None:
    """Changing this step's later latent rows leaves every earlier row's output bit for bit (the window's
    causal bound), while the changed rows move; a padding sequence (state slot -1) gets zeros."""
    pools, tables, rows, sinks = _setup(4)
    ring, pool = pools.state["attn"]["k"], pools.kv["attn.compressor"][0]
    n = PROMPTS[0]
    batch = build_batch([SeqWork(0, tables[0], 0, [0] * n)], pools)
    q, kv = rows["q"][0], rows["kv"][0]

    def attend(latent: torch.Tensor) -> torch.Tensor:
        inputs = attention_inputs(q, latent, ring, pool, batch, sinks, DIM**-0.5, WINDOW, RATIO, None)
        return compressed_attention_triton(inputs)

    base = attend(kv)
    later = kv.clone()
    later[50:] += 1.0
    assert torch.equal(attend(later)[:50], base[:50])
    assert float((attend(later)[50:] - base[50:]).abs().max()) > 1e-3
    batch.state_slots.fill_(-1)  # a padding sequence: zeros
    assert float(attend(kv).abs().max()) == 0.0


def test_wide_heads_split_over_programs() -> None:
    """A latent wider than 256 (16-key tiles, 16 heads per program) under 20 heads (a second, partial head
    block), a chunk starting mid-sequence with entry lists of any length: the kernel against the torch form."""
    g = torch.Generator().manual_seed(5)
    heads, dim, window, rows, ctx = 20, 320, 20, 24, 30
    q = torch.randn(rows, heads, dim, generator=g)
    kv = torch.randn(rows, dim, generator=g)
    ring = torch.randn(2, window - 1, 1, dim, generator=g)
    pool = torch.randn(50, dim, generator=g)
    entry_rows = torch.randint(0, 50, (rows, 21), generator=g)
    count = torch.randint(0, 22, (rows,), generator=g)
    seqs = (torch.tensor([0, rows]), torch.tensor([ctx]), torch.tensor([ctx + rows]), torch.tensor([1]))
    inputs = CompressedAttentionInputs(
        q, kv, ring, pool, entry_rows, count, *seqs, torch.randn(heads, generator=g), dim**-0.5, window
    )
    torch.testing.assert_close(
        compressed_attention_triton(inputs), compressed_attention_torch(inputs), rtol=1e-5, atol=1e-5
    )
