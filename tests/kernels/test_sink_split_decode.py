"""Split-context decode with sink logits (the full-attention layers of Flint and MiMo): the split kernel
(Triton interpreter, fp32) against ``window_attention_ref``, the sink joining each row's softmax exactly once,
e4m3 pools, row exactness, and the row routing of ``dgpp.nn.paged_sink_attention``."""

from __future__ import annotations

import math
from types import SimpleNamespace

import pytest
import torch

from dgpp.kernels import window_attention as window_module
from dgpp.kernels.kv_fp8 import dequantize_rows, quantize_rows
from dgpp.kernels.window_attention import window_attention_ref, window_attention_triton
from dgpp.nn import paged_sink_attention as routing_module
from dgpp.nn.exact.attention import expand_rows, paged_decode_attention_fixed
from dgpp.nn.paged_sink_attention import paged_sink_attention
from dgpp.policy import overriding
from dgpp.step.route import route_for

BS = 16
# 300 tokens over 4 splits: 3 partitions of 128; 190: 3 of 64; 65: 2; 7: one (written directly); 0: padding
LENS = [300, 7, 0, 65, 190]


def _pool(seqs: int, longest: int, hk: int, dim: int, v_dim: int, seed: int):
    g = torch.Generator().manual_seed(seed)
    per = -(-longest // BS)
    blocks = seqs * per + 3
    k = torch.randn(blocks, BS, hk, dim, generator=g)
    v = torch.randn(blocks, BS, hk, v_dim, generator=g)
    tables = torch.randperm(blocks, generator=g)[: seqs * per].view(seqs, per).int()
    return k, v, tables


def _decode_ref(q, kc, vc, tables, lens, sinks, scale, scales=None):
    """``window_attention_ref`` over one decode row per sequence (row ``b`` at position ``lens[b] - 1``)."""
    seq_lens = torch.tensor(lens, dtype=torch.int32)
    starts = torch.arange(len(lens) + 1, dtype=torch.int32)
    ctx = (seq_lens - 1).clamp(min=0)
    return window_attention_ref(
        q, None, None, kc, vc, tables, starts, ctx, seq_lens, sinks, scale, 0, True, scales
    )


def _sinks(hq: int, seed: int, level: float = 0.0) -> torch.Tensor:
    return torch.randn(hq, generator=torch.Generator().manual_seed(seed)) + level


def _whole_context(attend, q, kc, vc, batch, sinks, scale) -> torch.Tensor:
    """``attend`` (the window kernel or its reference) over each row's whole paged context (window 0)."""
    args = (
        batch.block_tables,
        batch.query_start_loc,
        batch.context_lens,
        batch.seq_lens,
        sinks,
        scale,
        0,
        True,
    )
    return attend(q, None, None, kc, vc, *args)


def _assert_matches_reference(out, q, kc, vc, batch, sinks, scale) -> None:
    ref = _whole_context(window_attention_ref, q, kc, vc, batch, sinks, scale)
    torch.testing.assert_close(out, ref, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize(("hq", "hk", "dim", "v_dim"), [(4, 2, 16, 16), (8, 2, 48, 32), (16, 1, 48, 32)])
def test_split_decode_with_sinks_matches_the_window_reference(hq: int, hk: int, dim: int, v_dim: int) -> None:
    kc, vc, tables = _pool(len(LENS), max(LENS), hk, dim, v_dim, seed=hq + dim)
    q = torch.randn(len(LENS), hq, dim, generator=torch.Generator().manual_seed(1))
    sinks = _sinks(hq, 2, level=3.0)
    lens = torch.tensor(LENS, dtype=torch.int32)
    out = paged_decode_attention_fixed(q, kc, vc, tables, lens, 0.3, splits=4, sinks=sinks)
    torch.testing.assert_close(out, _decode_ref(q, kc, vc, tables, LENS, sinks, 0.3), rtol=1e-5, atol=1e-5)
    assert float(out[2].abs().max()) == 0.0  # the padding row


def test_the_sink_joins_a_split_row_once() -> None:
    """A 300-token row over 4 splits merges 3 partials: a sink dropped, or added to every partial (the same as
    the logit ``sink + log 3`` counted once), is far from the kernel's output."""
    hq, hk, dim = 4, 2, 32
    kc, vc, tables = _pool(1, 300, hk, dim, dim, seed=5)
    q = torch.randn(1, hq, dim, generator=torch.Generator().manual_seed(6))
    # around the keys' log-sum-exp: the sink takes a large share of each head's softmax
    sinks = _sinks(hq, 7, level=math.log(300) + 1.0)
    out = paged_decode_attention_fixed(
        q, kc, vc, tables, torch.tensor([300], dtype=torch.int32), 0.3, splits=4, sinks=sinks
    )
    once = _decode_ref(q, kc, vc, tables, [300], sinks, 0.3)
    torch.testing.assert_close(out, once, rtol=1e-5, atol=1e-5)
    for wrong in (None, sinks + math.log(3)):
        far = _decode_ref(q, kc, vc, tables, [300], wrong, 0.3)
        assert float((out - far).abs().max()) > 100 * float((out - once).abs().max()) + 1e-3


def test_split_decode_with_sinks_reads_e4m3_pools() -> None:
    hq, hk, dim, v_dim = 8, 2, 48, 32
    k, v, tables = _pool(len(LENS), max(LENS), hk, dim, v_dim, seed=8)
    (kc, ks), (vc, vs) = quantize_rows(k * 3), quantize_rows(v)
    q = torch.randn(len(LENS), hq, dim, generator=torch.Generator().manual_seed(9))
    sinks = _sinks(hq, 10, level=2.0)
    lens = torch.tensor(LENS, dtype=torch.int32)
    out = paged_decode_attention_fixed(q, kc, vc, tables, lens, 0.2, splits=4, scales=(ks, vs), sinks=sinks)
    ref = _decode_ref(q, kc, vc, tables, LENS, sinks, 0.2, (ks, vs))
    torch.testing.assert_close(out, ref, rtol=1e-5, atol=1e-5)
    widened = dequantize_rows(kc, ks, torch.float32), dequantize_rows(vc, vs, torch.float32)
    plain = paged_decode_attention_fixed(q, *widened, tables, lens, 0.2, splits=4, sinks=sinks)
    # the e4m3 read applies each row's scale once per key (not once per value): the last fp32 places differ
    torch.testing.assert_close(out, plain, rtol=1e-5, atol=1e-5)


def test_split_decode_rows_with_sinks_do_not_depend_on_the_batch() -> None:
    hq, hk, dim = 8, 2, 32
    kc, vc, tables = _pool(len(LENS), max(LENS), hk, dim, dim, seed=11)
    q = torch.randn(len(LENS), hq, dim, generator=torch.Generator().manual_seed(12))
    sinks = _sinks(hq, 13)
    lens = torch.tensor(LENS, dtype=torch.int32)
    together = paged_decode_attention_fixed(q, kc, vc, tables, lens, 0.3, splits=4, sinks=sinks)
    for r in range(len(LENS)):
        alone = paged_decode_attention_fixed(
            q[r : r + 1], kc, vc, tables[r : r + 1], lens[r : r + 1], 0.3, splits=4, sinks=sinks
        )
        assert torch.equal(together[r : r + 1], alone), r


def _step(q_lens: list[int], contexts: list[int], hq: int, hk: int, dim: int, seed: int):
    """A paged step (this step's K/V already in the pool) as ``paged_sink_attention`` reads it."""
    seq_lens = [c + n for c, n in zip(contexts, q_lens, strict=True)]
    kc, vc, tables = _pool(len(q_lens), max(seq_lens), hk, dim, dim, seed)
    q = torch.randn(sum(q_lens), hq, dim, generator=torch.Generator().manual_seed(seed + 1))
    starts = [0]
    for n in q_lens:
        starts.append(starts[-1] + n)
    batch = SimpleNamespace(
        block_tables=tables,
        query_start_loc=torch.tensor(starts, dtype=torch.int32),
        context_lens=torch.tensor(contexts, dtype=torch.int32),
        seq_lens=torch.tensor(seq_lens, dtype=torch.int32),
        q_lens_cpu=q_lens,
        seq_lens_cpu=seq_lens,
        context_lens_cpu=contexts,
        is_decode_only=all(n == 1 for n in q_lens),
        route=None,
        step_memo=lambda key, compute: compute(),  # ForwardBatch's per-step memo, uncached
    )
    return q, kc, vc, batch


@pytest.fixture
def triton_on_cpu(monkeypatch: pytest.MonkeyPatch) -> None:
    """The CUDA dispatch taken on CPU tensors: the Triton kernels run under the interpreter."""
    monkeypatch.setattr(routing_module, "use_triton", lambda x: True)
    monkeypatch.setattr(window_module, "use_triton", lambda x: True)


def _solo_decode(q_row, kc, vc, table, seq_len, sinks, scale):
    lens = torch.tensor([seq_len], dtype=torch.int32)
    return paged_decode_attention_fixed(q_row, kc, vc, table, lens, scale, splits=4, sinks=sinks)


@pytest.mark.usefixtures("triton_on_cpu")
def test_mixed_step_splits_its_decode_rows_and_windows_its_chunk() -> None:
    hq, hk, dim, scale = 4, 2, 32, 0.3
    q_lens, contexts = [1, 5, 1], [200, 10, 90]
    q, kc, vc, batch = _step(q_lens, contexts, hq, hk, dim, seed=20)
    sinks = _sinks(hq, 21, level=2.0)
    batch.route = route_for(q_lens, "cpu")
    with overriding(exact_splits=4):
        out = paged_sink_attention(q, kc, vc, batch, sinks, scale)
        for row, seq in (
            (0, 0),
            (6, 2),
        ):  # the decode rows: the split kernel's bits, as in a decode-only step
            table = batch.block_tables[seq : seq + 1]
            solo = _solo_decode(q[row : row + 1], kc, vc, table, batch.seq_lens_cpu[seq], sinks, scale)
            assert torch.equal(out[row : row + 1], solo), row
    chunk = window_attention_triton(
        q[1:6],
        None,
        None,
        kc,
        vc,
        batch.block_tables[1:2],
        torch.tensor([0, 5], dtype=torch.int32),
        batch.context_lens[1:2],
        batch.seq_lens[1:2],
        sinks,
        scale,
        0,
        True,
    )
    # the chunk's rows (four to a program, sharing key tiles): the one-row window kernel's, whatever shares the step
    assert torch.equal(out[1:6], chunk)
    _assert_matches_reference(out, q, kc, vc, batch, sinks, scale)


@pytest.mark.usefixtures("triton_on_cpu")
def test_verify_rows_have_the_bits_of_plain_decode_rows() -> None:
    hq, hk, dim, scale = 4, 2, 32, 0.3
    q_lens, contexts = [3, 1], [147, 89]
    q, kc, vc, batch = _step(q_lens, contexts, hq, hk, dim, seed=30)
    sinks = _sinks(hq, 31)
    batch.route = route_for(q_lens, "cpu", per_row=True)  # a speculative verify
    with overriding(exact_splits=4):
        out = paged_sink_attention(q, kc, vc, batch, sinks, scale)
        index, _, lens = expand_rows(batch.block_tables, batch.seq_lens_cpu, q_lens)
        for r, (seq, n) in enumerate(zip(index.tolist(), lens.tolist(), strict=True)):
            solo = _solo_decode(q[r : r + 1], kc, vc, batch.block_tables[seq : seq + 1], n, sinks, scale)
            assert torch.equal(out[r : r + 1], solo), r
    _assert_matches_reference(out, q, kc, vc, batch, sinks, scale)


@pytest.mark.usefixtures("triton_on_cpu")
def test_decode_only_step_takes_the_split_kernel_with_routing_off() -> None:
    hq, hk, dim, scale = 4, 2, 32, 0.3
    q, kc, vc, batch = _step([1, 1, 1], [299, 6, 0], hq, hk, dim, seed=40)
    batch.seq_lens[2] = 0  # a graph padding row
    batch.seq_lens_cpu[2] = 0
    sinks = _sinks(hq, 41)
    with overriding(exact_splits=4, exact_routing=False):
        out = paged_sink_attention(q, kc, vc, batch, sinks, scale)
        fixed = paged_decode_attention_fixed(
            q, kc, vc, batch.block_tables, batch.seq_lens, scale, sinks=sinks
        )
    assert torch.equal(out, fixed)
    assert float(out[2].abs().max()) == 0.0


@pytest.mark.usefixtures("triton_on_cpu")
def test_batch_invariant_prompt_rows_are_decode_rows_in_bounded_calls(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Under ``batch_invariant`` a prompt runs row by row; calls of 2 rows (the partials bound) change no bit."""
    from dgpp.nn.exact import attention as exact_attention

    hq, hk, dim, scale = 4, 2, 32, 0.3
    q_lens, contexts = [5, 1], [70, 130]
    q, kc, vc, batch = _step(q_lens, contexts, hq, hk, dim, seed=50)
    sinks = _sinks(hq, 51)
    monkeypatch.setattr(exact_attention, "_PARTIALS_PER_CALL", 2 * hq * 4 * dim)
    with overriding(exact_splits=4, batch_invariant=True):
        out = paged_sink_attention(q, kc, vc, batch, sinks, scale)
        index, _, lens = expand_rows(batch.block_tables, batch.seq_lens_cpu, q_lens)
        for r, (seq, n) in enumerate(zip(index.tolist(), lens.tolist(), strict=True)):
            solo = _solo_decode(q[r : r + 1], kc, vc, batch.block_tables[seq : seq + 1], n, sinks, scale)
            assert torch.equal(out[r : r + 1], solo), r


@pytest.mark.usefixtures("triton_on_cpu")
def test_heads_wider_than_the_split_tiles_keep_the_window_kernel() -> None:
    hq, hk, dim, scale = 2, 1, 272, 0.05
    q, kc, vc, batch = _step([1, 1], [149, 70], hq, hk, dim, seed=60)
    sinks = _sinks(hq, 61)
    with overriding(exact_splits=4):
        out = paged_sink_attention(q, kc, vc, batch, sinks, scale)
    window = _whole_context(window_attention_triton, q, kc, vc, batch, sinks, scale)
    assert torch.equal(out, window)
