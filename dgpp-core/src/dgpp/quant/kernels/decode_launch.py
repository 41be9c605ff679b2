"""Host side of the packed decode GEMVs: which weights they take, which of the two kernels runs (the CUDA-core
row GEMV, ``row_launch``/``row_gemv.py``, or the tensor-core MMA GEMV here, ``decode_gemv.py``), tile choice,
and the three launches (one weight, q/k/v side by side, gate/up + SwiGLU). Both keep a row's bits
independent of the other rows in the launch; they differ from each other, so an engine picks one for its
whole life (``engine.quant_decode_gemv``, the policy's ``quant_decode_gemv``: ``dgpp.policy``).

The selection is explicit (``on_gpu``) so CPU tests can check it without a GPU; everything the GEMVs do
not cover (more than 16 rows, FP8 blocks narrower than 16 columns, int formats, bf12) stays on the
generic ``wo_matmul`` path. On a GPU the default tile splits K by the shape and SM count (never by M):
the partials meet in the same launch through a per-device arrival counter, allocated at the first call
(the engine's eager warm-up, before any CUDA-graph capture) and shared by launches on one stream.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable

import torch

from dgpp.kernels.split_partials import arrival_counters, device_sm_count
from dgpp.policy import current
from dgpp.quant.format import QuantFormat, Shape, cdiv
from dgpp.quant.fp4 import FP4Grouped
from dgpp.quant.fp8 import FP8Block, FP8Channel
from dgpp.quant.kernels.batch_probe import exact_batch_tile
from dgpp.quant.kernels.gemv_tile import FP4_LAYOUTS, FP4_SCALES, MAX_ROWS, X_SPLITS, GemvTile
from dgpp.quant.kernels.operands import interpreting, operand, scale_block
from dgpp.quant.kernels.row_launch import RowTile, row_gate_up_silu, row_multi_linear, row_supported
from dgpp.quant.kernels.x_step_order import x_halves


def _pow2_divisor(n: int) -> int:
    return n & -n


def format_supported(fmt: QuantFormat, shape: Shape) -> bool:
    """FP8 (block scales whose K extent holds a 16-column power-of-two sub-block, or per-channel) and
    FP4 with power-of-two groups of 16..128."""
    if isinstance(fmt, FP8Channel):
        return True
    if isinstance(fmt, FP8Block):
        return _pow2_divisor(fmt.block_for(shape)[1]) >= 16
    if isinstance(fmt, FP4Grouped):
        return fmt.group in (16, 32, 64, 128)
    return False


def _tensors_ok(fmt: QuantFormat, t: dict[str, torch.Tensor], shape: Shape, device: torch.device) -> bool:
    n, k = shape
    if isinstance(fmt, FP8Block):
        w, s = t["weight"], t[fmt.scale_name]
        grid = (n, 1) if isinstance(fmt, FP8Channel) else fmt.scale_grid(shape)
        scale_ok = s.is_floating_point() and s.element_size() in (2, 4) and tuple(s.shape) == tuple(grid)
    else:
        w, s = t[fmt.data_name], t[fmt.scale_name]
        scale_ok = s.element_size() == 1 and tuple(s.shape) == (n, k // fmt.group)
    return (
        w.element_size() == 1
        and w.is_contiguous()
        and s.is_contiguous()
        and scale_ok
        and w.device == device
        and s.device == device
    )


def decode_gemv_applies(
    fmt: QuantFormat,
    tensor_sets: list[dict[str, torch.Tensor]],
    x: torch.Tensor,
    shapes: list[Shape],
    on_gpu: bool,
) -> bool:
    """True when the packed decode GEMV takes these weights for ``x``: on a GPU only (``on_gpu``; the
    CPU keeps the torch decode path), 1..16 rows, a supported format and resident layout, one K."""
    if not on_gpu or not current().packed_decode_gemv:
        return False
    if x.dim() != 2 or not 1 <= x.shape[0] <= MAX_ROWS or x.stride(-1) != 1:
        return False
    if x.dtype not in (torch.bfloat16, torch.float16, torch.float32):
        return False
    k = x.shape[1]
    return all(
        s[1] == k and format_supported(fmt, s) and _tensors_ok(fmt, t, s, x.device)
        for t, s in zip(tensor_sets, shapes, strict=True)
    )


# measured crossovers (H200, 8B shapes, docs/benchmarks.md "Row GEMV"): up to this many rows per step the row
# GEMV beats the MMA GEMV (FP4: 123 vs 156 us per layer at 4 rows; FP8: even at 2 rows, MMA ahead from 4)
ROW_AUTO_MAX_ROWS = {"fp4": 4, "fp8": 2}


def decode_kernel(fmt: QuantFormat) -> str:
    """ "row" or "mma": the policy's ``quant_decode_gemv`` (the engine's ``engine.quant_decode_gemv``, which
    ``DGPP_QUANT_GEMV=row|mma`` overrides for A/B; None: row wherever it applies, as in tests and benchmarks)
    resolved for ``fmt``. Fixed for the engine's life, so a row's bits never depend on how busy the server is:
    "auto" resolves per format from the most rows a decode or verify step can hold alone."""
    policy = current()
    setting = policy.quant_decode_gemv or "row"
    if setting == "auto":
        limit = ROW_AUTO_MAX_ROWS["fp4" if isinstance(fmt, FP4Grouped) else "fp8"]
        setting = "row" if policy.decode_max_rows <= limit else "mma"
    return setting


def _row_kernel(fmt: QuantFormat, shapes: list[Shape], tile) -> bool:
    """The CUDA-core row GEMV (``row_gemv``) unless a GemvTile or the kernel choice asks for the MMA one, or
    the format is one only the MMA GEMV covers (FP4 groups of 64/128, K not a multiple of 16)."""
    if isinstance(tile, RowTile):
        return True
    if tile is not None:
        return False
    return decode_kernel(fmt) == "row" and all(row_supported(fmt, s) for s in shapes)


def default_tile(
    fmt: QuantFormat, n_total: int, k: int, sms: int | None = None, weights_per_program: int = 1
) -> GemvTile:
    """Chosen from the sm_90 SASS that Triton 3.6 emits (compiled ahead on the CPU), confirmed by a GPU
    sweep (tests/perf/bench_quant_gemv.py). Both formats: x as the MMA's A operand (``mma.sync``), so
    the weight bytes go global -> shared by 16-byte ``cp.async`` and are decoded in registers in the dot
    operand layout (no byte-wise shared stores of x). FP8: the integer bit decode (``fp8_bits``) keeps the 16/clock
    conversion pipe out of the loop. FP4: the ``flat`` layout with scales loaded per group and broadcast,
    64 rows per program (the x tile costs the same per step whatever BN, so wider tiles amortise it), and the
    group scales loaded a step ahead (``scales_ahead``; in Triton 3.6's sm_90 SASS the K loop then no longer waits
    on a global load before its dots and runs 4.9 (NVFP4) / 4.8 (MXFP4) instructions per weight and thread
    instead of 5.0 / 5.5), and x read split into each step's even and odd columns once per launch (``x_split``:
    the same bits as every warp splitting each step, in less time on an H100, pre-pass included; docs/benchmarks.md).
    With ``sms`` known, K is split for an even spread over the SMs (``with_split``); the split depends on
    the shape only, never on M.

    The sweep (docs/benchmarks.md, "Quantized decode"): FP4 128-row tiles with 8 warps and 3 stages won on
    o_proj and gate/up for NVFP4 and MXFP4; FP8 gate/up prefers 512-wide K steps."""
    if isinstance(fmt, FP4Grouped):
        bn = 128 if n_total // 128 >= 32 else 64
        tile = GemvTile(
            bn=bn,
            bk=256,
            stages=3,
            warps=8 if bn == 128 else 4,
            w_as_a=False,
            fp4_layout="flat",
            fp4_scales="broadcast",
            scales_ahead=True,
            x_split="launch",
        )
    else:
        bn = 32 if n_total // 32 >= 128 else 16
        wide_k = k >= 8192 or weights_per_program == 2  # gate/up pairs read two weights per K step
        tile = GemvTile(
            bn=bn, bk=512 if wide_k else 256, stages=3 if wide_k else 4, warps=4, w_as_a=False, fp8_bits=True
        )
    return with_split(tile, n_total, k, sms, weights_per_program) if sms else tile


def with_split(tile: GemvTile, n_total: int, k: int, sms: int, weights_per_program: int = 1) -> GemvTile:
    """``tile`` with K split (1..8, powers of two, each slice >= 2 steps) until the launch has at least 1.5
    programs per SM. The decode is ALU-heavy, so programs must spread evenly over the SMs: 192 gate/up
    programs on 132 SMs leave 60 SMs with two and the rest with one (73% balance), 384 give 97%."""
    tiles = cdiv(n_total, tile.bn * weights_per_program)
    split = 1
    while split < 8 and tiles * split < 1.5 * sms and k // (2 * split) >= 2 * tile.bk:
        split *= 2
    return dataclasses.replace(tile, split_k=split)


def _sms(device: torch.device) -> int | None:
    if device.type != "cuda" or interpreting():
        return None
    return device_sm_count(device)


def row_block(m: int) -> int:
    """x rows per program: the decode tile's 16 up to ``MAX_ROWS`` rows, else 64-row blocks (one decode of each
    weight tile for 64 rows). A row's bits do not depend on the choice (``decode_gemv``)."""
    from dgpp.quant.kernels.decode_gemv import BATCH_BM, DECODE_BM

    return DECODE_BM if m <= MAX_ROWS else BATCH_BM


