"""Host side of the packed-expert grouped GEMM: stacked-tensor arguments, tile choice and the two launches.

``fused_quant_moe`` routes ``x [T, H]`` through the experts each token picked, with every expert's
gate/up/down weights kept in their packed format as stacks ``[E, *stored]``. Shapes and launch grids
depend only on ``T``, ``top_k`` and ``E`` (the block layout uses its worst case), and no value is read
back to the host, so a decode step that calls it can be captured in a CUDA graph.
"""

from __future__ import annotations

import dataclasses

import torch

from dgpp.kernels import moe_align
from dgpp.kernels.moe import align_to_experts, swiglu_limit_constant
from dgpp.quant.format import QuantFormat, Shape, cdiv
from dgpp.quant.fp4 import FP4Grouped
from dgpp.quant.fp8 import FP8Block
from dgpp.quant.intq import GPTQ, IntPacked
from dgpp.quant.kernels import moe_block_probe
from dgpp.quant.kernels.batch_probe import launch_time_us, probed_once
from dgpp.quant.kernels.launch import _format_args
from dgpp.quant.kernels.operands import interpreting
from dgpp.quant.kernels.x_step_order import x_by_position


def has_moe_kernel(fmt: QuantFormat) -> bool:
    """Formats the fused expert GEMM decodes (bf12 is a dense-matrix form, never an expert format)."""
    return isinstance(fmt, (FP8Block, FP4Grouped, IntPacked, GPTQ))


def _role_names(fmt: QuantFormat) -> dict[str, str]:
    """Which stored tensor is the code (w), scale (s), zero point (z) and global (g) argument."""
    if isinstance(fmt, FP8Block):
        return {"w": "weight", "s": fmt.scale_name}
    if isinstance(fmt, FP4Grouped):
        names = {"w": fmt.data_name, "s": fmt.scale_name}
        return {**names, "g": fmt.global_name} if fmt.global_name else names
    if isinstance(fmt, IntPacked):
        return {"w": "weight_packed", "s": "weight_scale"}
    if isinstance(fmt, GPTQ):
        return {"w": "qweight", "s": "scales", "z": "qzeros"}
    raise NotImplementedError(f"no fused MoE kernel for format {fmt.name}")


def stack_args(fmt: QuantFormat, stack: dict[str, torch.Tensor], shape: Shape) -> dict:
    """Kernel arguments for one projection of every expert: the per-expert layout (strides, block sizes,
    flags) is the weight-only linear's, read off expert 0; pointers are the whole stacks, whose
    expert strides go in ``stride_*e``."""
    args = _format_args(fmt, {name: t[0] for name, t in stack.items()}, shape)
    args.update(stride_we=0, stride_se=0, stride_ze=0, stride_ge=0)
    for role, name in _role_names(fmt).items():
        t = stack[name]
        if t.element_size() == 1 and role in ("w", "s"):
            t = t.view(torch.uint8)  # E4M3 / E2M1 / E8M0 bytes are decoded in the kernel
        args[role] = t
        args[f"stride_{role}e"] = t.stride(0)
    return args


@dataclasses.dataclass(frozen=True)
class MoETiles:
    """BM sorted rows (one expert per block), BN output columns, BKP stored elements along K per step; the BM rows
    as ``row_blocks`` blocks, each weight tile decoded once for all of them (``blocked_tiles``)."""

    bm: int
    bn: int
    bkp: int
    num_warps: int = 4
    num_stages: int = 3
    row_blocks: int = 1


DECODE_BM = 16


