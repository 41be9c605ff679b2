"""Split-K of the dense decode GEMV (``dgpp.kernels.gemv_split``) under the Triton interpreter in fp32: the rule
(by shape and SM count, never by rows), the split launch against F.linear, a row's bits whatever the rows sharing
the launch, and the unsplit launch kept for shapes that fill the GPU. The SM count is passed in (no GPU here);
``tests/perf/bench_dense_gemv.py`` times both launches on a GPU."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from dgpp.kernels import gemm_prefill, gemv_split
from dgpp.kernels.gemv import gate_up_silu_ref, gate_up_silu_triton, multi_linear_triton
from dgpp.nn.exact import gemm as exact_gemm
from dgpp.nn.exact.gemm import PREFILL_ROWS, WIDE_ROWS, fixed_order_gate_up_silu, fixed_order_linear

H100_SMS = 132


def test_rule_splits_narrow_outputs_and_keeps_filling_ones_whole() -> None:
    # Qwen3-8B's decode projections (q/k/v side by side, o, down) and an LM head fill the GPU: never split
    for n, k in ((6144, 4096), (4096, 4096), (4096, 12288), (151936, 4096)):
        assert gemv_split.split_count(n, k, H100_SMS) == 1
    # DeepSeek-V4's query / latent down-projections, a router, the hyper-connection mixer (24 rows, padded)
    assert gemv_split.split_count(1024, 4096, H100_SMS) == 4
    assert gemv_split.split_count(512, 4096, H100_SMS) == 8
    assert gemv_split.split_count(256, 4096, H100_SMS) == 8  # slices stop at two 256-column steps
    assert gemv_split.split_count(32, 16384, H100_SMS) == gemv_split.MAX_SPLIT
    assert gemv_split.split_count(1024, 4096, None) == 1  # no SM count (CPU): no split
    assert gemv_split.split_count(1024, 600, H100_SMS) == 1  # too short to cut
    # slices are whole 256-column steps and cover K
    assert gemv_split.slice_columns(4096, 4) == 1024
    assert gemv_split.slice_columns(1300, 2) == 768


def test_split_launch_matches_f_linear_and_sums_slices() -> None:
    g = torch.Generator().manual_seed(0)
    x = torch.randn(5, 1300, generator=g)  # K cut into 768 + 532 columns, the last step partial
    ws = [torch.randn(n, 1300, generator=g) for n in (32, 16, 48)]
    assert gemv_split.split_count(96, 1300, H100_SMS) == 2
    split = multi_linear_triton(x, ws, sms=H100_SMS)
    whole = multi_linear_triton(x, ws)  # no SM count: the unsplit launch
    for out, w in zip(split, ws, strict=True):
        torch.testing.assert_close(out, F.linear(x, w), rtol=1e-5, atol=1e-4)
    # the slices are summed apart from each other: in fp32 the last bits differ from the one-chain sum
    assert not torch.equal(torch.cat(split, 1), torch.cat(whole, 1))
    forced = multi_linear_triton(x, ws, split=4)  # a sweep's forced count (one slice empty)
    torch.testing.assert_close(torch.cat(forced, 1), torch.cat(whole, 1), rtol=1e-5, atol=1e-4)


@pytest.mark.parametrize(("lo", "hi"), [(1, 16), (17, 32), (33, 64)])
def test_a_split_row_does_not_depend_on_the_row_count(lo: int, hi: int) -> None:
    g = torch.Generator().manual_seed(hi)
    x = torch.randn(hi, 1024, generator=g)
    w = torch.randn(64, 1024, generator=g)
    (full,) = multi_linear_triton(x, [w], sms=H100_SMS)
    for m in sorted({lo, (lo + hi) // 2, hi - 1}):
        (part,) = multi_linear_triton(x[:m], [w], sms=H100_SMS)
        assert torch.equal(part, full[:m])


def test_split_count_is_the_same_for_every_row_count(monkeypatch) -> None:
    """The split must come from the shape and SM count alone: a split chosen by rows would give a verify row
    (several rows a launch) other bits than the decode row (one)."""
    seen: list[int] = []
    real = gemv_split.split_buffers
    monkeypatch.setattr(gemv_split, "split_buffers", lambda split, *a: seen.append(split) or real(split, *a))
    g = torch.Generator().manual_seed(3)
    w = torch.randn(32, 2048, generator=g)
    counts = (1, 9, 16, 20, 40, 64)
    for m in counts:
        multi_linear_triton(torch.randn(m, 2048, generator=g), [w], sms=H100_SMS)
    assert seen == [gemv_split.split_count(32, 2048, H100_SMS)] * len(counts) and seen[0] > 1


def test_filling_shape_keeps_the_unsplit_launch(monkeypatch) -> None:
    g = torch.Generator().manual_seed(5)
    x = torch.randn(3, 512, generator=g)
    w = torch.randn(gemv_split.FILLING_COLUMNS, 512, generator=g)
    monkeypatch.setattr(gemv_split, "split_buffers", lambda *a: pytest.fail("a filling shape was split"))
    (out,) = multi_linear_triton(x, [w], sms=H100_SMS)
    (before,) = multi_linear_triton(x, [w])  # what the launch computed before split-K existed
    assert torch.equal(out, before)


def test_fixed_order_rows_of_a_split_shape_match_at_every_call_size(monkeypatch) -> None:
    """The canonical linear of a split shape keeps the GEMV (never the unsplit prefill tile), so a decode row
    equals the same row inside a burst of prefill rows. fp32 rows past 64 take ``FP32_TILE``'s 32-wide K steps,
    which the GPU's per-element FMA chain makes no different (tests/perf/check_prefill_kernels.py checks the
    bits there); the interpreter's dot sums a whole K step at once, so here the tile keeps the decode's K step."""
    monkeypatch.setattr(gemv_split, "device_sms", lambda x: H100_SMS)
    monkeypatch.setattr(exact_gemm, "FP32_TILE", (64, gemv_split.SLICE_ALIGN, 1))
    monkeypatch.setattr(
        gemm_prefill, "prefill_linear", lambda *a: pytest.fail("split shape took the prefill tile")
    )
    g = torch.Generator().manual_seed(7)
    x = torch.randn(PREFILL_ROWS + 5, 1024, generator=g)
    ws = [torch.randn(64, 1024, generator=g)]  # a multiple of the prefill tile's BN
    big = fixed_order_linear(x, ws)[0]
    torch.testing.assert_close(big, F.linear(x, ws[0]), rtol=1e-5, atol=1e-4)
    for rows in (slice(0, 1), slice(40, 41), slice(PREFILL_ROWS, PREFILL_ROWS + 5)):
        assert torch.equal(fixed_order_linear(x[rows].contiguous(), ws)[0], big[rows])
    # from 256 rows on the calls take a 128-wide output tile (dgpp.nn.exact.gemm.WIDE_BN): the same slices
    ws = [torch.randn(128, 1024, generator=g)]
    x = torch.randn(WIDE_ROWS + 3, 1024, generator=g)
    wide = fixed_order_linear(x, ws)[0]
    assert torch.equal(fixed_order_linear(x[-2:].contiguous(), ws)[0], wide[-2:])


def test_policy_switch_turns_the_split_off(monkeypatch) -> None:
    from types import SimpleNamespace

    from dgpp.policy import overriding

    monkeypatch.setattr(gemv_split, "device_sm_count", lambda device: H100_SMS)
    gpu_rows = SimpleNamespace(is_cuda=True, device=torch.device("cuda:0"))  # stands in for a CUDA tensor
    assert gemv_split.device_sms(gpu_rows) == H100_SMS
    with overriding(gemv_split=False):
        assert gemv_split.device_sms(gpu_rows) is None


def test_gate_up_split_matches_the_reference_and_keeps_row_bits(monkeypatch) -> None:
    """The shared experts' narrow gate/up pairs (1024..2048 wide) split by their intermediate width."""
    g = torch.Generator().manual_seed(9)
    x = torch.randn(40, 1024, generator=g)
    wg, wu = (torch.randn(64, 1024, generator=g) / 8 for _ in range(2))
    assert gemv_split.split_count(64, 1024, H100_SMS) == 2
    split = gate_up_silu_triton(x, wg, wu, sms=H100_SMS)
    torch.testing.assert_close(split, gate_up_silu_ref(x, wg, wu), rtol=1e-4, atol=1e-4)
    assert not torch.equal(split, gate_up_silu_triton(x, wg, wu))  # the unsplit launch sums K in one chain
    for rows in (slice(0, 1), slice(0, 9), slice(16, 20)):
        assert torch.equal(gate_up_silu_triton(x[rows], wg, wu, sms=H100_SMS), split[rows])
    # the fixed-order call of prefill size keeps the split GEMV, so its rows are the decode rows' bits
    monkeypatch.setattr(gemv_split, "device_sms", lambda x: H100_SMS)
    monkeypatch.setattr(
        gemm_prefill, "prefill_gate_up_silu", lambda *a: pytest.fail("split pair took the prefill tile")
    )
    wg, wu = (
        torch.randn(128, 1024, generator=g) / 8 for _ in range(2)
    )  # a multiple of the prefill tile's BN
    big_x = torch.randn(PREFILL_ROWS + 2, 1024, generator=g)
    big = fixed_order_gate_up_silu(big_x, wg, wu)
    assert torch.equal(fixed_order_gate_up_silu(big_x[5:6].contiguous(), wg, wu), big[5:6])


