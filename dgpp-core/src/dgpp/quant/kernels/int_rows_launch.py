"""Host side of the row-exact GEMM for int32-word formats (``int_rows``): which weights it takes, its tile, and
the launch. Canonical rows (decode, speculative verify) of int4/int8 ``pack-quantized``, NF4I8 and GPTQ /
AutoRound weights take it at every row count, so a row's bits never depend on how many rows share the step.
"""

from __future__ import annotations

import dataclasses

import torch

from dgpp.kernels._triton import next_pow2
from dgpp.policy import current
from dgpp.quant.codebook import NF4I8_LEVELS, NF4Codebook
from dgpp.quant.format import QuantFormat, Shape, cdiv
from dgpp.quant.intq import GPTQ, IntPacked
from dgpp.quant.kernels.int_rows_probe import one_dot_exact
from dgpp.quant.kernels.operands import interpreting
from dgpp.quant.kernels.x_step_order import x_by_position

MAX_BLOCKS = 4  # 16-row blocks per program: a tile's words are decoded once for up to 64 rows


@dataclasses.dataclass(frozen=True)
class IntRowsTile:
    """BN output columns per program, BK K columns per decoded tile (at least 16 words: the dot's K), K slices
    (fixed by the shape, never by M). From ``x_in_step_order`` row blocks a program up (0: never; None: the
    codes' default, ``x_step_order_blocks``), x is first written in step order (``x_by_position``) so each dot's x
    is one contiguous load: the same values in the same dots, so the choice changes no bits. ``one_dot``: a
    program's row blocks meet each decoded weight tile in one dot of up to 64 rows instead of one dot per 16 rows
    (the same K steps; neither Hopper's wgmma nor fp32's FMA dots let the dot's row count enter a column's
    sums)."""

    bn: int = 64
    bk: int = 128
    split_k: int = 1
    warps: int = 4
    stages: int = 3
    x_in_step_order: int | None = None
    one_dot: bool = False


def x_step_order_blocks(tile: IntRowsTile, per_word: int) -> int:
    """Row blocks a program from which x is read in step order: from one for 4-bit codes (a word position's x
    columns lie 16 bytes apart, and the pre-pass pays for itself even at one row), from two for 8-bit codes
    (one row reads its 8-byte-apart columns faster than it runs the pre-pass); docs/benchmarks.md has the times."""
    if tile.x_in_step_order is not None:
        return tile.x_in_step_order
    return 1 if per_word >= 8 else 2


def default_int_rows_tile(n: int, k: int, device: torch.device) -> IntRowsTile:
    """64 columns by 128-wide K tiles; on a GPU, K split in 2..8 slices (each at least 4 tiles) until the launch
    has 1.5 programs per SM. The split follows the shape and the device only, never the row count."""
    tile = IntRowsTile(one_dot=current().int_rows_one_dot)
    if device.type != "cuda" or interpreting():
        return tile
    sms = torch.cuda.get_device_properties(device).multi_processor_count
    tiles, split = cdiv(n, tile.bn), 1
    while split < 8 and tiles * split < 1.5 * sms and k // (2 * split) >= 4 * tile.bk:
        split *= 2
    return dataclasses.replace(tile, split_k=split)


def int_rows_supported(fmt: QuantFormat) -> bool:
    """int 2/4/8-bit ``pack-quantized`` (any group, per-row included), NF4I8 and GPTQ / AutoRound."""
    return isinstance(fmt, (IntPacked, NF4Codebook, GPTQ))


def _tensors_ok(fmt: QuantFormat, t: dict[str, torch.Tensor], device: torch.device) -> bool:
    names = {"weight_packed", "weight_scale"} if isinstance(fmt, IntPacked) else set()
    if isinstance(fmt, NF4Codebook):
        names = {"weight_indices", "weight_scale"}
    if isinstance(fmt, GPTQ):
        names = {"qweight", "qzeros", "scales"} | ({"g_idx"} & set(t))
    return all(n in t and t[n].is_contiguous() and t[n].device == device for n in names)


