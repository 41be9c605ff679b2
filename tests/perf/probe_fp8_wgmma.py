"""FP8 block-128 weights decoded to bf16 in the K loop and fed to Hopper's wgmma as the A operand (weights as the
MMA's M side, the step's rows as its N side), timed against cuBLAS bf16 and checked for row-exactness.

Two chains (``--chain``):

- ``weight``: w = bf16(fp32(code) * scale) per weight, then one fp32-accumulated bf16 dot over K in a fixed order;
- ``block``: each 128-wide K block's dot from zero on the codes converted to bf16 (exact: every E4M3 value is a
  bf16 value), its fp32 partial times the block's scale added to the accumulator, as the FP8 decode tile
  (``dgpp.quant.kernels.decode_gemv``) computes on ``mma.sync``; here the dot is wgmma, so the question is
  whether one chain can serve 1, 16 and 64 rows at once at the decode tile's speed.

K is split into ``split`` slices by the shape alone, summed in slice order. A row's bits depend on its own x
only when the row tile (``br``) is the same for every call, or when the row tile's width does not enter a column's
sums (the last lines of each shape check that, 16 rows in tiles of ``br`` against tiles of 64).

    python3 tests/perf/probe_fp8_wgmma.py [--chain weight|block]   # on a GPU host, after `source tests/perf/device_env.sh`
"""

from __future__ import annotations

import argparse
import itertools

import torch
import triton
import triton.language as tl
from bench_quant_gemv import copy_bandwidth


