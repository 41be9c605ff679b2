"""Instruction mix of the row-exact int GEMM's K loop (``quant/kernels/int_rows.py``) on sm_90, compiled ahead of
time on a machine without a GPU (as ``sass_quant_moe.py`` does for the expert GEMM). Not a test: per format and
row-block count, ``sass_quant_gemv.loop_summary`` of the K loop for bf16 x and BF16 scales (int4 compiles the path
the policy takes: ``DGPP_INT4_PTX=0`` for the fp32 decode).

    PYTHONPATH=/tmp/t36:dgpp-core/src:tests/perf python3 tests/perf/sass_int_rows.py [--bits 4,8] [--blocks 1,4]
        [--shape 6144,6144] [--tile 64,128,4,3] [--x-in-step-order 0|1|2] [--one-dot]
"""

from __future__ import annotations

import argparse

import torch
import triton
import triton.language as tl
from sass_quant_gemv import POINTER_KINDS, loop_summary
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource

from dgpp.quant.intq import IntPacked
from dgpp.quant.kernels import int_rows_launch
from dgpp.quant.kernels.int_rows import int_rows_kernel as kernel


def compile_tile(bits: int, shape: tuple[int, int], tile: int_rows_launch.IntRowsTile, blocks: int):
    """The launch ``int_rows_linear`` makes for a call of ``blocks`` x 16 rows, one K slice, built for sm_90."""
    n, k = shape
    fmt = IntPacked(bits=bits, group=64)
    per_word = 32 // bits
    bk = max(tile.bk, 16 * per_word)
    tensors = {
        "weight_packed": torch.zeros(n, k * bits // 32, dtype=torch.int32),
        "weight_scale": torch.zeros(n, k // 64, dtype=torch.bfloat16),
    }
    ptrs, args = int_rows_launch.int_rows_operands(fmt, tensors, shape)
    x = torch.empty(1, k, dtype=torch.bfloat16)
    const = {name: v for name, v in args.items() if not name.startswith("stride_")}
    const.update(
        SCALE_MODE=int_rows_launch.scale_mode(args, bk, k),
        EVEN_K=k % bk == 0,
        SPLIT=1,
        BLOCKS=blocks,
        BN=tile.bn,
        BKW=bk // per_word,
        DOT_DTYPE=tl.bfloat16,
        DOT_FP32=False,
        INT4_BF16=int_rows_launch.int4_bf16_applies(args, ptrs[1], False, tl.bfloat16),
        X_BY_POSITION=0 < int_rows_launch.x_step_order_blocks(tile, per_word) <= blocks,
        ONE_DOT=tile.one_dot and blocks > 1,
    )
    tensors_by_name = dict(zip(("w_ptr", "s_ptr", "z_ptr", "gidx_ptr", "levels_ptr"), ptrs, strict=True))
    tensors_by_name.update(x_ptr=x, out_ptr=x, ws_ptr=torch.empty(1, dtype=torch.float32))
    names = kernel.arg_names
    sig = {
        name: POINTER_KINDS[tensors_by_name[name].dtype]
        if name in tensors_by_name
        else ("constexpr" if name in const else "i32")
        for name in names
    }
    # what the launcher's specialization sees: 16-byte aligned pointers, sizes/strides multiples of 16 (not M)
    attrs = {
        (names.index(n),): [["tt.divisibility", 16]] for n in names if sig[n] != "constexpr" and n != "M"
    }
    src = ASTSource(kernel, sig, constexprs={(names.index(c),): v for c, v in const.items()}, attrs=attrs)
    options = {"num_warps": tile.warps, "num_stages": tile.stages}
    return triton.compile(src, target=GPUTarget("cuda", 90, 32), options=options), tile.bn * bk // (
        32 * tile.warps
    )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--bits", default="4,8")
    parser.add_argument("--blocks", default="1,4")
    parser.add_argument("--shape", default="6144,6144")
    parser.add_argument("--tile", default="64,128,4,3", help="BN,BK,warps,stages")
    parser.add_argument(
        "--x-in-step-order",
        type=int,
        default=None,
        help="row blocks from which x is read in step order (0: never, 1: always; default: the codes' default)",
    )
    parser.add_argument("--one-dot", action="store_true", help="the row blocks in one dot (``one_dot``)")
    args = parser.parse_args()
    shape = tuple(int(v) for v in args.shape.split(","))
    bn, bk, warps, stages = (int(v) for v in args.tile.split(","))
    tile = int_rows_launch.IntRowsTile(
        bn=bn, bk=bk, warps=warps, stages=stages, x_in_step_order=args.x_in_step_order, one_dot=args.one_dot
    )
    for bits in (int(b) for b in args.bits.split(",")):
        for blocks in (int(b) for b in args.blocks.split(",")):
            compiled, weights = compile_tile(bits, shape, tile, blocks)  # type: ignore[arg-type]
            print(f"int{bits} blocks={blocks} {tile}  {loop_summary(compiled, weights)}", flush=True)


if __name__ == "__main__":
    main()
