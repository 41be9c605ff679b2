"""Instruction mix of the fused packed-expert GEMM's K loop on sm_90, compiled ahead of time on a machine without
a GPU (as ``sass_quant_gemv.py`` does for the dense tiles). Not a test: per format and launch (gate/up with SwiGLU,
down), ``sass_quant_gemv.loop_summary`` of the K loop: instructions and shared-memory bytes per decoded weight and
thread, how many instructions separate a global load from its first use (``ldg_cover``), the mix, the registers.

    PYTHONPATH=/tmp/t36:dgpp-core/src:tests/perf python3 tests/perf/sass_quant_moe.py [--formats nvfp4,mxfp4,fp8,int4_g64]
        [--tiles 16,32,64,4,3[,4]] [--hidden 3072 --inter 1024]

``--tiles`` is BM,BN,BKP,warps,stages[,row blocks] (BKP 0: the launch's default for the format). int4 formats compile the path
the policy takes (``DGPP_INT4_PTX=0``: the fp32 decode); eight codes a word read the activations in step order as
the launch does (``DGPP_SASS_A_COLUMNS=1``: column by column, as before).
"""

from __future__ import annotations

import argparse
import os

import torch
import triton
import triton.language as tl
from sass_quant_gemv import POINTER_KINDS, loop_summary
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource

from dgpp.quant.fp4 import MXFP4, NVFP4ModelOpt
from dgpp.quant.fp8 import FP8Block
from dgpp.quant.intq import IntPacked
from dgpp.quant.kernels import moe_launch
from dgpp.quant.kernels.moe_gemm import quant_moe_gemm_kernel as kernel
from dgpp.quant.kernels.wo_matmul import FMT_FP4
from dgpp.quant.moe import QuantExperts

FORMATS = {
    "nvfp4": NVFP4ModelOpt(),
    "mxfp4": MXFP4(),
    "fp8": FP8Block(block=(128, 128)),
    "int4_g64": IntPacked(bits=4, group=64),
    "int8_g64": IntPacked(bits=8, group=64),
}


def compile_launch(fmt, hidden: int, inter: int, tiles, swiglu: bool):
    """The gate/up (``swiglu``) or down launch for bf16 activations, with the constexprs ``_launch`` passes."""
    moe = QuantExperts(fmt, 2, hidden, inter)
    shape = (inter, hidden) if swiglu else (hidden, inter)
    first = moe.gate_proj if swiglu else moe.down_proj
    args = moe_launch.stack_args(first.fmt, first.stacks(), shape)
    up = moe_launch.stack_args(first.fmt, moe.up_proj.stacks(), shape) if swiglu else args
    if isinstance(fmt, IntPacked):  # compressed-tensors ships BF16 scales, and a loaded model keeps them so
        for stack in {id(args): args, id(up): up}.values():
            stack["s"] = stack["s"].to(torch.bfloat16)
    scale_mode = moe_launch._scale_mode(args, tiles.bkp)
    fp4 = args["FMT"] == FMT_FP4
    const = dict(
        SBN=args["SBN"], SBK=args["SBK"], FMT=args["FMT"], PACK=args["PACK"], BITS=args["BITS"],
        SCALE_E8M0=args["SCALE_E8M0"], GLOBAL_OP=args["GLOBAL_OP"], ZERO_OFFSET=args["ZERO_OFFSET"],
        ROUND_DTYPE=tl.bfloat16, DOT_LOW=True, SCALE_MODE=scale_mode, GATHER_TOKENS=swiglu, SWIGLU=swiglu,
        SCATTER_WEIGHTED=not swiglu, BM=tiles.bm, BN=tiles.bn, BKP=tiles.bkp,
        FAST_E2M1=fp4 and tiles.bn * tiles.bkp >= 4 * 32 * tiles.num_warps, SWIGLU_LIMIT=0.0,
        FP4_EXACT=fp4 and scale_mode == 2,
        INT4_BF16=moe_launch.int4_bf16_applies(args, tl.bfloat16, scale_mode, dot_low=True),
        A_STEP_ORDER=moe_launch._reads_step_order(args, tiles) and os.environ.get("DGPP_SASS_A_COLUMNS") != "1",
        BLOCKS=tiles.row_blocks,
    )  # fmt: skip
    rows = torch.empty(1, hidden, dtype=torch.bfloat16)
    index = torch.empty(1, dtype=torch.int32)
    ptrs = dict(
        a_ptr=rows, c_ptr=rows, sorted_ids_ptr=index, block_expert_ptr=index, topk_w_ptr=rows,
        w_ptr=args["w"], s_ptr=args["s"], z_ptr=args["z"], g_ptr=args["g"],
        w2_ptr=up["w"], s2_ptr=up["s"], z2_ptr=up["z"], g2_ptr=up["g"],
    )  # fmt: skip
    names = kernel.arg_names
    const = {
        k: v for k, v in const.items() if k in names
    }  # a tree before a constexpr existed runs without it
    kinds = {**POINTER_KINDS, torch.float8_e4m3fn: "*u8"}  # an unused z / g argument is the FP8 codes tensor
    sig = {n: kinds[ptrs[n].dtype] if n in ptrs else "constexpr" if n in const else "i32" for n in names}
    attrs = {
        (names.index(n),): [["tt.divisibility", 16]]
        for n in names
        if sig[n] != "constexpr" and n != "num_assign"
    }
    src = ASTSource(kernel, sig, constexprs={(names.index(k),): v for k, v in const.items()}, attrs=attrs)
    options = {"num_warps": tiles.num_warps, "num_stages": tiles.num_stages}
    return triton.compile(src, target=GPUTarget("cuda", 90, 32), options=options)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--formats", default="nvfp4,mxfp4,fp8")
    parser.add_argument("--tiles", default="16,32,0,4,3")
    parser.add_argument("--hidden", type=int, default=3072)
    parser.add_argument("--inter", type=int, default=1024)
    args = parser.parse_args()
    bm, bn, bkp, warps, stages, *blocks = (int(v) for v in args.tiles.split(","))
    for name in args.formats.split(","):
        fmt = FORMATS[name]
        pack = 32 // fmt.bits if isinstance(fmt, IntPacked) else 1 if isinstance(fmt, FP8Block) else 2
        tiles = moe_launch.MoETiles(
            bm, bn, bkp or moe_launch.moe_tiles(pack, 1, 1).bkp, warps, stages, blocks[0] if blocks else 1
        )
        for swiglu in (True, False):
            weights = (2 if swiglu else 1) * tiles.bn * tiles.bkp * pack // (32 * tiles.num_warps)
            line = loop_summary(compile_launch(fmt, args.hidden, args.inter, tiles, swiglu), weights)
            print(f"{name:6s} {'gate_up' if swiglu else 'down':7s} {tiles}  {line}", flush=True)


if __name__ == "__main__":
    main()
