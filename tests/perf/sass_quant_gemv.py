"""Instruction mix of the packed decode GEMV tiles on sm_90, compiled ahead of time on a machine without
a GPU (Triton's NVIDIA backend ships ptxas/nvdisasm). Not a test: a way to see, before a GPU run, what a
tile costs per K step (conversion-pipe F2F, byte-wise shared stores, register spills, cp.async widths).
Compile with the device's Triton to see what it will run, e.g. a Triton 3.6 wheel unpacked to /tmp/t36:

    PYTHONPATH=/tmp/t36:dgpp-core/src:tests/perf python3 tests/perf/sass_quant_gemv.py [--formats nvfp4,fp8_block]

One line per tile (the default of the o_proj shape, then bench_quant_gemv's sweep): SASS instruction
counts of the whole kernel, and the registers/stack per thread. ``--batch``: the K loop of the decode tile at 16
rows and of each 64-row candidate at 64 rows, per decoded weight and thread (instructions, shared-memory bytes),
and how many instructions separate a global scale load from its first use. ``--x-split step|launch``: the FP4 tiles
split x's even and odd columns in every K step, or read x split once per launch (``GemvTile.x_split``).
"""

from __future__ import annotations

import argparse
import collections
import dataclasses
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


def compile_tile(fmt, tile, shape: tuple[int, int], rows: int = 1):
    """The q/k/v-style kernel for one weight of ``shape`` with ``tile``'s constexprs for a call of ``rows`` x rows
    (above 16: 64-row blocks, ``tile.row_blocks`` of them per program), built for sm_90."""
    import triton
    from bench_quant_gemv import random_weight
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    from dgpp.quant.kernels.decode_gemv import quant_multi_gemv_kernel as kernel
    from dgpp.quant.kernels.decode_launch import _launch_args
    from dgpp.quant.kernels.operands import operand as _operand

    x = torch.empty(rows, shape[1], dtype=torch.bfloat16)
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


def _disassemble(compiled) -> tuple[str, str]:
    """(SASS text, resource usage) of a compiled kernel, by the nvdisasm / cuobjdump Triton ships."""
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
    return sass, usage


LDS_BYTES = {"LDS": 4, "LDS.U8": 1, "LDS.U16": 2, "LDS.64": 8, "LDS.128": 16}
LDSM_BYTES = {".M88": 4, ".M88.2": 8, ".M88.4": 16}


def main_loop(sass: str) -> list[str]:
    """The instructions of the K loop (predicate dropped): the longest range that a backward branch closes."""
    addr_of, pending, code = {}, [], []
    for line in sass.splitlines():
        label = re.match(r"^\s*(\.L_x_\d+):", line)
        if label:
            pending.append(label.group(1))
            continue
        ins = re.match(r"^\s+/\*([0-9a-f]+)\*/\s+(.*?)\s*;", line)
        if ins:
            addr = int(ins.group(1), 16)
            addr_of.update({name: addr for name in pending})
            pending = []
            code.append((addr, ins.group(2)))
    best = (0, -1)
    for addr, text in code:
        target = re.search(r"BRA.*?(\.L_x_\d+)", text)
        if target and addr_of.get(target.group(1), addr + 1) <= addr:
            start = addr_of[target.group(1)]
            if addr - start > best[1] - best[0]:
                best = (start, addr)
    return [re.sub(r"^@!?U?P\w+\s+", "", text) for addr, text in code if best[0] <= addr <= best[1]]


def _registers(operand: str) -> set[int]:
    """General registers an operand names (``R12.64`` is R12-R13; a 64/128-bit load's destination 2 or 4)."""
    regs = set()
    for base, wide in re.findall(r"\bR(\d+)(\.64)?", operand):
        width = 2 if wide else 1
        regs.update(int(base) + i for i in range(width))
    return regs


def global_load_cover(loop: list[str]) -> int | None:
    """Of the K loop's global loads (``LDG``, not async copies) read in their own trip, the fewest instructions
    between a load and the first read of its result: the work that hides its latency, so a small number means
    every trip waits on global memory. None when no global load is read in its own trip."""
    stores = ("ST", "RED", "ATOM", "BAR", "BRA", "LDGSTS", "DEPBAR", "LDGDEPBAR", "WARPSYNC", "NOP")
    cover = None
    for i, ins in enumerate(loop):
        opcode, _, rest = ins.partition(" ")
        if not opcode.startswith("LDG.") or opcode.startswith(("LDGSTS", "LDGDEPBAR")):
            continue
        width = {"64": 2, "128": 4}.get(opcode.rsplit(".", 1)[-1], 1)
        first = int(re.match(r"R(\d+)", rest.strip()).group(1))
        live = {first + j for j in range(width)}
        for distance, later in enumerate(loop[i + 1 :], 1):
            op, _, args = later.partition(" ")
            operands = [a.strip() for a in args.split(",")]
            sources = operands if op.startswith(stores) else operands[1:]
            if live & set().union(*(_registers(a) for a in sources)):
                cover = distance if cover is None else min(cover, distance)
                break
            if not op.startswith(stores):
                live -= _registers(operands[0])
            if not live:
                break
    return cover


