"""Host side of the row GEMV (``row_gemv.py``): tile choice, constexprs and the two launches (1..3 weights
side by side; gate/up + SwiGLU). Same contract as ``decode_launch``'s MMA GEMV: ``x`` [m <= 16, K]."""

from __future__ import annotations

import dataclasses

import torch

from dgpp.quant.format import QuantFormat, Shape, cdiv
from dgpp.quant.fp4 import FP4Grouped
from dgpp.quant.fp8 import FP8Block, FP8Channel
from dgpp.quant.kernels.operands import interpreting, operand, scale_block

SPAN_FP8 = 16  # FP8 columns per partial sum: one thread's 16-byte vector


@dataclasses.dataclass(frozen=True)
class RowTile:
    """BN output rows per program, BK logical K columns per loop step, warps, software-pipeline stages."""

    bn: int = 16
    bk: int = 512
    warps: int = 4
    stages: int = 1
    prefetch: bool = True  # load step k + 1 before decoding step k (two steps of loads in flight)
    wide: bool = False  # 16-byte weight loads (an alignment hint; changes Triton's register layouts)
    scale_weights: bool = False  # scales multiply each weight once rather than each row's span sums


def default_row_tile(fmt: QuantFormat, n_total: int, k: int) -> RowTile:
    """The GPU sweep's winners at one row (docs/benchmarks.md, "Row GEMV"): FP4 8 rows x 1024 columns per
    step (512 bytes of each row), FP8 16 rows x 1024 columns; both 4 warps, next step prefetched."""
    if isinstance(fmt, FP4Grouped):
        return RowTile(bn=8, bk=1024)
    return RowTile(bn=16, bk=1024)


def rows_per_program(m: int) -> int:
    """x rows that share one decode (1, 2, 4 or 8 row slots; a row's bits do not depend on the choice)."""
    return 1 if m == 1 else 2 if m == 2 else 4 if m <= 4 else 8


def span(fmt: QuantFormat) -> int:
    return fmt.group if isinstance(fmt, FP4Grouped) else SPAN_FP8


def row_supported(fmt: QuantFormat, shape: Shape) -> bool:
    """FP8 blocks whose K extent is a multiple of 16, per-channel FP8, FP4 groups of 16 or 32; K a multiple
    of 16 (rows are read as int32 words and summed in 16-column spans)."""
    if shape[1] % 16:
        return False
    if isinstance(fmt, FP8Channel):
        return True
    if isinstance(fmt, FP8Block):
        return fmt.block_for(shape)[1] % SPAN_FP8 == 0
    return isinstance(fmt, FP4Grouped) and fmt.group in (16, 32)


def _word_operand(
    fmt: QuantFormat, t: dict[str, torch.Tensor]
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(codes as int32 words, scales, global scale): the bytes of a row, four at a time."""

    w, s, g = operand(fmt, t)
    return w.view(torch.int32), s, g


def _row_args(fmt: QuantFormat, tile: RowTile, shapes: list[Shape], x: torch.Tensor, rows: int) -> dict:
    from dgpp.quant.kernels import decode_gemv as kern

    sbn, sbk = scale_block(fmt, shapes[0])
    if isinstance(fmt, FP8Channel):
        kind = kern.FMT_FP8_CHANNEL
    elif isinstance(fmt, FP8Block):
        kind = kern.FMT_FP8_BLOCK
    else:
        kind = kern.FMT_FP4_E8M0 if fmt.scale_kind == "e8m0" else kern.FMT_FP4_E4M3
    global_op = kern.GLOBAL_NONE
    if isinstance(fmt, FP4Grouped) and fmt.global_name:
        global_op = kern.GLOBAL_MUL if fmt.global_op == "mul" else kern.GLOBAL_DIV
    even = shapes[0][1] % tile.bk == 0 and all(n % tile.bn == 0 for n, _ in shapes)
    return dict(
        FMT=kind,
        SBN=sbn,
        SBK=max(sbk, 1),
        SPAN=span(fmt),
        GLOBAL_OP=global_op,
        BN=tile.bn,
        BK=tile.bk,
        ROWS=rows,
        EVEN=even,
        FAST=not interpreting(),
        PREFETCH=tile.prefetch,
        WIDE=tile.wide,
        SCALE_WEIGHTS=tile.scale_weights and not isinstance(fmt, FP8Channel),
        num_warps=tile.warps,
        num_stages=tile.stages,
    )


def row_multi_linear(
    fmt: QuantFormat,
    tensor_sets: list[dict[str, torch.Tensor]],
    x: torch.Tensor,
    shapes: list[Shape],
    tile: RowTile | None = None,
) -> list[torch.Tensor]:
    """``[x @ W_i^T]`` for 1..3 weights of one format in one launch; column views of one [m, sum N_i] buffer."""
    from dgpp.quant.kernels.row_gemv import row_multi_gemv_kernel

    if not 1 <= len(tensor_sets) <= 3:
        raise ValueError(f"row_multi_linear takes 1 to 3 weights, got {len(tensor_sets)}")
    sizes = [s[0] for s in shapes]
    m, k = x.shape
    tile = tile or default_row_tile(fmt, sum(sizes), k)
    ops = [_word_operand(fmt, t) for t in tensor_sets]
    ops += [ops[0]] * (3 - len(ops))
    ns = sizes + [0] * (3 - len(sizes))
    out = torch.empty(m, sum(sizes), dtype=x.dtype, device=x.device)
    rows = rows_per_program(m)
    grid = (sum(cdiv(n, tile.bn) for n in sizes), cdiv(m, rows))
    row_multi_gemv_kernel[grid](
        x,
        *ops[0],
        *ops[1],
        *ops[2],
        out,
        m,
        k,
        ns[0],
        ns[1],
        ns[2],
        x.stride(0),
        out.stride(0),
        **_row_args(fmt, tile, shapes, x, rows),
    )
    return list(out.split(sizes, dim=1))


def row_gate_up_silu(
    fmt: QuantFormat,
    gate: dict[str, torch.Tensor],
    up: dict[str, torch.Tensor],
    x: torch.Tensor,
    shape: Shape,
    tile: RowTile | None = None,
) -> torch.Tensor:
    """``silu(x Wg^T) * (x Wu^T)`` in one launch; gate and up share ``shape`` and format."""
    from dgpp.quant.kernels.row_gemv import row_gate_up_silu_kernel

    n, k = shape
    m = x.shape[0]
    tile = tile or default_row_tile(fmt, 2 * n, k)
    out = torch.empty(m, n, dtype=x.dtype, device=x.device)
    rows = rows_per_program(m)
    row_gate_up_silu_kernel[(cdiv(n, tile.bn), cdiv(m, rows))](
        x,
        *_word_operand(fmt, gate),
        *_word_operand(fmt, up),
        out,
        m,
        k,
        n,
        x.stride(0),
        out.stride(0),
        **_row_args(fmt, tile, [shape], x, rows),
    )
    return out