def test_arrival_counters_are_shared_and_never_first_allocated_in_a_capture(monkeypatch):
    """The dense and packed split launches share one zeroed counter workspace per device, grown when a launch
    needs more; inside a CUDA-graph capture a missing workspace is an error naming the launch (its zero fill would
    not run), never a silent unsplit launch whose rows would differ in the last bit."""
    from dgpp.kernels import split_partials

    monkeypatch.setattr(split_partials, "_COUNTERS", {})
    cpu = torch.device("cpu")
    first = split_partials.arrival_counters(cpu, 10, "dense split-K GEMV")
    assert split_partials.arrival_counters(cpu, 5, "packed split-K GEMV") is first
    grown = split_partials.arrival_counters(cpu, split_partials.MIN_COUNTERS + 1, "packed split-K GEMV")
    assert grown.numel() == split_partials.MIN_COUNTERS + 1 and int(grown.abs().sum()) == 0
    monkeypatch.setattr(torch.cuda, "is_current_stream_capturing", lambda: True)
    with pytest.raises(RuntimeError, match="packed split-K GEMV: split-K arrival counters"):
        split_partials.arrival_counters(torch.device("cuda", 0), 10, "packed split-K GEMV")


def test_fp32_rows_past_the_decode_sizes_take_the_wide_fma_tile(monkeypatch) -> None:
    """An fp32 router over a prompt (more rows than the decode GEMV's 64) launches 64-wide output tiles over
    32-wide K steps, and its values are the product's."""
    monkeypatch.setattr(gemv_split, "device_sms", lambda x: H100_SMS)
    seen = []
    real = exact_gemm.multi_linear_triton

    def spy(x, weights, **kw):
        seen.append(kw.get("tile"))
        return real(x, weights, **kw)

    monkeypatch.setattr(exact_gemm, "multi_linear_triton", spy)
    g = torch.Generator().manual_seed(8)
    x = torch.randn(70, 1024, generator=g)
    ws = [torch.randn(64, 1024, generator=g)]
    out = fixed_order_linear(x, ws)[0]
    assert seen == [exact_gemm.FP32_TILE]
    torch.testing.assert_close(out, F.linear(x, ws[0]), rtol=1e-5, atol=1e-4)
    fixed_order_linear(x[:64].contiguous(), ws)
    assert seen[-1] is None  # decode sizes keep the GEMV's own tile