def chain_bk(fmt: QuantFormat, tile: GemvTile, shape: Shape) -> int:
    """The K width that fixes an output's sum chain under ``tile``: FP8, the width of one dot (``BKD``: each dot
    starts from zero, then joins the accumulator, scaled per block); FP4, the step ``BK`` (its even and odd
    halves are two dots)."""
    if isinstance(fmt, FP8Channel):
        return min(tile.bk, 256)
    if isinstance(fmt, FP8Block):
        return min(tile.bk, _pow2_divisor(scale_block(fmt, shape)[1]))
    return tile.bk


def default_batch_tile(fmt: QuantFormat, tile: GemvTile, shape: Shape) -> GemvTile:
    """The tile of 64-row blocks: the decode tile's chain (``chain_bk``, its K split), the decoded weights as
    the MMA's A operand (on Hopper a wgmma takes A from registers, so decoded tiles never go through shared
    memory; x is the B operand, copied to shared memory as loaded), FP8 steps one dot wide so that pipeline
    stages of 64 x rows fit shared memory, and 64 output rows per program or more (x is read once per program).
    FP4 64-row tiles read x split into each K step's even and odd columns once per launch (``x_split``; the same
    bits as the decode tile's split in every step): in Triton 3.6's sm_90 SASS their K loops then lose the split's
    byte permutes (the blocked tile's ALU instructions halve; one-dot tiles run 17-23 % fewer instructions)."""
    if isinstance(fmt, FP4Grouped):
        return dataclasses.replace(tile, bn=max(tile.bn, 64), stages=3, w_as_a=True, x_split="launch")
    return dataclasses.replace(tile, bn=64, bk=chain_bk(fmt, tile, shape), stages=4, warps=4, w_as_a=True)


