"""The split decode attention kernels (``dgpp.kernels.paged_attention``) compiled for sm_90 ahead of time, on a
machine without a GPU (Triton's NVIDIA backend ships ptxas/nvdisasm). Not a test: every variant the engine
launches (with and without sinks, bf16 or e4m3 K/V, one split or a merge, per-row token lists) must compile, and
this shows what each costs in SASS before a GPU run:

    PYTHONPATH=dgpp-core/src:tests/perf python3 tests/perf/sass_paged_attention.py

One line per variant at the full-attention head shapes of MiMo-V2.6-Flash (64 query heads over 4 KV heads,
q/k 192, v 128) and Flint (32 over 4, 128), and with token lists (``positions``) at Qwen3.8-Flash-Next's QSA
shape (24 over 2, 256): SASS instruction counts, loads by width, registers/stack per thread.
"""

from __future__ import annotations

import itertools

import triton
from sass_quant_gemv import sass_summary
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource

from dgpp.kernels.paged_attention import _WIDE_HEADS, _decode_partition_kernel, _merge_partitions_kernel

SHAPES = {"mimo-v2.6 full": (16, 192, 128), "flint full": (8, 128, 128)}  # (query heads per KV head, D, Dv)
LIST_SHAPES = {"qwen3.8-flash-next qsa": (12, 256, 256)}  # attended through per-row token lists
# integer arguments the launcher does not see as multiples of 16 (the rest are sizes and strides that are)
NOT_ALIGNED = {"window", "group", "num_splits", "grid_splits", "num_heads"}


def compile_sm90(
    kernel, pointers: dict[str, str], constexprs: dict[str, object], warps: int = 4, stages: int = 3
):
    names = kernel.arg_names
    sig = {n: pointers.get(n, "constexpr" if n in constexprs else "i32") for n in names}
    attrs = {
        (names.index(n),): [["tt.divisibility", 16]]
        for n in names
        if sig[n] not in ("constexpr", "fp32") and n not in NOT_ALIGNED
    }
    constants = {(names.index(k),): v for k, v in constexprs.items()}
    src = ASTSource(kernel, sig, constexprs=constants, attrs=attrs)
    return triton.compile(
        src, target=GPUTarget("cuda", 90, 32), options={"num_warps": warps, "num_stages": stages}
    )


def main() -> None:
    variants = itertools.product(SHAPES.items(), (False, True), (False, True), (False, True), (False,))
    lists = itertools.product(LIST_SHAPES.items(), (False,), (False,), (False, True), (True,))
    for (name, (group, dim, v_dim)), sinks, fp8, one_split, listed in itertools.chain(variants, lists):
        kv = "*i32" if fp8 else "*bf16"  # e4m3 rows are read as int32 words of four codes
        pointers = {
            **dict.fromkeys(("q_ptr", "sink_ptr", "out_ptr"), "*bf16"),
            **dict.fromkeys(("k_ptr", "v_ptr"), kv),
            **dict.fromkeys(("ksc_ptr", "vsc_ptr", "part_acc_ptr", "part_ml_ptr"), "*fp32"),
            **dict.fromkeys(("bt_ptr", "lens_ptr", "pos_ptr"), "*i32"),
            "scale": "fp32",
        }
        constexprs = {
            "BLOCK_N": 64,
            "BLOCK_G": max(16, triton.next_power_of_2(group)),
            "BLOCK_D": triton.next_power_of_2(dim),
            "BLOCK_DV": triton.next_power_of_2(v_dim),
            "BLOCK_SIZE": 16,
            "ONE_SPLIT": one_split,
            "PRECISION": "tf32",
            "HAS_SCALES": fp8,
            "HAS_SINKS": sinks,
            "HAS_POSITIONS": listed,
        }
        wide = (
            constexprs["BLOCK_D"] + constexprs["BLOCK_DV"] >= _WIDE_HEADS
        )  # as the launcher picks its warps
        compiled = compile_sm90(_decode_partition_kernel, pointers, constexprs, warps=8 if wide else 4)
        print(
            f"{name}: sinks={sinks} fp8={fp8} one_split={one_split} positions={listed}\n    "
            f"{sass_summary(compiled)}",
            flush=True,
        )
    merge = compile_sm90(
        _merge_partitions_kernel,
        {"part_acc_ptr": "*fp32", "part_ml_ptr": "*fp32", "lens_ptr": "*i32", "out_ptr": "*bf16"},
        {"BLOCK_N": 64, "BLOCK_S": 32, "BLOCK_DV": 128},
    )
    print(f"merge, 32 splits, Dv 128\n    {sass_summary(merge)}", flush=True)


if __name__ == "__main__":
    main()