@triton.jit
def fp8_block_wgmma_kernel(
    x_ptr,
    w_ptr,
    s_ptr,
    out_ptr,
    m,
    n,
    k,
    s_cols,
    BN: tl.constexpr,
    BR: tl.constexpr,
    BK: tl.constexpr,
    SPLIT: tl.constexpr,
    BLOCK_CHAIN: tl.constexpr = False,
):
    pid_n = tl.program_id(0)
    pid_s = tl.program_id(1)
    pid_r = tl.program_id(2)
    cols = pid_n * BN + tl.arange(0, BN)
    rows = pid_r * BR + tl.arange(0, BR)
    row_ok = rows < m
    kk = tl.arange(0, BK)
    k_per = k // SPLIT
    acc = tl.zeros([BN, BR], tl.float32)
    for k0 in range(pid_s * k_per, (pid_s + 1) * k_per, BK):
        codes = tl.load(w_ptr + cols[:, None].to(tl.int64) * k + (k0 + kk)[None, :])
        s = tl.load(s_ptr + (cols // 128) * s_cols + k0 // 128)
        x = tl.load(x_ptr + rows[:, None] * k + (k0 + kk)[None, :], mask=row_ok[:, None], other=0.0)
        if BLOCK_CHAIN:  # BK == 128: one scale block a step, its dot from zero
            w = codes.to(tl.float8e4nv, bitcast=True).to(tl.bfloat16)
            acc += tl.dot(w, tl.trans(x)) * s[:, None]
        else:
            w = (codes.to(tl.float8e4nv, bitcast=True).to(tl.float32) * s[:, None]).to(tl.bfloat16)
            acc = tl.dot(w, tl.trans(x), acc)
    out = out_ptr + pid_s * m * n + rows[None, :] * n + cols[:, None]
    tl.store(out, acc, mask=row_ok[None, :])


def fp8_block_wgmma(x, w, s, cfg, partials=None, block_chain=False):
    m, k = x.shape
    n = w.shape[0]
    bn, br, bk, split, warps, stages = cfg
    if partials is None:
        partials = torch.empty(split, m, n, device=x.device, dtype=torch.float32)
    grid = (n // bn, split, triton.cdiv(m, br))
    fp8_block_wgmma_kernel[grid](
        x,
        w,
        s,
        partials,
        m,
        n,
        k,
        s.shape[1],
        BN=bn,
        BR=br,
        BK=bk,
        SPLIT=split,
        BLOCK_CHAIN=block_chain,
        num_warps=warps,
        num_stages=stages,
    )
    out = partials[0]
    for i in range(1, split):
        out = out + partials[i]
    return out.to(torch.bfloat16)


def decode(w, s):
    n, k = w.shape
    full = s.repeat_interleave(128, 0)[:n].repeat_interleave(128, 1)[:, :k]
    return (w.view(torch.float8_e4m3fn).float() * full).to(torch.bfloat16)


def random_fp8(n, k, gen, device):
    w = (torch.randn(n, k, generator=gen, device=device) * 100).clamp(-440, 440).to(torch.float8_e4m3fn)
    s = torch.rand(n // 128, k // 128, generator=gen, device=device) * 1e-4 + 1e-5
    return w.view(torch.uint8), s


def bench_us(fn, reps=50):
    return triton.testing.do_bench(fn, warmup=10, rep=reps, return_mode="median") * 1e3


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--shapes", default="24576x4096,6144x4096,4096x12288,4096x4096")
    p.add_argument("--rows", default="1,16,64,128")
    p.add_argument("--configs", default="")
    p.add_argument("--chain", choices=("weight", "block"), default="weight")
    a = p.parse_args()
    chain = a.chain == "block"

    def run(x, w, s, cfg, partials=None):
        return fp8_block_wgmma(x, w, s, cfg, partials, chain)

    dev = torch.device("cuda")
    gen = torch.Generator(device=dev).manual_seed(0)
    copies = 4
    cfgs = (
        [tuple(int(v) for v in c.split(":")) for c in a.configs.split(",")]
        if a.configs
        else [
            (bn, br, bk, sp, wp, st)
            for bn, br, bk, sp, wp, st in itertools.product((64, 128), (64,), (128,), (1, 2), (4, 8), (3, 4))
            if not (bn == 64 and wp == 8)
        ]
        + [(128, 16, 128, 1, 4, 4), (128, 32, 128, 1, 4, 4), (256, 64, 128, 1, 8, 3)]
        + ([(128, 16, 128, 1, 4, 6), (256, 16, 128, 1, 8, 4), (128, 16, 128, 2, 4, 5)] if chain else [])
    )
    props = torch.cuda.get_device_properties(dev)
    print(
        f"chain {a.chain}, device {props.name}, {props.multi_processor_count} SMs, torch {torch.__version__}, triton {triton.__version__}"
    )
    bw = copy_bandwidth(dev) / 1e9  # GB/s, printed
    for shape in a.shapes.split(","):
        n, k = (int(v) for v in shape.split("x"))
        ws = [random_fp8(n, k, gen, dev) for _ in range(copies)]
        wb = [decode(w, s) for w, s in ws]
        xs = torch.randn(300, k, generator=gen, device=dev).to(torch.bfloat16)
        ref = (xs.float() @ wb[0].float().T).to(torch.bfloat16)
        fp8_bytes, bf16_bytes = n * k, 2 * n * k
        print(
            f"\n== {n} x {k}: fp8 {fp8_bytes / 1e6:.1f} MB (roofline {fp8_bytes / bw / 1e3:.1f} us), "
            f"bf16 {bf16_bytes / 1e6:.1f} MB ({bf16_bytes / bw / 1e3:.1f} us)"
        )
        for r in (int(v) for v in a.rows.split(",")):
            x = xs[:r].contiguous()
            it = itertools.cycle(range(copies))
            t = bench_us(lambda x=x, it=it, wb=wb: torch.matmul(x, wb[next(it)].T))
            print(f"rows {r:4d} cuBLAS bf16 {t:8.1f} us")
        ran = []
        for cfg in cfgs:
            bn, br, bk, split, warps, stages = cfg
            if n % bn or (k // split) % bk:
                continue
            try:
                got = run(xs, *ws[0], cfg)
            except Exception as e:  # noqa: BLE001 - a config the compiler refuses is reported and skipped
                print(f"cfg {cfg}: {type(e).__name__} {str(e)[:120]}")
                continue
            err = ((got.float() - ref.float()).abs().max() / ref.float().abs().max()).item()
            exact = all(
                torch.equal(run(xs[:c].contiguous(), *ws[0], cfg), got[:c]) for c in (1, 2, 16, 17, 64, 65)
            ) and torch.equal(run(xs[37:38].contiguous(), *ws[0], cfg), got[37:38])
            times = []
            for r in (int(v) for v in a.rows.split(",")):
                x = xs[:r].contiguous()
                part = torch.empty(split, r, n, device=dev, dtype=torch.float32)
                it = itertools.cycle(range(copies))
                times.append(
                    bench_us(lambda x=x, it=it, ws=ws, cfg=cfg, part=part: run(x, *ws[next(it)], cfg, part))
                )
            ran.append(cfg)
            ts = " ".join(f"{t:7.1f}" for t in times)
            print(
                f"cfg bn {bn} br {br} bk {bk} split {split} warps {warps} stages {stages}: err {err:.2e} "
                f"exact {exact} us {ts} (% roofline at rows[0] {100 * fp8_bytes / bw / 1e3 / times[0]:.0f})"
            )
        for cfg in [c for c in ran if c[1] != 64]:  # does the row tile's width change a row's bits?
            wide = (cfg[0], 64, *cfg[2:])
            same = torch.equal(run(xs[:16], *ws[0], cfg), run(xs[:16], *ws[0], wide))
            print(f"cfg {cfg}: 16 rows in row tiles of {cfg[1]} == in row tiles of 64: {same}")


if __name__ == "__main__":
    main()
