"""Instruction mix of the decode attention tiles that read K/V (bf16, and e4m3 with row scales) on sm_90,
compiled ahead of time on a machine without a GPU. Not a test: a way to see, before a GPU run, how a tile reads
its K/V (byte-wise shared loads ``LDS.U8``, cp.async widths), what the dequantization costs (``F2FP``, ``F2F``)
and how many registers it needs. Run from the repository root without ``TRITON_INTERPRET``:

    PYTHONPATH=dgpp-core/src:tests/perf python3 tests/perf/sass_kv_attention.py [--stages 1,2,3] [--dump DIR]

Two lines per (kernel, K/V dtype, warps, stages), with Qwen3-8B's tile (128-wide heads, 4 query heads per KV
head padded to 16): the whole kernel's counts and registers, then the instruction mix of the loop that reads one
64-token K/V tile per trip. ``--dump DIR`` also writes each variant's PTX and cubin there.
"""

from __future__ import annotations

import argparse
import collections
import glob
import os
import re
import subprocess
import tempfile

from sass_paged_attention import compile_sm90
from sass_quant_gemv import sass_summary

LOOP_SHOWN = ("LOP3", "SHF", "PRMT", "IMAD", "FMUL", "HADD2", "F2FP", "MOV", "HMMA")


def loop_summary(compiled) -> str:
    """Instruction mix of the innermost loop holding the MMAs (one K/V tile per trip): its length, the decode's
    integer, multiply and conversion instructions, and its shared-memory reads by width."""
    import triton

    tools = os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin")
    with tempfile.NamedTemporaryFile(suffix=".cubin", delete=False) as f:
        f.write(compiled.asm["cubin"])
    lines = subprocess.run(
        [glob.glob(f"{tools}/nvdisasm")[0], "-c", f.name], capture_output=True, text=True
    ).stdout.splitlines()
    os.unlink(f.name)
    labels: dict[str, int] = {}
    ops: list[tuple[str, str]] = []
    for line in lines:
        label = re.match(r"^\.(L_x_\d+):", line.strip())
        if label:
            labels[label.group(1)] = len(ops)
        op = re.match(r"^\s+/\*[0-9a-f]+\*/\s+(?:@!?U?P\w+\s+)?([A-Z][A-Z0-9_.]*)(.*)", line)
        if op:
            ops.append((op.group(1), op.group(2)))
    loops = []
    for end, (op, rest) in enumerate(ops):
        target = re.search(r"`\(\.(L_x_\d+)\)", rest)
        start = labels.get(target.group(1), end) if op == "BRA" and target else end
        if start < end and any(o.startswith("HMMA") for o, _ in ops[start:end]):
            loops.append(ops[start : end + 1])
    if not loops:
        return "loop=none"
    body = min(loops, key=len)
    base = collections.Counter(o.split(".")[0] for o, _ in body)
    shared = collections.Counter(o for o, _ in body if o.startswith(("LDS", "LDSM")))
    counts = " ".join(f"{k}={base[k]}" for k in LOOP_SHOWN if base[k])
    return f"loop={len(body)} {counts} shared={dict(shared)}"


def variants():
    """(name, kernel, pointer types, constexprs) of the paged decode kernel and the window kernel's sources."""
    from dgpp.kernels.paged_attention import _decode_partition_kernel
    from dgpp.kernels.window_attention import _window_attention_kernel

    tile = dict(BLOCK_G=16, BLOCK_D=128, BLOCK_DV=128, PRECISION="tf32")
    for fp8 in (False, True):
        kv = "*i32" if fp8 else "*bf16"  # e4m3 rows are read as int32 words of four codes
        common = {
            "ksc_ptr": "*fp32",
            "vsc_ptr": "*fp32",
            "out_ptr": "*bf16",
            "q_ptr": "*bf16",
            "scale": "fp32",
        }
        paged = {
            **common,
            "k_ptr": kv,
            "v_ptr": kv,
            "bt_ptr": "*i32",
            "lens_ptr": "*i32",
            "pos_ptr": "*i32",
            "sink_ptr": "*bf16",
            "part_acc_ptr": "*fp32",
            "part_ml_ptr": "*fp32",
        }
        consts = dict(
            tile,
            BLOCK_N=64,
            BLOCK_SIZE=16,
            ONE_SPLIT=False,
            HAS_SCALES=fp8,
            HAS_SINKS=False,
            HAS_POSITIONS=False,
        )
        yield f"paged {'fp8' if fp8 else 'bf16'}", _decode_partition_kernel, paged, consts
        for source in ("pool", "ring"):
            window = {
                **common,
                "kn_ptr": "*bf16",
                "vn_ptr": "*bf16",
                "ks_ptr": kv,
                "vs_ptr": kv,
                "loc_ptr": "*i32",
                "row_seq_ptr": "*i64",
                "qsl_ptr": "*i32",
                "ctx_ptr": "*i32",
                "lens_ptr": "*i32",
                "sink_ptr": "*bf16",
            }
            consts = dict(tile, BLOCK_N=64, PAGED=source == "pool", HAS_SINKS=True, HAS_SCALES=fp8)
            yield f"window-{source} {'fp8' if fp8 else 'bf16'}", _window_attention_kernel, window, consts


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--stages", default="1,2,3")
    ap.add_argument("--warps", default="4")
    ap.add_argument("--only", default="", help="names containing this string (e.g. 'paged')")
    ap.add_argument("--dump", default="", help="a folder for each variant's SASS")
    args = ap.parse_args()
    for name, kernel, pointers, consts in variants():
        if args.only not in name:
            continue
        for warps in (int(w) for w in args.warps.split(",")):
            for stages in (int(s) for s in args.stages.split(",")):
                compiled = compile_sm90(kernel, pointers, consts, warps, stages)
                print(f"{name:18s} w{warps} s{stages} {sass_summary(compiled)}", flush=True)
                print(f"{'':18s}        {loop_summary(compiled)}", flush=True)
                if args.dump:
                    os.makedirs(args.dump, exist_ok=True)
                    path = os.path.join(args.dump, f"{name.replace(' ', '_')}_w{warps}_s{stages}")
                    with open(path + ".ptx", "w") as f:
                        f.write(compiled.asm["ptx"])
                    with open(path + ".cubin", "wb") as f:
                        f.write(compiled.asm["cubin"])


if __name__ == "__main__":
    main()
