"""Every launch variant of the dense decode GEMV (``dgpp.kernels.gemv``: linears and gate/up pairs) that
``bench_dense_gemv``'s shapes take on an
H100 / H200 (132 SMs), compiled for sm_90 ahead of time on a machine without a GPU (the interpreter accepts what
the compiler may reject): the unsplit kernels and the split-K ones, for the 16-, 32- and 64-row classes and the
fixed-order calls' 64-row blocks, in bf16 and fp32. Not a test. One line per distinct variant: its constexprs,
then the SASS summary of ``sass_quant_gemv`` (instruction counts, registers, stack).

    PYTHONPATH=dgpp-core/src:tests/perf python3 tests/perf/sass_dense_gemv.py [--sms 132]
"""

from __future__ import annotations

import argparse

import torch
from bench_dense_gemv import SHAPES, entries
from sass_quant_gemv import sass_summary

ROW_COUNTS = (1, 20, 40, 200)  # the 16-, 32- and 64-row classes, and a fixed-order call of 64-row blocks
POINTERS = {torch.bfloat16: "*bf16", torch.float32: "*fp32"}


def compile_variant(pair: bool, split: int, dtype: torch.dtype, bm: int, bn: int, bk: int, stages: int):
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    from dgpp.kernels import gemv

    if pair:
        kernel = gemv._gate_up_silu_split_kernel if split > 1 else gemv._gate_up_silu_kernel
    else:
        kernel = gemv._multi_linear_split_kernel if split > 1 else gemv._multi_linear_kernel
    consts: dict = {"BM": bm, "BN": bn, "BK": bk, "PRECISION": "ieee" if dtype == torch.float32 else "tf32"}
    if split > 1:
        consts["SPLIT"] = split
    names = kernel.arg_names
    kinds = {"ws_ptr": "*fp32", "cnt_ptr": "*i32"}
    sig = {
        n: kinds.get(n, POINTERS[dtype]) if n.endswith("_ptr") else "constexpr" if n in consts else "i32"
        for n in names
    }
    # what the launcher's specialization sees: 16-byte aligned pointers, sizes and strides multiples of 16 (not m)
    attrs = {
        (names.index(n),): [["tt.divisibility", 16]] for n in names if sig[n] != "constexpr" and n != "m"
    }
    src = ASTSource(kernel, sig, constexprs={(names.index(k),): v for k, v in consts.items()}, attrs=attrs)
    return triton.compile(
        src, target=GPUTarget("cuda", 90, 32), options={"num_warps": 4, "num_stages": stages}
    )


def main() -> None:
    from dgpp.kernels.gemv import MAX_ROWS, gate_up_silu_plan, multi_linear_plan

    ap = argparse.ArgumentParser()
    ap.add_argument("--sms", type=int, default=132)
    args = ap.parse_args()
    seen = set()
    for geometry in SHAPES:
        for _, sizes, k, dtype, _, pair in entries(geometry):
            for m in ROW_COUNTS:
                bm = 64 if m > MAX_ROWS else None  # the fixed-order calls' row block above 64 rows
                elem = torch.empty(0, dtype=dtype).element_size()
                if pair:
                    plan = gate_up_silu_plan(m, sizes[0], k, elem, bm=bm, sms=args.sms)
                else:
                    plan = multi_linear_plan(m, list(sizes), k, elem, bm=bm, sms=args.sms)
                seen.add((pair, plan[4], dtype, *plan[:4]))
    failed = 0
    for pair, split, dtype, bm, bn, bk, stages in sorted(seen, key=str):
        kind = "gate/up" if pair else "linear"
        label = f"{kind:7s} split={split:2d} {str(dtype)[6:]:8s} BM={bm} BN={bn} BK={bk} stages={stages}"
        try:
            line = sass_summary(compile_variant(pair, split, dtype, bm, bn, bk, stages))
        except Exception as e:  # reported, then counted: every variant must compile
            failed += 1
            line = f"does not compile: {type(e).__name__}: {str(e)[:200]}"
        print(f"{label}\n    {line}", flush=True)
    print(f"{len(seen) - failed} of {len(seen)} variants compile for sm_90", flush=True)


if __name__ == "__main__":
    main()