def _check_batch_tile(fmt: QuantFormat, tile: GemvTile, batch: GemvTile, shape: Shape) -> None:
    if chain_bk(fmt, batch, shape) != chain_bk(fmt, tile, shape) or tile.bk % batch.bk:
        raise ValueError(f"batch tile {batch} does not keep the {fmt.name} decode tile's K chain ({tile})")


def batch_candidates(fmt: QuantFormat, tile: GemvTile, shape: Shape) -> list[GemvTile]:
    """Tiles for 64-row blocks, the probe's candidates (the fastest row-exact one is taken, ties to the earlier
    one): x as the MMA's A operand (the H200 sweep: as fast or faster, NVFP4 gate/up 297 vs 347 us at 64 rows),
    then the weights as A; FP8 then x as A on 2 warps.

    On the H200 (2026-12-05) only the 2-warp one was row-exact: with 4 warps Triton issues wgmma for 64-row
    blocks, whose rounding differs from the 16-row tile's mma; on 2 warps it keeps mma (FP8 8B layer at 64 rows:
    220 us against 347 in 16-row launches). FP4 had no exact candidate (its 128-wide tile on 2 warps ran 7.7 ms a
    layer). The blocked candidate (``row_blocks``: the decode tile's own dot on four 16-row blocks, the weight
    tile decoded once for them) is row-exact by construction; it comes first for FP4, last for FP8."""
    base = default_batch_tile(fmt, tile, shape)
    x_as_a = dataclasses.replace(base, w_as_a=False)
    from dgpp.quant.kernels.decode_gemv import BATCH_BM, DECODE_BM

    # the decode tile itself on four 16-row blocks: its own dot, so the 16-row launches' bits by construction; its
    # scales loaded in the step (ahead, the 64-row FP4 tile spills on sm_90: 255 registers; the bits are the same)
    blocked = dataclasses.replace(
        tile, row_blocks=BATCH_BM // DECODE_BM, stages=min(tile.stages, 2), scales_ahead=False
    )
    if isinstance(fmt, FP4Grouped):  # 64 columns on 8 warps: four accumulators fit the registers (sm_90 SASS)
        blocked = dataclasses.replace(blocked, x_split=base.x_split)
        narrow = dataclasses.replace(blocked, bn=64, warps=8)
        return list(dict.fromkeys([narrow, blocked, x_as_a, base]))
    # one dot per step on 2 warps: 190 registers, no spills, 10.1 sm_90 loop instructions per weight and thread
    # against 12.1 for the decode tile's 256-wide steps on 4 warps (tests/perf/sass_quant_gemv.py --batch)
    blocked_dot = dataclasses.replace(blocked, bk=chain_bk(fmt, tile, shape), warps=2)
    return list(dict.fromkeys([x_as_a, base, dataclasses.replace(x_as_a, warps=2), blocked, blocked_dot]))