def loop_summary(compiled, weights_per_thread: int) -> str:
    """The K loop per thread: instructions per weight decoded (``weights_per_thread`` per trip), shared-memory
    bytes loaded per weight (x operands re-read by every warp show up here), how much work covers a global load
    read in its own trip (``global_load_cover``), the mix, registers and stack."""
    sass, usage = _disassemble(compiled)
    loop = main_loop(sass)
    ops = [ins.split()[0] for ins in loop]
    base = collections.Counter(o.split(".")[0] for o in ops)
    lds = sum(LDS_BYTES.get(o, 0) for o in ops) + sum(
        v for o in ops if o.startswith("LDSM") for k, v in LDSM_BYTES.items() if o.endswith(k)
    )
    regs = re.search(r"REG:(\d+) STACK:(\d+)", usage)
    top = " ".join(f"{k}={v}" for k, v in base.most_common(9))
    per = len(ops) / weights_per_thread
    return (
        f"loop={len(ops)} per_weight={per:.2f} lds_B_per_weight={lds / weights_per_thread:.2f} "
        f"ldg_cover={global_load_cover(loop)} {top} "
        f"regs={regs.group(1)} stack={regs.group(2)}"
    )


def sass_summary(compiled) -> str:
    sass, usage = _disassemble(compiled)
    ops = re.findall(r"^\s+/\*[0-9a-f]+\*/\s+(?:@!?U?P\w+\s+)?([A-Z][A-Z0-9_.]*)", sass, re.M)
    base = collections.Counter(o.split(".")[0] for o in ops)
    narrow = collections.Counter(
        o for o in ops if re.match(r"(STS|LDS|LDG)\.(E\.)?U(8|16)$", o) or o.startswith("LDGSTS")
    )
    regs = re.search(r"REG:(\d+) STACK:(\d+)", usage)
    counts = " ".join(f"{k}={base[k]}" for k in SHOWN if base[k])
    return f"sass={len(ops)} {counts} mem={dict(narrow)} regs={regs.group(1)} stack={regs.group(2)}"


def batch_loops(name: str, shape: tuple[int, int], x_split: str | None = None) -> None:
    """The decode tile at 16 rows and every 64-row candidate (``batch_candidates``) at 64 rows: the K loop's
    instructions and shared-memory bytes per decoded weight, per thread."""
    from bench_quant_gemv import formats

    from dgpp.quant.kernels.decode_launch import batch_candidates, default_tile

    fmt = formats()[name]
    tile = default_tile(fmt, shape[0], shape[1], 132)
    for label, t, rows in [("decode16", tile, 16)] + [
        (f"batch{i}", c, 64) for i, c in enumerate(batch_candidates(fmt, tile, shape))
    ]:
        if x_split:
            t = dataclasses.replace(t, x_split=x_split)
        try:
            line = loop_summary(compile_tile(fmt, t, shape, rows), t.bn * t.bk // (32 * t.warps))
        except Exception as e:  # a tile that does not compile is reported, not fatal
            line = f"does not compile: {type(e).__name__}: {str(e)[:160]}"
        print(f"{name:10s} {label:8s} {t}\n    {line}", flush=True)


def main() -> None:
    from bench_quant_gemv import formats, sweep_tiles

    from dgpp.quant.kernels import default_tile

    ap = argparse.ArgumentParser()
    ap.add_argument("--formats", default="fp8_block,nvfp4,mxfp4")
    ap.add_argument("--shape", default="4096,4096", help="N,K of the weight (default: Qwen3-8B o_proj)")
    ap.add_argument(
        "--batch", action="store_true", help="K-loop cost per weight of the decode and 64-row tiles"
    )
    ap.add_argument("--x-split", choices=("step", "launch"), help="GemvTile.x_split of every tile (FP4)")
    args = ap.parse_args()
    shape = tuple(int(v) for v in args.shape.split(","))
    for name in args.formats.split(","):
        if args.batch:
            batch_loops(name, shape, args.x_split)
            continue
        fmt = formats()[name]
        for tile in [default_tile(fmt, shape[0], shape[1])] + sweep_tiles(name, "small"):
            if args.x_split:
                tile = dataclasses.replace(tile, x_split=args.x_split)
            try:
                line = sass_summary(compile_tile(fmt, tile, shape))
            except Exception as e:  # a tile that does not compile is reported, not fatal
                line = f"does not compile: {type(e).__name__}: {str(e)[:160]}"
            print(f"{name:10s} {tile}\n    {line}", flush=True)


if __name__ == "__main__":
    main()