def int_rows_applies(
    fmt: QuantFormat, tensor_sets: list[dict[str, torch.Tensor]], x: torch.Tensor, on_gpu: bool
) -> bool:
    """True when the row-exact int GEMM takes these weights for ``x`` (a GPU: the CPU keeps the torch decode)."""
    return (
        on_gpu
        and current().packed_decode_gemv
        and int_rows_supported(fmt)
        and x.dim() == 2
        and x.dtype in (torch.bfloat16, torch.float16, torch.float32)
        and all(_tensors_ok(fmt, t, x.device) for t in tensor_sets)
    )


_LEVELS: dict[torch.device, torch.Tensor] = {}


def _levels(device: torch.device) -> torch.Tensor:
    if device not in _LEVELS:
        _LEVELS[device] = torch.tensor(NF4I8_LEVELS, dtype=torch.float32, device=device)
    return _LEVELS[device]


def int_rows_operands(
    fmt: QuantFormat, t: dict[str, torch.Tensor], shape: Shape
) -> tuple[list[torch.Tensor], dict[str, object]]:
    """(pointer tensors: words, scales, zeros, g_idx, levels; strides and constexprs) for ``fmt``."""
    n, k = shape
    if isinstance(fmt, GPTQ):
        w, s, z = t["qweight"], t["scales"], t["qzeros"]
        gidx = t.get("g_idx")
        ptrs = [w, s, z, gidx if gidx is not None else w, s]
        strides = dict(stride_wn=1, stride_wk=n, stride_sn=1, stride_sk=n, stride_zg=z.stride(0))
        consts = dict(
            FMT=2,
            BITS=fmt.bits,
            GROUP=fmt.group_size(shape),
            ZERO_OFFSET=fmt.zero_offset,
            HAS_GIDX=gidx is not None,
        )
        return ptrs, {**strides, **consts}
    if isinstance(fmt, NF4Codebook):
        w, bits, group, kind, zero = t["weight_indices"], 4, fmt.group, 1, 0
    else:
        assert isinstance(fmt, IntPacked)
        w, bits, group, kind = t["weight_packed"], fmt.bits, fmt.group_size(shape), 0
        zero = 1 << (fmt.bits - 1)
    s = t["weight_scale"]
    ptrs = [w, s, w, w, _levels(w.device)]
    strides = dict(stride_wn=w.stride(0), stride_wk=1, stride_sn=s.stride(0), stride_sk=1, stride_zg=0)
    return ptrs, {
        **strides,
        "FMT": kind,
        "BITS": bits,
        "GROUP": group,
        "ZERO_OFFSET": zero,
        "HAS_GIDX": False,
    }


def int4_bf16_applies(
    args: dict[str, object], scales: torch.Tensor, dot_fp32: bool, dot_dtype: object
) -> bool:
    """``pack-quantized`` int words that ``takes_int4_ptx`` accepts: ``code - 8`` is exact in bf16, so the kernel
    decodes it in inline PTX and multiplies in bf16 (one rounding, as the fp32 decode rounds)."""
    from dgpp.quant.kernels.int4_asm import takes_int4_ptx

    return args["FMT"] == 0 and takes_int4_ptx(
        int(args["BITS"]),  # type: ignore[call-overload]
        int(args["ZERO_OFFSET"]),  # type: ignore[call-overload]
        scales.dtype,
        dot_dtype,
        dot_fp32,
    )


def scale_mode(args: dict[str, object], bk: int, k: int) -> int:
    """How a tile's scales load: once per tile when it sits inside one group, once per group when it holds whole
    groups, else per weight (act-order ``g_idx``, or groups that straddle tiles)."""
    from dgpp.quant.kernels.int_rows import SCALES_GATHER, SCALES_GROUPS, SCALES_TILE

    group, per_word = int(args["GROUP"]), 32 // int(args["BITS"])  # type: ignore[call-overload]
    if args["HAS_GIDX"]:
        return SCALES_GATHER
    if group % bk == 0 or group >= k:
        return SCALES_TILE
    if bk % group == 0 and group % per_word == 0:
        return SCALES_GROUPS
    return SCALES_GATHER