def _split_buffers(
    tile: GemvTile, tiles: int, parts: int, m: int, device: torch.device
) -> tuple[torch.Tensor, torch.Tensor]:
    """(fp32 workspace for the partials, arrival counters: ``split_partials.arrival_counters``, shared with the
    dense split launches and never first allocated inside a CUDA-graph capture)."""
    bm = row_block(m)
    blocks = cdiv(m, bm)
    if tile.split_k == 1:
        dummy = torch.empty(1, dtype=torch.float32, device=device)
        return dummy, dummy
    cnt = arrival_counters(device, tiles * blocks, "packed split-K GEMV")
    ws = torch.empty(tile.split_k * parts * tiles * tile.bn * bm * blocks, dtype=torch.float32, device=device)
    return ws, cnt


def _launch_args(
    fmt: QuantFormat, tile: GemvTile, shapes: list[Shape], x: torch.Tensor, slice_bk: int
) -> dict:
    """The format's and tile's constexprs for weights of ``shapes`` (one K); ``slice_bk``: the decode tile's BK,
    whose whole steps make the K slices."""
    import triton.language as tl

    from dgpp.quant.kernels import decode_gemv as kern

    shape = shapes[0]
    sbn, sbk = scale_block(fmt, shape)
    even = shape[1] % (slice_bk * tile.split_k) == 0 and all(n % tile.bn == 0 for n, _ in shapes)
    if isinstance(fmt, FP8Channel):
        kind = kern.FMT_FP8_CHANNEL
    elif isinstance(fmt, FP8Block):
        kind = kern.FMT_FP8_BLOCK
    else:
        kind = kern.FMT_FP4_E8M0 if fmt.scale_kind == "e8m0" else kern.FMT_FP4_E4M3
        if tile.bk % fmt.group:
            raise ValueError(f"tile bk={tile.bk} is not a multiple of the {fmt.name} group {fmt.group}")
    global_op = kern.GLOBAL_NONE
    if tile.x_split not in X_SPLITS:
        raise ValueError(f"GemvTile.x_split must be one of {X_SPLITS}, got {tile.x_split!r}")
    if isinstance(fmt, FP4Grouped) and fmt.global_name:
        global_op = kern.GLOBAL_MUL if fmt.global_op == "mul" else kern.GLOBAL_DIV
    dot_fp32 = x.dtype == torch.float32 or interpreting()
    dot_dtype = tl.float32 if dot_fp32 else {torch.bfloat16: tl.bfloat16, torch.float16: tl.float16}[x.dtype]
    return dict(
        BM=row_block(x.shape[0]),
        SPLIT=tile.split_k,
        FMT=kind,
        SBN=sbn,
        SBK=sbk if kind != kern.FMT_FP8_CHANNEL else 1,
        GLOBAL_OP=global_op,
        BN=tile.bn,
        BK=tile.bk,
        BKD=chain_bk(fmt, tile, shape),
        INTERLEAVE=tile.interleave,
        W_AS_A=tile.w_as_a,
        EVEN=even,
        FAST_FP4=tile.fast_fp4 and not dot_fp32,
        FP8_BITS=tile.fp8_bits,
        FP4_LAYOUT=FP4_LAYOUTS.index(tile.fp4_layout),
        FP4_SCALES=FP4_SCALES.index(tile.fp4_scales),
        DOT_FP32=dot_fp32,
        DOT_DTYPE=dot_dtype,
        BLOCKS=tile.row_blocks if row_block(x.shape[0]) > MAX_ROWS else 1,
        SCALES_AHEAD=tile.scales_ahead,
        X_HALVES=isinstance(fmt, FP4Grouped) and not tile.interleave and tile.x_split == "launch",
        num_warps=tile.warps,
        num_stages=tile.stages,
    )


