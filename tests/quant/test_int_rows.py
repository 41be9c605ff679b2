"""The row-exact GEMM for int32-word formats (int4/int8 groups of 64 with their fixed zero, NF4I8's codebook,
GPTQ / AutoRound int4 with zero points) under the Triton interpreter (fp32): equal to the torch
decode-then-multiply reference, a row alone == the same row among 1..300 rows bit for bit, and that check shown
to fail when the K order is made to depend on the row count; x read in step order (``x_by_position``) gives the
bits of x read column by column."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from dgpp.quant.codebook import NF4Codebook
from dgpp.quant.codecs import pack_int32
from dgpp.quant.encode import encode
from dgpp.quant.intq import GPTQ, IntPacked
from dgpp.quant.kernels.int_rows_launch import IntRowsTile, int_rows_applies, int_rows_linear
from dgpp.quant.kernels.x_step_order import x_by_position

TILE = IntRowsTile(bn=32, bk=64)
SPLIT = IntRowsTile(bn=32, bk=64, split_k=2)
FORMATS = [
    IntPacked(bits=4, group=64),
    IntPacked(bits=8, group=64),
    NF4Codebook(group=64),
    GPTQ(bits=4, group=64),
    GPTQ(bits=4, group=64, zero_offset=0),
]
IDS = ["int4-g64", "int8-g64", "nf4i8", "gptq-int4", "gptq_v2-int4"]
ROW_COUNTS = (1, 2, 16, 17, 64, 65, 300)
SAMPLED_ROWS = (0, 1, 15, 16, 17, 63, 64, 65, 130, 299)


def packed_weights(fmt, n: int, k: int, seed: int) -> tuple[dict[str, torch.Tensor], torch.Tensor]:
    """Packed tensors (GPTQ with random asymmetric zero points, NF4I8 with random indices) and the fp32 decode."""
    gen = torch.Generator().manual_seed(seed)
    if isinstance(fmt, NF4Codebook):
        index = torch.randint(0, 16, (n, k), generator=gen)
        scale = (torch.rand(n, k // fmt.group, generator=gen) * 1e-3 + 1e-4).to(torch.bfloat16)
        tensors = {"weight_indices": pack_int32(index, 4, dim=1), "weight_scale": scale}
    else:
        tensors = encode(fmt, torch.randn(n, k, generator=gen) * 0.05)
        if isinstance(fmt, GPTQ):
            zeros = torch.randint(0, 1 << fmt.bits, (k // fmt.group, n), generator=gen)
            tensors["qzeros"] = pack_int32(zeros, fmt.bits, dim=1)
        tensors = fmt.prepare(tensors, (n, k))
    return tensors, fmt.decode(tensors, (n, k), torch.float32)


def assert_rows_exact(fmt, tensors, x: torch.Tensor, shape, launch=None) -> None:
    launch = launch or (lambda rows: int_rows_linear(fmt, tensors, rows, shape, TILE))
    alone = {i: launch(x[i : i + 1])[0] for i in SAMPLED_ROWS}
    for m in ROW_COUNTS:
        got = launch(x[:m])
        bad = [i for i in SAMPLED_ROWS if i < m and not torch.equal(got[i], alone[i])]
        assert not bad, f"{fmt.name}: rows {bad} of a {m}-row call differ from the row alone"


@pytest.mark.parametrize("tile", [TILE, SPLIT], ids=["whole-k", "split-k"])
@pytest.mark.parametrize("fmt", FORMATS, ids=IDS)
def test_matches_reference(fmt, tile):
    n, k = 72, 256
    tensors, dense = packed_weights(fmt, n, k, seed=3)
    x = torch.randn(70, k)
    got = int_rows_linear(fmt, tensors, x, (n, k), tile)
    assert got.shape == (70, n)
    torch.testing.assert_close(got, x @ dense.t(), rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize(
    ("fmt", "tile", "mode"),
    [
        (IntPacked(bits=4, group=64), IntRowsTile(bn=32, bk=64), "tile"),
        (IntPacked(bits=4, group=32), IntRowsTile(bn=32, bk=128), "groups"),
        (GPTQ(bits=4, group=32), IntRowsTile(bn=32, bk=128), "groups"),
        (NF4Codebook(group=32), IntRowsTile(bn=32, bk=128), "groups"),
        (IntPacked(bits=8, group=48), IntRowsTile(bn=32, bk=64), "gather"),
        (GPTQ(bits=4, group=48), IntRowsTile(bn=32, bk=64), "gather"),
    ],
    ids=["int4-tile", "int4-groups", "gptq-groups", "nf4i8-groups", "int8-gather", "gptq-gather"],
)
def test_each_scale_load_matches_reference(fmt, tile, mode):
    """Scales loaded once per tile, once per group inside a tile, and per weight (groups straddling tiles)."""
    from dgpp.quant.kernels.int_rows import SCALES_GATHER, SCALES_GROUPS, SCALES_TILE
    from dgpp.quant.kernels.int_rows_launch import int_rows_operands, scale_mode

    n, k = 40, 384
    tensors, dense = packed_weights(fmt, n, k, seed=7)
    want = {"tile": SCALES_TILE, "groups": SCALES_GROUPS, "gather": SCALES_GATHER}[mode]
    assert scale_mode(int_rows_operands(fmt, tensors, (n, k))[1], tile.bk, k) == want
    x = torch.randn(33, k)
    got = int_rows_linear(fmt, tensors, x, (n, k), tile)
    torch.testing.assert_close(got, x @ dense.t(), rtol=1e-5, atol=1e-5)
    assert torch.equal(got[20], int_rows_linear(fmt, tensors, x[20:21], (n, k), tile)[0])


@pytest.mark.parametrize("fmt", FORMATS, ids=IDS)
def test_one_dot_over_the_row_blocks_gives_the_block_dots_bits(fmt):
    """``one_dot``: a program's row blocks in one dot of up to 64 rows (three blocks take a 64-row dot too), whole
    and split K, equal to the 16-row dots bit for bit (the same K steps), so a row among them == the row alone."""
    n, k = 72, 256
    tensors, dense = packed_weights(fmt, n, k, seed=9)
    x = torch.randn(300, k)
    for base in (TILE, SPLIT):
        wide = dataclasses.replace(base, one_dot=True)
        for m in (40, 300):
            want = int_rows_linear(fmt, tensors, x[:m], (n, k), base)
            got = int_rows_linear(fmt, tensors, x[:m], (n, k), wide)
            assert torch.equal(got, want), f"{m} rows, split {base.split_k}"
            assert torch.equal(got[m - 1], int_rows_linear(fmt, tensors, x[m - 1 : m], (n, k), wide)[0])
        torch.testing.assert_close(got, x @ dense.t(), rtol=1e-5, atol=1e-5)


def test_the_policy_switch_sets_the_default_tiles_one_dot(monkeypatch):
    """The default tile takes one dot (``int_rows_one_dot``, on); ``DGPP_INT_ROWS_ONE_DOT=0`` turns it off."""
    from dgpp.policy import ExecPolicy, overriding, with_environment
    from dgpp.quant.kernels.int_rows_launch import default_int_rows_tile

    cpu = torch.device("cpu")
    assert default_int_rows_tile(64, 256, cpu).one_dot
    monkeypatch.setenv("DGPP_INT_ROWS_ONE_DOT", "0")
    assert not with_environment(ExecPolicy()).int_rows_one_dot
    with overriding(int_rows_one_dot=False):
        assert not default_int_rows_tile(64, 256, cpu).one_dot


def _one_dot_rounding_otherwise(monkeypatch) -> list[bool]:
    """A device on which one dot over the row blocks rounds unlike the 16-row dots: every one-dot launch's output
    moves by one ulp. Returns the ONE_DOT of each launch, in order."""
    from dgpp.quant.kernels import int_rows, int_rows_probe

    monkeypatch.setattr(int_rows_probe, "_ONE_DOT", {})
    kernel, seen = int_rows.int_rows_kernel, []

    class Launcher:
        def __getitem__(self, grid):
            def launch(*args, **kwargs):
                kernel[grid](*args, **kwargs)
                seen.append(kwargs["ONE_DOT"])
                if kwargs["ONE_DOT"]:
                    args[7].copy_(torch.nextafter(args[7], torch.full_like(args[7], float("inf"))))

            return launch

    monkeypatch.setattr(int_rows, "int_rows_kernel", Launcher())
    return seen


def test_one_dot_is_taken_only_where_the_probe_finds_the_16_row_bits(monkeypatch):
    """The probe compares one dot with the 16-row dots on the layer's weights before a call takes it: on a device
    where they round alike the call takes one dot, on one where they do not it keeps the 16-row dots' bits (this
    fails if the probe is removed)."""
    from dgpp.quant.kernels import int_rows_probe

    fmt = FORMATS[1]
    tensors, dense = packed_weights(fmt, 40, 256, seed=2)
    x = torch.randn(20, 256)
    wide = dataclasses.replace(TILE, one_dot=True)
    want = int_rows_linear(fmt, tensors, x, (40, 256), TILE)

    monkeypatch.setattr(int_rows_probe, "_ONE_DOT", {})
    assert torch.equal(int_rows_linear(fmt, tensors, x, (40, 256), wide), want)
    assert list(int_rows_probe._ONE_DOT.values()) == [True]

    seen = _one_dot_rounding_otherwise(monkeypatch)
    got = int_rows_linear(fmt, tensors, x, (40, 256), wide)
    assert torch.equal(got, want)
    assert True in seen and seen[-1] is False  # probed with one dot, then ran the 16-row dots
    assert list(int_rows_probe._ONE_DOT.values()) == [False]
    torch.testing.assert_close(got, x @ dense.t(), rtol=1e-5, atol=1e-5)


def test_the_one_dot_probe_times_full_64_row_programs(monkeypatch):
    """The probe checks bits at 80 and 24 rows but times both forms at 64 rows, the batch the one dot is for (an
    80-row call's partial program would charge one dot for 48 empty rows); the faster form at 64 rows wins."""
    from dgpp.quant.kernels import int_rows_probe

    monkeypatch.setattr(int_rows_probe, "_ONE_DOT", {})
    launched: list[tuple[int, bool]] = []

    def launch(rows: torch.Tensor, one_dot: bool) -> torch.Tensor:
        launched.append((rows.shape[0], one_dot))
        return rows * 2.0  # the same bits either way

    # one dot is faster at 64 rows and slower at 80 (a row count the probe must not time fails on the look-up)
    times = {(64, True): 1.0, (64, False): 2.0, (80, True): 3.0, (80, False): 0.5}

    def timer(run, device) -> float:
        first = len(launched)
        run()
        return times[launched[first]]

    assert int_rows_probe.one_dot_exact(
        ("fmt", "shape"), launch, 32, torch.float32, torch.device("cpu"), timer
    )
    assert [rows for rows, _ in launched[-2:]] == [64, 64]


@pytest.mark.parametrize("fmt", [FORMATS[0], FORMATS[3]], ids=["int4-g64", "gptq-int4"])
def test_k_not_a_multiple_of_the_tile(fmt):
    """K = 320 in tiles of 128 (and slices of 256): the last tile's words and groups past K are masked."""
    n, k = 40, 320
    tensors, dense = packed_weights(fmt, n, k, seed=8)
    x = torch.randn(18, k)
    for tile in (IntRowsTile(bn=32, bk=128), IntRowsTile(bn=32, bk=128, split_k=2)):
        torch.testing.assert_close(
            int_rows_linear(fmt, tensors, x, (n, k), tile), x @ dense.t(), rtol=1e-5, atol=1e-5
        )


@pytest.mark.parametrize("per_word", [2, 4, 8])
def test_x_by_position_writes_each_step_position_by_position(per_word):
    """Per ``bk`` columns (zero padded to whole steps): the columns of word position 0, then position 1, ..."""
    k, bk = 320, 128
    x = torch.randn(3, 2 * k)[:, :k]  # a row stride wider than K
    got = x_by_position(x, bk, per_word)
    padded = torch.nn.functional.pad(x, (0, -k % bk))
    want = padded.view(3, -1, bk // per_word, per_word).transpose(2, 3).reshape(3, -1)
    assert got.shape == (3, 384) and torch.equal(got, want)
    assert torch.equal(got[:, bk // per_word], x[:, 1])  # position 1 of the step's first word


@pytest.mark.parametrize("fmt", FORMATS, ids=IDS)
def test_x_in_step_order_gives_the_column_reads_bits(fmt):
    """The same values in the same dots: every row count, whole and split K, a ragged K, both x reads."""
    n, k = 40, 320
    tensors, dense = packed_weights(fmt, n, k, seed=6)
    x = torch.randn(70, k)
    for base in (IntRowsTile(bn=32, bk=128), IntRowsTile(bn=32, bk=128, split_k=2)):
        columns = dataclasses.replace(base, x_in_step_order=0)
        ordered = dataclasses.replace(base, x_in_step_order=1)
        for m in (1, 17, 70):
            want = int_rows_linear(fmt, tensors, x[:m], (n, k), columns)
            assert torch.equal(int_rows_linear(fmt, tensors, x[:m], (n, k), ordered), want)
        torch.testing.assert_close(want, x @ dense.t(), rtol=1e-5, atol=1e-5)


def test_multi_linear_writes_x_in_step_order_once(monkeypatch):
    """q/k/v or gate/up on one x: the step-order copy is written once and serves every weight, same results."""
    from dgpp.quant.kernels import int_rows_launch

    fmt, k = IntPacked(bits=4, group=64), 256
    sets = [packed_weights(fmt, n, k, seed=10 + n)[0] for n in (40, 24, 24)]
    shapes = [(40, k), (24, k), (24, k)]
    x = torch.randn(20, k)
    want = [int_rows_linear(fmt, t, x, s, TILE) for t, s in zip(sets, shapes, strict=True)]
    writes = []

    def counted(*args):
        writes.append(args[1:])
        return x_by_position(*args)

    monkeypatch.setattr(int_rows_launch, "x_by_position", counted)
    got = int_rows_launch.int_rows_multi_linear(fmt, sets, x, shapes, TILE)
    assert len(writes) == 1
    assert all(torch.equal(a, b) for a, b in zip(got, want, strict=True))


def test_act_order_g_idx_matches_reference():
    fmt, n, k = GPTQ(bits=4, group=64), 40, 256
    g_idx = torch.randperm(k, generator=torch.Generator().manual_seed(5)) // 64
    from dgpp.quant.encode import encode_gptq

    tensors = fmt.prepare(encode_gptq(torch.randn(n, k) * 0.05, fmt, g_idx), (n, k))
    assert "g_idx" in tensors
    x = torch.randn(20, k)
    want = x @ fmt.decode(tensors, (n, k), torch.float32).t()
    torch.testing.assert_close(int_rows_linear(fmt, tensors, x, (n, k), TILE), want, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("tile", [TILE, SPLIT], ids=["whole-k", "split-k"])
@pytest.mark.parametrize("fmt", FORMATS, ids=IDS)
def test_row_alone_equals_row_among_1_to_300(fmt, tile):
    n, k = 40, 256
    tensors, _ = packed_weights(fmt, n, k, seed=9)
    assert_rows_exact(
        fmt, tensors, torch.randn(300, k), (n, k), lambda r: int_rows_linear(fmt, tensors, r, (n, k), tile)
    )


@pytest.mark.parametrize("fmt", [FORMATS[0], FORMATS[2], FORMATS[3]], ids=["int4-g64", "nf4i8", "gptq-int4"])
def test_check_fails_when_k_order_depends_on_rows(fmt):
    """K split in two above 16 rows (an M-dependent K order): still the right products, but rows change bits."""
    n, k = 40, 256
    tensors, dense = packed_weights(fmt, n, k, seed=4)
    x = torch.randn(300, k)

    def m_dependent(rows: torch.Tensor) -> torch.Tensor:
        return int_rows_linear(fmt, tensors, rows, (n, k), SPLIT if rows.shape[0] > 16 else TILE)

    torch.testing.assert_close(m_dependent(x), x @ dense.t(), rtol=1e-5, atol=1e-5)
    with pytest.raises(AssertionError, match="differ from the row alone"):
        assert_rows_exact(fmt, tensors, x, (n, k), m_dependent)


def test_applies_only_on_gpu_to_word_formats():
    fmt = IntPacked(bits=4, group=64)
    tensors, _ = packed_weights(fmt, 32, 128, seed=0)
    x = torch.randn(3, 128)
    assert not int_rows_applies(fmt, [tensors], x, on_gpu=False)
    assert int_rows_applies(fmt, [tensors], x, on_gpu=True)
    from dgpp.quant.fp8 import FP8Block

    assert not int_rows_applies(FP8Block(), [tensors], x, on_gpu=True)


@pytest.mark.parametrize("fmt", [FORMATS[1], FORMATS[3]], ids=["int8-g64", "gptq-int4"])
def test_canonical_rows_take_one_row_exact_launch(fmt, monkeypatch):
    """A layer's decode rows (64 of a step) take the int GEMM in one launch per weight, rows equal alone."""
    from dgpp.quant import linear

    n, k = 48, 128
    tensors, dense = packed_weights(fmt, n, k, seed=2)
    calls = []
    real = linear.int_rows_multi_linear
    monkeypatch.setattr(
        linear, "int_rows_multi_linear", lambda *a, **kw: calls.append(a[2].shape[0]) or real(*a, **kw)
    )
    x = torch.randn(64, k)
    got = linear.decode_rows(fmt, [tensors], x, [(n, k)])[0]
    assert calls == [64]
    torch.testing.assert_close(got, x @ dense.t(), rtol=1e-5, atol=1e-5)
    assert torch.equal(got[40], linear.decode_rows(fmt, [tensors], x[40:41], [(n, k)])[0][0])


def test_default_tile_splits_k_by_shape_and_device_only(monkeypatch):
    from types import SimpleNamespace

    from dgpp.quant.kernels import int_rows_launch

    cuda = torch.device("cuda")
    assert int_rows_launch.default_int_rows_tile(6144, 6144, torch.device("cpu")).split_k == 1
    monkeypatch.setattr(int_rows_launch, "interpreting", lambda: False)
    monkeypatch.setattr(
        torch.cuda, "get_device_properties", lambda d: SimpleNamespace(multi_processor_count=132)
    )
    assert int_rows_launch.default_int_rows_tile(6144, 6144, cuda).split_k == 4  # 96 tiles -> 384 programs
    assert int_rows_launch.default_int_rows_tile(24576, 6144, cuda).split_k == 1  # 384 tiles already
    assert int_rows_launch.default_int_rows_tile(6144, 768, cuda).split_k == 1  # K too short to slice