def int_rows_linear(
    fmt: QuantFormat,
    tensors: dict[str, torch.Tensor],
    x: torch.Tensor,
    shape: Shape,
    tile: IntRowsTile | None = None,
    x_orders: dict[tuple[int, int], torch.Tensor] | None = None,
    probe: bool = True,
) -> torch.Tensor:
    """``x [M, K] @ W^T`` for any M in one launch (plus the pass that sums K slices and rounds, when K is split):
    each block of 16 rows decodes the packed tiles it multiplies; the row bits do not depend on M.
    ``x_orders``: x in step order by (BK, codes a word), shared by calls on the same x so it is written once.
    A tile's ``one_dot`` is taken where ``int_rows_probe.one_dot_exact`` found it gives the 16-row dots' bits on
    this device (``probe=False``: as the tile says, the probe's own launches)."""
    import triton.language as tl

    from dgpp.quant.kernels.int_rows import ROWS, int_rows_finish, int_rows_kernel

    n, k = shape
    tile = tile or default_int_rows_tile(n, k, x.device)
    ptrs, args = int_rows_operands(fmt, tensors, shape)
    per_word = 32 // int(args["BITS"])  # type: ignore[call-overload]
    if not interpreting():  # a tensor-core dot needs K >= 16: at least 16 words per tile
        tile = dataclasses.replace(tile, bk=max(tile.bk, 16 * per_word))
    x = x.contiguous()
    m = x.shape[0]
    out = torch.empty(m, n, dtype=x.dtype, device=x.device)
    if m == 0:
        return out
    k_per_split = cdiv(cdiv(k, tile.split_k), tile.bk) * tile.bk
    split = cdiv(k, k_per_split)
    # a K slice's sums go to its plane of the workspace; one slice stores the output directly
    ws = torch.empty(split if split > 1 else 0, m, n, dtype=torch.float32, device=x.device)
    dot_fp32 = x.dtype == torch.float32 or interpreting()
    dot_dtype = tl.float32 if dot_fp32 else {torch.bfloat16: tl.bfloat16, torch.float16: tl.float16}[x.dtype]
    blocks = min(MAX_BLOCKS, next_pow2(cdiv(m, ROWS)))  # a power of two: one dot's rows are an arange
    one_dot = tile.one_dot and blocks > 1
    if one_dot and probe:
        one_dot = one_dot_exact(
            (fmt, shape, tile, x.dtype, x.device),
            lambda rows, one: int_rows_linear(
                fmt, tensors, rows, shape, dataclasses.replace(tile, one_dot=one), probe=False
            ),
            k,
            x.dtype,
            x.device,
        )
    int4_bf16 = int4_bf16_applies(args, ptrs[1], dot_fp32, dot_dtype)
    step_order = 0 < x_step_order_blocks(tile, per_word) <= blocks
    x_read = x
    if step_order:
        orders = {} if x_orders is None else x_orders
        if (tile.bk, per_word) not in orders:
            orders[tile.bk, per_word] = x_by_position(x, tile.bk, per_word)
        x_read = orders[tile.bk, per_word]
    int_rows_kernel[(cdiv(n, tile.bn), split, cdiv(m, ROWS * blocks))](
        x_read,
        *ptrs,
        ws,
        out,
        m,
        n,
        k,
        k_per_split,
        x_read.stride(0),
        out.stride(0),
        **args,
        SCALE_MODE=scale_mode(args, tile.bk, k),
        EVEN_K=k % tile.bk == 0,
        SPLIT=split,
        BLOCKS=blocks,
        BN=tile.bn,
        BKW=tile.bk // per_word,
        DOT_DTYPE=dot_dtype,
        DOT_FP32=dot_fp32,
        INT4_BF16=int4_bf16,
        X_BY_POSITION=step_order,
        ONE_DOT=one_dot,
        num_warps=tile.warps,
        num_stages=tile.stages,
    )
    if split > 1:
        block = 1024
        int_rows_finish[(cdiv(m * n, block),)](ws, out, m, n, out.stride(0), SPLIT=split, BLOCK=block)
    return out


def int_rows_multi_linear(
    fmt: QuantFormat,
    tensor_sets: list[dict[str, torch.Tensor]],
    x: torch.Tensor,
    shapes: list[Shape],
    tile: IntRowsTile | None = None,
) -> list[torch.Tensor]:
    """``[x @ W_i^T]``: one row-exact launch per weight, x written in step order once for all of them."""
    orders: dict[tuple[int, int], torch.Tensor] = {}
    return [int_rows_linear(fmt, t, x, s, tile, orders) for t, s in zip(tensor_sets, shapes, strict=True)]