@dataclasses.dataclass
class _Launch:
    """One launch's plan: grid, constexprs, the K slice width, split-K buffers, and x as the kernel reads it
    (in step order, ``x_halves``, for FP4 tiles that split x once per launch)."""

    grid: tuple[int, int, int]
    args: dict
    k_per_split: int
    ws: torch.Tensor
    cnt: torch.Tensor
    x: torch.Tensor


def _plan(
    fmt: QuantFormat,
    tile: GemvTile,
    batch: GemvTile | None,
    shapes: list[Shape],
    x: torch.Tensor,
    parts: int,
    tile_rows: list[int],
) -> _Launch:
    """``tile`` (the decode tile) fixes the K chain and split; above ``MAX_ROWS`` rows the programs run ``batch``
    (default ``default_batch_tile``) over 64-row blocks. ``tile_rows``: output rows each weight segment tiles."""
    m, k = x.shape
    run = tile
    if m > MAX_ROWS:
        run = batch or default_batch_tile(fmt, tile, shapes[0])
        _check_batch_tile(fmt, tile, run, shapes[0])
        run = dataclasses.replace(run, split_k=tile.split_k)
    tiles = sum(cdiv(n, run.bn) for n in tile_rows)
    ws, cnt = _split_buffers(run, tiles, parts, m, x.device)
    k_per_split = cdiv(cdiv(k, run.split_k), tile.bk) * tile.bk
    args = _launch_args(fmt, run, shapes, x, tile.bk)
    return _Launch(
        (tiles, run.split_k, cdiv(m, row_block(m))),
        args,
        k_per_split,
        ws,
        cnt,
        x_halves(x, run.bk) if args["X_HALVES"] else x,
    )


