"""The kernels that carry DeepSeek-V4's decode glue compiled for sm_90 ahead of time, on a machine without a GPU
(Triton's NVIDIA backend ships ptxas/nvdisasm), at the release's sizes: the fp32-weight RMSNorm (bf16 rows of
4096 / 1024 / 512, fp32 weight, bf16 out) and the hyper-connections' unweighted fp32 norm (16,384 bf16 stream
channels), the trailing rotary with the query's per-head RMS (64 heads of 512, a 64-channel rope slice, no FMA),
the router on bf16 sqrt-softplus logits (256 experts, top 6; learned with a bias, and hashed), the top-k
selection that writes its counts and the expert sum that adds the shared expert. Not a test: each must compile
(with the GPU image's Triton, 3.6, first on the path); it prints SASS size, registers and stack:

    PYTHONPATH=<triton 3.6>:dgpp-core/src:tests/perf python3 tests/perf/sass_deepseek_v4_glue.py
"""

from __future__ import annotations

import importlib

import triton
from sass_quant_gemv import sass_summary
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource

from dgpp.kernels.torch_fp32_math import NO_FMA

# the modules (``dgpp.kernels`` exports functions of the same names)
rmsnorm, router_topk, top_k_rows, trailing_rotary = (
    importlib.import_module(f"dgpp.kernels.{name}")
    for name in ("rmsnorm", "router_topk", "top_k_rows", "trailing_rotary")
)
moe = importlib.import_module("dgpp.kernels.moe")


def compile_sm90(kernel, pointers: dict[str, str], constexprs: dict[str, object], **options):
    names = kernel.arg_names
    sig = {n: pointers.get(n, "constexpr" if n in constexprs else "i32") for n in names}
    attrs = {(names.index(n),): [["tt.divisibility", 16]] for n in names if sig[n].startswith("*")}
    constants = {(names.index(k),): v for k, v in constexprs.items()}
    src = ASTSource(kernel, sig, constexprs=constants, attrs=attrs)
    return triton.compile(src, target=GPUTarget("cuda", 90, 32), options={"num_warps": 4, **options})


def norms() -> None:
    for cols, weighted, out in ((4096, True, "*bf16"), (1024, True, "*bf16"), (512, True, "*bf16")) + (
        (16384, False, "*fp32"),
    ):
        block = triton.next_power_of_2(cols)
        compiled = compile_sm90(
            rmsnorm._rms_norm_kernel,
            {"x_ptr": "*bf16", "res_ptr": "*bf16", "w_ptr": "*fp32", "out_ptr": out, "res_out_ptr": out}
            | {"eps": "fp32", "weight_offset": "fp32"},
            {"HAS_RESIDUAL": False, "HAS_WEIGHT": weighted, "FP32_PRODUCT": True, "BLOCK": block},
            num_warps=min(16, max(1, block // 256)),
        )
        print(f"rms_norm {cols} weighted={weighted} out={out[1:]}: {sass_summary(compiled)}", flush=True)


def rotary() -> None:
    for head_rms in (False, True):
        compiled = compile_sm90(
            trailing_rotary._trailing_rotary_kernel,
            {"x_ptr": "*bf16", "out_ptr": "*bf16", "pos_ptr": "*i64", "freq_ptr": "*fp32"}
            | {"magnitude": "fp32", "rms_eps": "fp32"},
            {"INVERSE": False, "ROUND_ANGLES": True, "HEAD_RMS": head_rms, "BLOCK_HEADS": 16}
            | {"BLOCK_R": 32, "BLOCK_N": trailing_rotary._BLOCK_N},
            **NO_FMA,
        )
        print(f"trailing_rotary 64 x 512 head_rms={head_rms}: {sass_summary(compiled)}", flush=True)


def router() -> None:
    for hashed in (False, True):
        compiled = compile_sm90(
            router_topk._router_topk_kernel,
            {"logits_ptr": "*bf16", "bias_ptr": "*fp32", "weights_ptr": "*bf16", "ids_ptr": "*i64"}
            | {"table_ptr": "*i64", "token_ptr": "*i64", "scale": "fp32"},
            {"TOP_K": 6, "SCORING": 2, "HAS_BIAS": not hashed, "RENORMALIZE": True, "ROUND_SCORES": True}
            | {"HASHED": hashed, "N_GROUP": 1, "TOPK_GROUP": 1, "BLOCK_G": 1, "BLOCK_S": 256, "BLOCK_K": 8},
        )
        print(f"router_topk 256 bf16 sqrt-softplus hashed={hashed}: {sass_summary(compiled)}", flush=True)


def selection() -> None:
    compiled = compile_sm90(
        top_k_rows._top_k_rows_kernel,
        {"scores_ptr": "*fp32", "lens_ptr": "*i32", "out_ptr": "*i32", "count_ptr": "*i32"},
        {"BLOCK": top_k_rows._BLOCK},
    )
    print(f"top_k_rows with counts: {sass_summary(compiled)}", flush=True)


def expert_sum() -> None:
    compiled = compile_sm90(
        moe._sum_experts_kernel,
        {"src_ptr": "*fp32", "add_ptr": "*bf16", "out_ptr": "*bf16"},
        {"ADD": True, "BLOCK": 1024},
    )
    print(f"sum_experts 4096 with the shared expert's add: {sass_summary(compiled)}", flush=True)


if __name__ == "__main__":
    norms()
    rotary()
    router()
    selection()
    expert_sum()
