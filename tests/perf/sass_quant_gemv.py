"""Instruction mix of the packed decode GEMV tiles on sm_90, compiled ahead of time on a machine without
a GPU (Triton's NVIDIA backend ships ptxas/nvdisasm). Not a test: a way to see, before a GPU run, what a
tile costs per K step (conversion-pipe F2F, byte-wise shared stores, register spills, cp.async widths).
Compile with the device's Triton to see what it will run, e.g. a Triton 3.6 wheel unpacked to /tmp/t36:

    PYTHONPATH=/tmp/t36:dgpp-core/src:tests/perf python3 tests/perf/sass_quant_gemv.py [--formats nvfp4,fp8_block]

One line per tile (the default of the o_proj shape, then bench_quant_gemv's sweep): SASS instruction
counts of the whole kernel, and the registers/stack per thread.
"""

from __future__ import annotations

import argparse
import collections
import glob
import os
import re
import subprocess
import tempfile

import torch

POINTER_KINDS = {
    torch.uint8: "*u8",
    torch.float32: "*fp32",
    torch.bfloat16: "*bf16",
    torch.float16: "*fp16",
    torch.int32: "*i32",
}
SHOWN = ("PRMT", "LOP3", "SHF", "IMAD", "F2F", "F2FP", "HMUL2", "HMMA", "HGMMA", "BAR")


def compile_tile(fmt, tile, shape: tuple[int, int]):
    """The q/k/v-style kernel for one weight of ``shape`` with ``tile``'s constexprs, built for sm_90."""
    import triton
    from bench_quant_gemv import random_weight
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    from dgpp.quant.kernels.decode_gemv import quant_multi_gemv_kernel as kernel
    from dgpp.quant.kernels.decode_launch import _launch_args
    from dgpp.quant.kernels.operands import operand as _operand

    x = torch.empty(1, shape[1], dtype=torch.bfloat16)
    args = _launch_args(fmt, tile, [shape], x, tile.bk)
    options = {"num_warps": args.pop("num_warps"), "num_stages": args.pop("num_stages")}
    w, s, g = _operand(fmt, random_weight(fmt, shape, "cpu", torch.Generator().manual_seed(0)))
    ptrs = {"x_ptr": x, "out_ptr": x, "ws_ptr": g.float(), "cnt_ptr": torch.empty(1, dtype=torch.int32)}
    for i in range(3):
        ptrs.update({f"w{i}": w, f"s{i}": s, f"g{i}": g})
    names = kernel.arg_names
    sig = {
        n: POINTER_KINDS[ptrs[n].dtype] if n in ptrs else ("constexpr" if n in args else "i32") for n in names
    }
    # what the launcher's specialization sees: 16-byte aligned pointers, sizes/strides multiples of 16 (not m)
    attrs = {
        (names.index(n),): [["tt.divisibility", 16]] for n in names if sig[n] != "constexpr" and n != "m"
    }
    src = ASTSource(kernel, sig, constexprs={(names.index(k),): v for k, v in args.items()}, attrs=attrs)
    return triton.compile(src, target=GPUTarget("cuda", 90, 32), options=options)


def sass_summary(compiled) -> str:
    import triton

    tools = os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin")
    with tempfile.NamedTemporaryFile(suffix=".cubin", delete=False) as f:
        f.write(compiled.asm["cubin"])
    sass = subprocess.run(
        [glob.glob(f"{tools}/nvdisasm")[0], "-c", f.name], capture_output=True, text=True
    ).stdout
    usage = subprocess.run(
        [glob.glob(f"{tools}/cuobjdump")[0], "-res-usage", f.name], capture_output=True, text=True
    ).stdout
    os.unlink(f.name)
    ops = re.findall(r"^\s+/\*[0-9a-f]+\*/\s+(?:@!?U?P\w+\s+)?([A-Z][A-Z0-9_.]*)", sass, re.M)
    base = collections.Counter(o.split(".")[0] for o in ops)
    narrow = collections.Counter(
        o for o in ops if re.match(r"(STS|LDS|LDG)\.(E\.)?U(8|16)$", o) or o.startswith("LDGSTS")
    )
    regs = re.search(r"REG:(\d+) STACK:(\d+)", usage)
    counts = " ".join(f"{k}={base[k]}" for k in SHOWN if base[k])
    return f"sass={len(ops)} {counts} mem={dict(narrow)} regs={regs.group(1)} stack={regs.group(2)}"


def main() -> None:
    from bench_quant_gemv import formats, sweep_tiles

    from dgpp.quant.kernels import default_tile

    ap = argparse.ArgumentParser()
    ap.add_argument("--formats", default="fp8_block,nvfp4,mxfp4")
    ap.add_argument("--shape", default="4096,4096", help="N,K of the weight (default: Qwen3-8B o_proj)")
    args = ap.parse_args()
    shape = tuple(int(v) for v in args.shape.split(","))
    for name in args.formats.split(","):
        fmt = formats()[name]
        for tile in [default_tile(fmt, shape[0], shape[1])] + sweep_tiles(name, "small"):
            try:
                line = sass_summary(compile_tile(fmt, tile, shape))
            except Exception as e:  # a tile that does not compile is reported, not fatal
                line = f"does not compile: {type(e).__name__}: {str(e)[:160]}"
            print(f"{name:10s} {tile}\n    {line}", flush=True)


if __name__ == "__main__":
    main()