def quant_multi_linear(
    fmt: QuantFormat,
    tensor_sets: list[dict[str, torch.Tensor]],
    x: torch.Tensor,
    shapes: list[Shape],
    tile: GemvTile | RowTile | None = None,
    batch: GemvTile | None = None,
) -> list[torch.Tensor]:
    """``[x @ W_i^T]`` for 1..3 weights of one format in one launch (x ``[m, K]``, any m; the row GEMV takes at
    most 16 rows); the outputs are column views of one ``[m, sum N_i]`` buffer. Above 16 rows: 64-row blocks
    with the fastest of ``batch_candidates`` found row-exact on this device (``exact_batch_tile``), else 16-row
    launches; ``batch`` pins the 64-row tile instead (sweeps; it must keep ``tile``'s K chain)."""
    from dgpp.quant.kernels.decode_gemv import quant_multi_gemv_kernel

    if _row_kernel(fmt, shapes, tile):
        return row_multi_linear(fmt, tensor_sets, x, shapes, tile)

    if not 1 <= len(tensor_sets) <= 3:
        raise ValueError(f"quant_multi_linear takes 1 to 3 weights, got {len(tensor_sets)}")
    sizes = [s[0] for s in shapes]
    m, k = x.shape
    tile = tile or default_tile(fmt, sum(sizes), k, _sms(x.device))
    if m > MAX_ROWS and batch is None:

        def launch(rows: torch.Tensor, b: GemvTile | None) -> torch.Tensor:
            return torch.cat(quant_multi_linear(fmt, tensor_sets, rows, shapes, tile, b), dim=1)

        key = ("multi", fmt, tuple(shapes), tile, x.dtype, x.device)
        batch = exact_batch_tile(key, launch, batch_candidates(fmt, tile, shapes[0]), k, x.dtype, x.device)
        if batch is None:
            return _in_decode_launches(
                x, lambda rows: quant_multi_linear(fmt, tensor_sets, rows, shapes, tile)
            )
    ops = [operand(fmt, t) for t in tensor_sets]
    ops += [ops[0]] * (3 - len(ops))
    ns = sizes + [0] * (3 - len(sizes))
    out = torch.empty(x.shape[0], sum(sizes), dtype=x.dtype, device=x.device)
    plan = _plan(fmt, tile, batch, shapes, x, 1, sizes)
    quant_multi_gemv_kernel[plan.grid](
        plan.x,
        *ops[0],
        *ops[1],
        *ops[2],
        out,
        plan.ws,
        plan.cnt,
        x.shape[0],
        k,
        plan.k_per_split,
        ns[0],
        ns[1],
        ns[2],
        plan.x.stride(0),
        out.stride(0),
        **plan.args,
    )
    return list(out.split(sizes, dim=1))


def quant_gate_up_silu(
    fmt: QuantFormat,
    gate: dict[str, torch.Tensor],
    up: dict[str, torch.Tensor],
    x: torch.Tensor,
    shape: Shape,
    tile: GemvTile | RowTile | None = None,
    batch: GemvTile | None = None,
) -> torch.Tensor:
    """``silu(x Wg^T) * (x Wu^T)`` in one launch; gate and up share ``shape`` and format (``batch`` as in
    ``quant_multi_linear``)."""
    from dgpp.quant.kernels.decode_gemv import quant_gate_up_silu_kernel

    if _row_kernel(fmt, [shape], tile):
        return row_gate_up_silu(fmt, gate, up, x, shape, tile)

    n, k = shape
    tile = tile or default_tile(fmt, 2 * n, k, _sms(x.device), weights_per_program=2)
    if x.shape[0] > MAX_ROWS and batch is None:

        def launch(rows: torch.Tensor, b: GemvTile | None) -> torch.Tensor:
            return quant_gate_up_silu(fmt, gate, up, rows, shape, tile, b)

        key = ("gate_up", fmt, shape, tile, x.dtype, x.device)
        batch = exact_batch_tile(key, launch, batch_candidates(fmt, tile, shape), k, x.dtype, x.device)
        if batch is None:
            return _in_decode_launches(
                x, lambda rows: [quant_gate_up_silu(fmt, gate, up, rows, shape, tile)]
            )[0]
    out = torch.empty(x.shape[0], n, dtype=x.dtype, device=x.device)
    plan = _plan(fmt, tile, batch, [shape], x, 2, [n])
    quant_gate_up_silu_kernel[plan.grid](
        plan.x,
        *operand(fmt, gate),
        *operand(fmt, up),
        out,
        plan.ws,
        plan.cnt,
        x.shape[0],
        k,
        plan.k_per_split,
        n,
        plan.x.stride(0),
        out.stride(0),
        **plan.args,
    )
    return out


def _in_decode_launches(
    x: torch.Tensor, launch: Callable[[torch.Tensor], list[torch.Tensor]]
) -> list[torch.Tensor]:
    """``launch`` over 16-row slices of ``x``, outputs concatenated per weight (no exact batch tile here)."""
    parts = [launch(x[i : i + MAX_ROWS]) for i in range(0, x.shape[0], MAX_ROWS)]
    return [torch.cat(outs) for outs in zip(*parts, strict=True)]


def one_launch_for_any_rows(fmt: QuantFormat, shapes: list[Shape]) -> bool:
    """True when the engine's decode kernel for these weights is the MMA one, whose launch takes every row of a
    step at once (the row GEMV runs launches of at most ``MAX_ROWS`` rows)."""
    return not _row_kernel(fmt, shapes, None)
