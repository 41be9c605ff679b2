"""Short prefill chunks grouped into one fixed-order call (dgpp.nn.exact.routing, dgpp.kernels.gemm_prefill),
checked on the CPU under the Triton interpreter in fp32: the prefill tiles give a row the decode GEMV's bits, the
route sends chunks by their own length, and a short chunk's rows are the same computed among many chunks, beside
a long chunk, or alone. The GPU twin: tests/perf/check_exact_cuda.py and tests/perf/bench_burst_prefill.py.

K is one ``BK`` step (64) here: the interpreter adds each k-step's dot to the accumulator after the fact, while the
GPU's MMA folds the accumulator into the dot, so only the GPU can show the chain is the same across ``BK``. For the
same reason fp32 calls of 65-127 rows (``FP32_TILE``, 32-wide K steps on the GPU) take one 64-wide step here."""

from __future__ import annotations

import pytest
import torch

from dgpp.kernels import gemm_prefill
from dgpp.kernels.gemv import gate_up_silu_triton, multi_linear_triton
from dgpp.nn.exact import chunks
from dgpp.nn.exact import gemm as exact_gemm
from dgpp.nn.exact import routing as exact_cuda
from dgpp.nn.exact.gemm import PREFILL_ROWS, fixed_order_gate_up_silu, fixed_order_linear
from dgpp.policy import overriding
from dgpp.step.route import in_flight, route_for

K = 64


@pytest.fixture(autouse=True)
def _one_k_step_for_fp32_rows(monkeypatch):
    monkeypatch.setattr(exact_gemm, "FP32_TILE", (64, K, 1))


def _gemv_rows(fn, x: torch.Tensor) -> torch.Tensor:
    """``fn`` over ``x`` in decode-GEMV calls of at most 64 rows (the rows a decode step computes)."""
    return torch.cat([fn(x[a : a + 64]) for a in range(0, x.shape[0], 64)])


def test_prefill_tiles_give_rows_the_decode_gemv_bits():
    g = torch.Generator().manual_seed(0)
    ws = [torch.randn(n, K, generator=g) / 8 for n in (256, 256)]
    x = torch.randn(
        300, K, generator=g
    )  # 3 row blocks, the last one partial (its rows clamp to the last row)
    tiled = torch.cat(gemm_prefill.prefill_linear(x, ws), 1)
    assert torch.equal(tiled, _gemv_rows(lambda r: torch.cat(multi_linear_triton(r, ws), 1), x))
    assert torch.equal(tiled[7:8], torch.cat(multi_linear_triton(x[7:8], ws), 1))
    torch.testing.assert_close(tiled, torch.cat([x @ w.T for w in ws], 1), rtol=1e-4, atol=1e-4)
    wg, wu = (torch.randn(128, K, generator=g) / 8 for _ in range(2))
    fused = gemm_prefill.prefill_gate_up_silu(x, wg, wu)
    assert torch.equal(fused, _gemv_rows(lambda r: gate_up_silu_triton(r, wg, wu), x))
    torch.testing.assert_close(fused, torch.nn.functional.silu(x @ wg.T) * (x @ wu.T), rtol=1e-4, atol=1e-4)


def test_fixed_order_calls_take_the_prefill_tile_from_prefill_rows_on(monkeypatch):
    g = torch.Generator().manual_seed(1)
    ws = [torch.randn(256, K, generator=g) / 8]
    x = torch.randn(PREFILL_ROWS + 3, K, generator=g)
    taken = []
    real = gemm_prefill.prefill_linear
    monkeypatch.setattr(gemm_prefill, "prefill_linear", lambda *a, **k: taken.append(1) or real(*a, **k))
    big = fixed_order_linear(x, ws)[0]
    assert taken == [1]
    with overriding(exact_prefill_tile=False):  # the 64-row GEMV tiles: the same rows
        assert torch.equal(fixed_order_linear(x, ws)[0], big)
    assert taken == [1]
    assert torch.equal(fixed_order_linear(x[:5], ws)[0], big[:5])