def moe_tiles(pack: int, n_assign: int, num_experts: int) -> MoETiles:
    """Decode (few rows per expert: the weights read is the cost) uses 16-row blocks, the smallest a
    tensor-core dot takes, so an expert's bytes are read once per block, and 64 output columns a program (a
    wider tile keeps more of each expert's bytes in flight per program); larger batches 64-row blocks.
    A K step covers 128 weights, 256 for eight codes a word (int4: half the loop trips around each word's
    decode; two stages in the 64-row blocks, whose x tile doubles). Both block sizes take the same K step, so a
    row's K chain does not depend on the batch; whether the 64-row blocks' tensor-core instruction rounds like
    the 16-row blocks' is probed on the device before ``fused_quant_moe`` takes them (``moe_block_probe``)."""
    bkp = max(16, (256 if pack == 8 else 128) // pack)
    if n_assign <= 4 * num_experts:
        return MoETiles(bm=DECODE_BM, bn=64, bkp=bkp)
    return MoETiles(bm=64, bn=64, bkp=bkp, num_stages=2 if pack == 8 else 3)


def blocked_tiles(decode: MoETiles, one_dot: MoETiles) -> MoETiles:
    """``one_dot``'s blocks as ``decode``-sized row blocks in one program: each weight tile is decoded once for all
    the rows (as the one-dot blocks do), and each row block meets it in the decode tile's own dot, so its rows'
    bits are the decode tiles' by construction, whatever instruction a 64-row dot would take. On 8 warps: the
    eight [16, 64] accumulators of gate/up spill on 4 (sm_90 SASS, int4 at GLM-5.3's shape)."""
    return dataclasses.replace(
        decode,
        bm=one_dot.bm,
        row_blocks=one_dot.bm // decode.bm,
        num_warps=8,
        num_stages=one_dot.num_stages,
    )


def _scale_mode(args: dict, bkp: int) -> int:
    """1: a K tile sits inside one scale column (scales once per row); 2: whole groups tile it (once per
    group, broadcast); 0: gathered per weight (the general case, e.g. small FP8 test blocks)."""
    from dgpp.quant.kernels.wo_matmul import FMT_FP4, FMT_INT

    sbk, pack, fmt = args["SBK"], args["PACK"], args["FMT"]
    if fmt != FMT_FP4 and sbk % (bkp * pack) == 0:
        return 1
    if fmt in (FMT_FP4, FMT_INT) and sbk % pack == 0 and bkp % (sbk // pack) == 0:
        return 2
    return 0


def int4_bf16_applies(args: dict, round_dtype: object, scale_mode: int, dot_low: bool) -> bool:
    """Int words with whole groups per K tile that ``takes_int4_ptx`` accepts: ``code - 8`` is exact in bf16, so
    the kernel decodes it in inline PTX and multiplies in bf16 (one rounding, as the fp32 decode)."""
    from dgpp.quant.kernels.int4_asm import takes_int4_ptx
    from dgpp.quant.kernels.wo_matmul import FMT_INT

    return (
        args["FMT"] == FMT_INT
        and scale_mode == 2
        and takes_int4_ptx(args["BITS"], args["ZERO_OFFSET"], args["s"].dtype, round_dtype, not dot_low)
    )


def _reads_step_order(args: dict, tiles: MoETiles) -> bool:
    """Eight codes a word (int4, GPTQ int4): the activations are written in step order first, so each code
    position's columns load as one run (as the row-exact int GEMM reads x for 4-bit codes)."""
    return args["PACK"] == 8 and (tiles.bkp * 8) & (tiles.bkp * 8 - 1) == 0


def _launch(
    args: dict,
    up: dict | None,
    a: torch.Tensor,
    c: torch.Tensor,
    sorted_ids: torch.Tensor,
    block_expert: torch.Tensor,
    topk_w: torch.Tensor,
    num_assign: int,
    top_k: int,
    n_out: int,
    tiles: MoETiles,
    *,
    gather: bool,
    swiglu: bool,
    scatter: bool,
    swiglu_limit: float = 0.0,
    a_step_order: bool = False,
) -> None:
    import triton.language as tl

    from dgpp.quant.kernels.moe_gemm import quant_moe_gemm_kernel
    from dgpp.quant.kernels.wo_matmul import FMT_FP4

    round_dtype = {torch.bfloat16: tl.bfloat16, torch.float16: tl.float16}.get(a.dtype, tl.float32)
    dot_low = round_dtype is not tl.float32 and not interpreting()
    # the PTX pair decoder works on 4 bytes per register: tiles that give each thread at least 4 bytes
    fast_e2m1 = dot_low and args["FMT"] == FMT_FP4 and tiles.bn * tiles.bkp >= 4 * 32 * tiles.num_warps
    scale_mode = _scale_mode(args, tiles.bkp)
    # E2M1 times its group scale is exact in bf16: bf16 activations take exact weights and the global per sum
    fp4_exact = args["FMT"] == FMT_FP4 and round_dtype is tl.bfloat16 and scale_mode == 2
    int4_bf16 = int4_bf16_applies(args, round_dtype, scale_mode, dot_low)
    up = up or args
    grid = (sorted_ids.shape[0] // tiles.bm, cdiv(n_out, tiles.bn))
    quant_moe_gemm_kernel[grid](
        a,
        c,
        sorted_ids,
        block_expert,
        topk_w,
        args["w"],
        args["s"],
        args["z"],
        args["g"],
        up["w"],
        up["s"],
        up["z"],
        up["g"],
        num_assign,
        top_k,
        n_out,
        args["KP"],
        a.stride(0),
        c.stride(0),
        args["stride_we"],
        args["stride_wn"],
        args["stride_wk"],
        args["stride_se"],
        args["stride_sn"],
        args["stride_sk"],
        args["stride_ze"],
        args["stride_zk"],
        args["stride_ge"],
        SBN=args["SBN"],
        SBK=args["SBK"],
        FMT=args["FMT"],
        PACK=args["PACK"],
        BITS=args["BITS"],
        SCALE_E8M0=args["SCALE_E8M0"],
        GLOBAL_OP=args["GLOBAL_OP"],
        ZERO_OFFSET=args["ZERO_OFFSET"],
        ROUND_DTYPE=round_dtype,
        DOT_LOW=dot_low,
        FAST_E2M1=fast_e2m1,
        SCALE_MODE=scale_mode,
        GATHER_TOKENS=gather,
        SWIGLU=swiglu,
        SCATTER_WEIGHTED=scatter,
        BM=tiles.bm,
        BN=tiles.bn,
        BKP=tiles.bkp,
        SWIGLU_LIMIT=swiglu_limit,
        FP4_EXACT=fp4_exact,
        INT4_BF16=int4_bf16,
        A_STEP_ORDER=a_step_order,
        BLOCKS=tiles.row_blocks,
        num_warps=tiles.num_warps,
        num_stages=tiles.num_stages,
    )


def _row_exact_tiles(
    gate_up: tuple[QuantFormat, dict[str, torch.Tensor], dict[str, torch.Tensor]],
    down: tuple[QuantFormat, dict[str, torch.Tensor]],
    inter: int,
    top_k: int,
    candidates: tuple[MoETiles, ...],
    decode: MoETiles,
    x: torch.Tensor,
    swiglu_limit: float | None,
) -> MoETiles:
    """The fastest of ``candidates`` (64-row blocks: one dot, then four 16-row dots) whose rows get the decode tiles'
    16-row bits on this device, and the decode tiles themselves (``moe_block_probe``, once per formats, shapes,
    tiles, dtype and device; ties to the earlier), so a token's bits never depend on how many tokens share its step
    and a 64-row form is taken only where it is faster."""
    key = (gate_up[0], down[0], x.shape[1], inter, top_k, candidates, decode, x.dtype, x.device)

    def probe() -> MoETiles:
        num_experts = stack_args(gate_up[0], gate_up[1], (inter, x.shape[1]))["w"].shape[0]
        px, pw, pids = moe_block_probe.probe_inputs(x.shape[1], top_k, num_experts, x.dtype, x.device)

        def layer(tiles: MoETiles) -> torch.Tensor:
            return fused_quant_moe(gate_up, down, px, pw, pids, inter, tiles, swiglu_limit)

        want = layer(decode)
        choice, best = decode, float("inf")
        for tiles in (*candidates, decode):
            if tiles is not decode:
                try:
                    got = layer(tiles)
                except Exception:  # noqa: BLE001 (a tile that does not compile or fit on this device is no candidate)
                    continue
                if not torch.equal(got, want):
                    continue
            took = launch_time_us(lambda t=tiles: layer(t), x.device)
            if took < best:
                choice, best = tiles, took
        return choice

    chosen = probed_once(moe_block_probe._CHOSEN, key, x.device, probe)
    return chosen if isinstance(chosen, MoETiles) else decode


def fused_quant_moe(
    gate_up: tuple[QuantFormat, dict[str, torch.Tensor], dict[str, torch.Tensor]],
    down: tuple[QuantFormat, dict[str, torch.Tensor]],
    x: torch.Tensor,
    topk_weights: torch.Tensor,
    topk_ids: torch.Tensor,
    inter: int,
    tiles: MoETiles | None = None,
    swiglu_limit: float | None = None,
    bf16_partial_rows: torch.Tensor | str | None = None,
) -> torch.Tensor:
    """``sum_k w[t, k] * down_e(silu(gate_e x_t) * up_e x_t)`` with ``e = topk_ids[t, k]`` (gate and up
    clamped at ``swiglu_limit`` first when it is set).

    ``gate_up``: (format, gate stacks, up stacks) and ``down``: (format, down stacks), each stack a stored
    tensor with a leading expert dim (logical gate/up [E, I, H], down [E, H, I]; the two formats differ
    only when TP re-blocks an FP8 grid). Weighted per-assignment rows are summed per token in a fixed
    order (no atomics), in fp32; ``bf16_partial_rows`` (``dgpp.step.prefill_rows``: every token, some, or
    none) are the tokens whose weighted rows are rounded to bf16 first (``engine.prefill_bf16_partials``): when
    every token is, the down launch writes bf16 rows directly."""
    tokens, hidden = x.shape
    top_k = topk_ids.shape[1]
    if tokens == 0:
        return torch.empty_like(x)
    x = x.contiguous()
    gate_args = stack_args(gate_up[0], gate_up[1], (inter, hidden))
    up_args = stack_args(gate_up[0], gate_up[2], (inter, hidden))
    down_args = stack_args(down[0], down[1], (hidden, inter))
    num_experts = gate_args["w"].shape[0]
    n_assign = tokens * top_k
    if tiles is None:
        tiles = moe_tiles(gate_args["PACK"], n_assign, num_experts)
        if tiles.bm > DECODE_BM:
            decode = moe_tiles(gate_args["PACK"], 0, num_experts)
            candidates = (tiles, blocked_tiles(decode, tiles))
            tiles = _row_exact_tiles(gate_up, down, inter, top_k, candidates, decode, x, swiglu_limit)
    # decode-sized routings sort in one launch; the torch chain is ~15 small kernels
    align = moe_align.align_to_experts_triton if moe_align.fits(topk_ids, num_experts) else align_to_experts
    sorted_ids, block_expert = align(topk_ids, num_experts, tiles.bm)
    weights = topk_weights.contiguous().view(-1)
    act = torch.empty(sorted_ids.shape[0], inter, dtype=x.dtype, device=x.device)
    gate_order, down_order = (_reads_step_order(a, tiles) for a in (gate_args, down_args))
    _launch(
        gate_args,
        up_args,
        x_by_position(x, tiles.bkp * gate_args["PACK"], gate_args["PACK"]) if gate_order else x,
        act,
        sorted_ids,
        block_expert,
        weights,
        n_assign,
        top_k,
        inter,
        tiles,
        gather=True,
        swiglu=True,
        scatter=False,
        swiglu_limit=swiglu_limit_constant(swiglu_limit),
        a_step_order=gate_order,
    )
    # the interpreter's fp32 -> bf16 store does not round to nearest even as the GPU's does: there the rows are
    # stored in fp32 and rounded by torch below, the same values
    bf16_store = isinstance(bf16_partial_rows, str) and not interpreting()
    per_assign = torch.empty(
        n_assign, hidden, dtype=torch.bfloat16 if bf16_store else torch.float32, device=x.device
    )
    _launch(
        down_args,
        None,
        x_by_position(act, tiles.bkp * down_args["PACK"], down_args["PACK"]) if down_order else act,
        per_assign,
        sorted_ids,
        block_expert,
        weights,
        n_assign,
        top_k,
        hidden,
        tiles,
        gather=False,
        swiglu=False,
        scatter=True,
        a_step_order=down_order,
    )
    partials = per_assign.view(tokens, top_k, hidden).float()
    if isinstance(bf16_partial_rows, torch.Tensor):  # a step mixing prefill and decode rows
        partials[bf16_partial_rows] = partials[bf16_partial_rows].to(torch.bfloat16).float()
    elif bf16_partial_rows is not None and not bf16_store:
        partials = partials.to(torch.bfloat16).float()
    return partials.sum(1).to(x.dtype)
