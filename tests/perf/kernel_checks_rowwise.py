"""Row-local kernels at real sizes on the GPU: add + RMS norm, rotary, q/k norm + rotary, SiLU x mul, the paged
K/V write and the sampler."""

# ruff: noqa: B023  (each timing lambda runs before its loop variables move on)

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from kernel_checks_record import BF16, DEV, record, rel_err

from dgpp.kernels import kv_write, qk_norm_rope, rmsnorm, rotary, sampling, swiglu


def check_rmsnorm() -> None:
    for rows in (1, 64, 8192):
        x, r = (
            torch.randn(rows, 4096, device=DEV, dtype=BF16),
            torch.randn(rows, 4096, device=DEV, dtype=BF16),
        )
        w = torch.randn(4096, device=DEV, dtype=BF16)
        out, res = rmsnorm.rms_norm_triton(x, w, 1e-6, r)
        ref_out, ref_res = rmsnorm.rms_norm_ref(x.float(), w.float(), 1e-6, r.float())
        err = max(rel_err(out, ref_out), rel_err(res, ref_res))
        record(
            f"add+rmsnorm bf16 [{rows},4096]",
            err,
            1e-2,
            lambda: rmsnorm.rms_norm_triton(x, w, 1e-6, r),
            lambda: rmsnorm.rms_norm_ref(x, w, 1e-6, r),
            4 * x.numel() * 2,
        )


def check_rotary_swiglu_kvwrite() -> None:
    for t in (1, 64, 8192):
        q = torch.randn(t, 32, 128, device=DEV, dtype=BF16)
        k = torch.randn(t, 8, 128, device=DEV, dtype=BF16)
        pos = torch.randint(0, 40000, (t,), device=DEV)
        inv = 1.0 / 1e6 ** (torch.arange(0, 128, 2, device=DEV, dtype=torch.float32) / 128)
        qo, ko = rotary.rotary_triton(q, k, pos, inv)
        qr, kr = rotary.rotary_ref(q.float(), k.float(), pos, inv)
        record(
            f"rotary bf16 T={t} 32/8x128",
            max(rel_err(qo, qr), rel_err(ko, kr)),
            1e-2,
            lambda: rotary.rotary_triton(q, k, pos, inv),
            lambda: rotary.rotary_ref(q, k, pos, inv),
            2 * (q.numel() + k.numel()) * 2,
        )
        qw, kw = torch.randn(128, device=DEV, dtype=BF16), torch.randn(128, device=DEV, dtype=BF16)
        qo, ko = qk_norm_rope.qk_norm_rope_triton(q, k, qw, kw, 1e-6, 0.0, pos, inv)
        qr, kr = qk_norm_rope.qk_norm_rope_ref(
            q.float(), k.float(), qw.float(), kw.float(), 1e-6, 0.0, pos, inv
        )
        record(
            f"q/k norm+rotary bf16 T={t} 32/8x128",
            max(rel_err(qo, qr), rel_err(ko, kr)),
            1e-2,
            lambda: qk_norm_rope.qk_norm_rope_triton(q, k, qw, kw, 1e-6, 0.0, pos, inv),
            lambda: qk_norm_rope.qk_norm_rope_ref(q, k, qw, kw, 1e-6, 0.0, pos, inv),
            2 * (q.numel() + k.numel()) * 2,
        )
        gate, up = (
            torch.randn(t, 12288, device=DEV, dtype=BF16),
            torch.randn(t, 12288, device=DEV, dtype=BF16),
        )
        out = swiglu.silu_mul_pair_triton(gate, up)
        record(
            f"silu*mul bf16 [{t},12288]",
            rel_err(out, F.silu(gate.float()) * up.float()),
            1e-2,
            lambda: swiglu.silu_mul_pair_triton(gate, up),
            lambda: F.silu(gate) * up,
            3 * gate.numel() * 2,
        )
    kc = torch.randn(4096, 16, 8, 128, device=DEV, dtype=BF16)
    vc = torch.randn_like(kc)
    k, v = torch.randn(64, 8, 128, device=DEV, dtype=BF16), torch.randn(64, 8, 128, device=DEV, dtype=BF16)
    slots = torch.randperm(4096 * 16, device=DEV)[:64]
    slots[5] = -1
    kc2, vc2 = kc.clone(), vc.clone()
    kv_write.write_kv_triton(kc, vc, k, v, slots)
    kv_write.write_kv_ref(kc2, vc2, k, v, slots)
    err = 0.0 if torch.equal(kc, kc2) and torch.equal(vc, vc2) else math.inf
    record(
        "kv write bf16 64 rows 8x128",
        err,
        0.0,
        lambda: kv_write.write_kv_triton(kc, vc, k, v, slots),
        lambda: kv_write.write_kv_ref(kc2, vc2, k, v, slots),
        4 * k.numel() * 2,
    )


def check_sampling() -> None:
    for batch in (1, 64):
        logits = torch.randn(batch, 151936, device=DEV) * 4
        ones, zeros = torch.ones(batch, device=DEV), torch.zeros(batch, device=DEV)
        seeds = torch.randint(0, 2**40, (batch,), device=DEV)
        for label, params in (
            ("greedy", (zeros, zeros.int(), zeros, ones)),
            ("T=0.8 top-k 50 top-p 0.9", (ones * 0.8, (ones * 50).int(), zeros, ones * 0.9)),
            ("T=1 top-p 0.95", (ones, zeros.int(), zeros, ones * 0.95)),
        ):
            tri = sampling.sample_tokens_triton(logits, *params, seeds)
            ref = sampling.sample_tokens_ref(logits, *params, seeds)
            err = float((tri != ref).float().mean())  # share of rows drawing another token
            record(
                f"sample B={batch} V=151936 {label}",
                err,
                0.02,
                lambda: sampling.sample_tokens_triton(logits, *params, seeds),
                lambda: torch.argmax(logits, -1),
                logits.numel() * 4,
            )