def test_route_sends_chunks_by_their_own_length():
    route = route_for([5, 1, 7, 40, 3], "cpu", group_rows=8)
    assert route.bulk_ranges == ((0, 5), (6, 13), (13, 53), (53, 56))
    assert route.long_ranges == ((13, 53),)
    assert route.fixed_rows.tolist() == list(range(13)) + [53, 54, 55]
    assert route_for([5, 7], "cpu", group_rows=8).long_ranges == ()  # every row in the one fixed-order call
    only_long = route_for([40, 9], "cpu", group_rows=8)
    assert only_long.long_ranges == ((0, 40), (40, 49)) and only_long.fixed_rows is None
    off = route_for([5, 1, 7], "cpu", group_rows=0)  # grouping off: every chunk in calls of its own
    assert off.long_ranges == off.bulk_ranges and off.fixed_rows.tolist() == [5]


def _linear_step(
    x: torch.Tensor, ws: list[torch.Tensor], q_lens: list[int], group_rows: int, calls: list[tuple[str, int]]
):
    """One step's dense linear through ``route_rows`` as ``routed_linears`` wires it (fixed-order rows, cuBLAS
    chunks written in place), logging each call's kind and row count."""

    def exact(rows):
        calls.append(("fixed", rows.shape[0]))
        return fixed_order_linear(rows.contiguous(), ws)

    def bulk(rows):
        calls.append(("bulk", rows.shape[0]))
        return [torch.nn.functional.linear(rows, w) for w in ws]

    def in_place(rows, ranges):
        calls.extend(("chunk", b - a) for a, b in ranges)
        return chunks.chunk_linears(rows, ws, ranges)

    with in_flight(route_for(q_lens, "cpu", group_rows=group_rows)):
        return torch.cat(exact_cuda.route_rows(x, exact, bulk, in_place, grouped=True), 1)


def test_short_chunk_rows_equal_in_a_group_beside_a_long_chunk_and_alone():
    g = torch.Generator().manual_seed(2)
    ws = [torch.randn(256, K, generator=g) / 8]
    lens = [70] * 8 + [1, 600]  # 8 short chunks (560 rows: the prefill tile), a decode row, one long chunk
    x = torch.randn(sum(lens), K, generator=g)
    calls: list[tuple[str, int]] = []
    grouped = _linear_step(x, ws, lens, 100, calls)
    assert calls == [
        ("fixed", 561),
        ("chunk", 600),
    ]  # one fixed-order call for the short chunks and the decode row
    calls.clear()
    burst = _linear_step(x[:561], ws, lens[:9], 100, calls)  # no long chunk: the whole step in one call
    assert calls == [("fixed", 561)] and torch.equal(burst, grouped[:561])
    for i in (0, 5):
        calls.clear()
        alone = _linear_step(x[70 * i : 70 * i + 70], ws, [70], 100, calls)
        assert calls == [("fixed", 70)] and torch.equal(alone, grouped[70 * i : 70 * i + 70]), i
    calls.clear()
    long_alone = _linear_step(x[561:], ws, [600], 100, calls)
    assert calls == [("bulk", 600)] and torch.equal(long_alone, grouped[561:])
    calls.clear()
    _linear_step(x, ws, lens, 0, calls)  # grouping off: a call per chunk again
    assert calls == [("fixed", 1)] + [("chunk", 70)] * 8 + [("chunk", 600)]


def test_short_chunks_gate_up_silu_grouped_equal_alone():
    g = torch.Generator().manual_seed(3)
    wg, wu = (torch.randn(128, K, generator=g) / 8 for _ in range(2))
    lens = [65] * 8 + [300]
    x = torch.randn(sum(lens), K, generator=g)

    def step(rows, q_lens):
        def exact(r):
            return [fixed_order_gate_up_silu(r.contiguous(), wg, wu)]

        def bulk(r):
            return [torch.nn.functional.silu(r @ wg.T) * (r @ wu.T)]

        with in_flight(route_for(q_lens, "cpu", group_rows=128)):
            return exact_cuda.route_rows(
                rows,
                exact,
                bulk,
                lambda r, ranges: chunks.chunk_gate_up_silu(r, wg, wu, ranges),
                grouped=True,
            )[0]

    together = step(x, lens)
    assert torch.equal(step(x[65:130], [65]), together[65:130])
    assert torch.equal(step(x[:520], lens[:8]), together[:520])  # 520 rows: the prefill tile
    torch.testing.assert_close(together[520:], torch.nn.functional.silu(x[520:] @ wg.T) * (x[520:] @ wu.T))
