"""The kernels that replaced DeepSeek-V4's decode glue, on the GPU at the release's sizes, against the torch
chains they replace (``DGPP_KERNELS=torch`` order, same device): the fp32-weight RMSNorm (bf16 rows of 4096 / 1024
/ 512), the hyper-connections' unweighted fp32 norm of 16,384 bf16 stream channels, the query's per-head RMS in the
trailing-rotary launch (64 heads of 512), the router on bf16 sqrt-softplus logits (256 experts, top 6, learned with
a bias and hashed), the top-k selection's counts and the shared expert's add in the expert sum (bit for bit). The
kernels reduce in their own order, so the bf16 results may be a rounding step off the chain's (at most one for the
norms and the router weights; a head whose bf16 factor lands one step off moves by that step times its values, up
to ~5 for unit-RMS heads: 8 steps of 1 allowed); a row alone must give the batch's bits; each is timed against its
chain (CUDA events)."""

from __future__ import annotations

from collections.abc import Callable

import torch
from check_glm5_cuda import _timed

from dgpp.kernels.moe import sum_experts, sum_experts_ref
from dgpp.kernels.rmsnorm import unweighted_rms_norm
from dgpp.kernels.router_topk import RouterTopKInputs, router_topk_ref, router_topk_triton
from dgpp.kernels.top_k_rows import top_k_rows_triton
from dgpp.nn.rotary import RopeScaling, YarnScaling, rotary_embedding
from dgpp.nn.window_compressor import FP32WeightRMSNorm
from dgpp.policy import overriding


def _steps_apart(got: torch.Tensor, want: torch.Tensor, floor: float = 1e-30) -> float:
    """The largest difference in units of ``want``'s bf16 step (2^-7 of its magnitude, taken as at least
    ``floor``: a rotated pair's value can be near 0 where its inputs' rounding is not)."""
    g, w = got.float(), want.float()
    return float(((g - w).abs() / (w.abs().clamp_min(floor) * 2**-7)).max())


def _line(
    name: str,
    fast: Callable[[], object],
    slow: Callable[[], object],
    ok: bool,
    detail: str,
    failures: list[str],
) -> str:
    line = f"{name}: {detail}; {_timed(fast) * 1e6:.1f} us vs chain {_timed(slow) * 1e6:.1f} us"
    if not ok:
        failures.append(line)
    return line


def _chain(fn: Callable[[], torch.Tensor]) -> Callable[[], torch.Tensor]:
    def run() -> torch.Tensor:
        with overriding(triton_kernels=False):
            return fn()

    return run


def norm_checks(failures: list[str], gen: torch.Generator) -> list[str]:
    out = []
    for cols in (4096, 1024, 512):
        norm = FP32WeightRMSNorm(cols, 1e-6).cuda()
        norm.weight.copy_(torch.rand(cols, generator=gen, device="cuda") + 0.5)
        for rows in (1, 64):
            x = torch.randn(rows, cols, generator=gen, device="cuda").bfloat16()
            got, want = norm(x), _chain(lambda x=x, norm=norm: norm(x))()
            alone = torch.equal(norm(x[-1:].clone()), got[-1:])
            steps = _steps_apart(got, want)
            out.append(
                _line(
                    f"fp32-weight norm {cols} rows {rows}",
                    lambda x=x, norm=norm: norm(x),
                    _chain(lambda x=x, norm=norm: norm(x)),
                    steps <= 1.0 and alone,
                    f"{steps:.2f} bf16 steps from the chain, row alone equal {alone}",
                    failures,
                )
            )
    streams = torch.randn(64, 16384, generator=gen, device="cuda").bfloat16()
    got = unweighted_rms_norm(streams, 1e-6, torch.float32)
    want = torch.rms_norm(streams.float(), (16384,), eps=1e-6)
    err = float(((got - want).abs() / want.abs().clamp_min(1e-6)).max())
    alone = torch.equal(unweighted_rms_norm(streams[:1].clone(), 1e-6, torch.float32), got[:1])
    out.append(
        _line(
            "stream norm 16384 -> fp32, rows 64",
            lambda: unweighted_rms_norm(streams, 1e-6, torch.float32),
            lambda: torch.rms_norm(streams.float(), (16384,), eps=1e-6),
            err < 1e-5 and alone,
            f"rel err {err:.2e}, row alone equal {alone}",
            failures,
        )
    )
    return out


def head_rms_checks(failures: list[str], gen: torch.Generator) -> list[str]:
    out = []
    yarn = RopeScaling(
        theta=160000.0,
        rope_type="yarn",
        yarn=YarnScaling(factor=16.0, original_max_position=65536, beta_fast=32.0, beta_slow=1.0),
    )
    for name, rope in (("plain", RopeScaling(theta=10000.0)), ("yarn", yarn)):
        turn = rotary_embedding(rope, 512, 64, style="interleaved", trailing=True).cuda()
        for rows in (1, 64):
            q = torch.randn(rows, 64, 512, generator=gen, device="cuda").bfloat16()
            pos = torch.randint(0, 1 << 20, (rows,), generator=gen, device="cuda")

            def kernel(q=q, pos=pos, turn=turn) -> torch.Tensor:
                return turn.rotate(q, pos, head_rms_eps=1e-6)

            got, want = kernel(), _chain(kernel)()
            steps = _steps_apart(got, want, floor=1.0)  # the normed heads' RMS
            heads_equal = float((got == want).all(-1).float().mean())
            alone = torch.equal(turn.rotate(q[-1:].clone(), pos[-1:].clone(), head_rms_eps=1e-6), got[-1:])
            out.append(
                _line(
                    f"q head RMS + trailing rotary {name} rows {rows}",
                    kernel,
                    _chain(kernel),
                    steps <= 8.0 and alone,
                    f"{heads_equal:.1%} of heads bit-equal to the chain, the rest within {steps:.2f} bf16 steps "
                    f"of 1, row alone equal {alone}",
                    failures,
                )
            )
    return out


def router_checks(failures: list[str], gen: torch.Generator) -> list[str]:
    out = []
    table = torch.stack([torch.randperm(256, device="cuda", generator=gen)[:6] for _ in range(1000)])
    for hashed in (False, True):
        for rows in (1, 64, 2048):
            logits = (torch.randn(rows, 256, generator=gen, device="cuda") * 2).bfloat16()
            bias = None if hashed else torch.randn(256, generator=gen, device="cuda") * 0.05
            tokens = torch.randint(0, 1000, (rows,), generator=gen, device="cuda")
            step = RouterTopKInputs(logits, bias, 6, "sqrtsoftplus", True, 2.5, torch.bfloat16)
            if hashed:
                step = step._replace(hash_table=table, token_ids=tokens)
            (w, ids), (ref_w, ref_ids) = router_topk_triton(step), router_topk_ref(step)
            same = (ids == ref_ids).all(-1)
            steps = _steps_apart(w[same], ref_w[same]) if bool(same.any()) else 0.0
            alone = router_topk_triton(
                step._replace(logits=logits[-1:].clone(), token_ids=tokens[-1:].clone() if hashed else None)
            )
            alone_ok = torch.equal(alone[0], w[-1:]) and torch.equal(alone[1], ids[-1:])
            share = float(same.float().mean())
            out.append(
                _line(
                    f"router bf16 sqrt-softplus 256 top 6 {'hashed' if hashed else 'learned'} rows {rows}",
                    lambda step=step: router_topk_triton(step),
                    lambda step=step: router_topk_ref(step),
                    share >= 0.99 and steps <= 1.0 and alone_ok,
                    f"same experts in {share:.1%} of rows (their weights {steps:.2f} bf16 steps apart), row alone "
                    f"equal {alone_ok}",
                    failures,
                )
            )
    return out


def count_checks(failures: list[str], gen: torch.Generator) -> list[str]:
    scores = torch.randn(64, 8192, generator=gen, device="cuda")
    lens = torch.randint(0, 8192, (64,), generator=gen, device="cuda", dtype=torch.int32)
    _, count = top_k_rows_triton(scores, lens, 512)
    ok = torch.equal(count, torch.clamp(lens, max=512).to(torch.int32))
    return [
        _line(
            "top_k_rows counts, 64 rows of 8192, k 512",
            lambda: top_k_rows_triton(scores, lens, 512),
            lambda: torch.clamp(lens, max=512).to(torch.int32),
            ok,
            f"counts equal min(lens, k) {ok} (the chain column times the clamp and cast alone)",
            failures,
        )
    ]


def shared_add_checks(failures: list[str], gen: torch.Generator) -> list[str]:
    out = []
    for rows in (1, 64):
        per_token = torch.randn(rows, 6, 4096, generator=gen, device="cuda")
        shared = torch.randn(rows, 4096, generator=gen, device="cuda").bfloat16()
        got = sum_experts(per_token, torch.bfloat16, shared)
        same = torch.equal(got, sum_experts_ref(per_token, torch.bfloat16, shared))
        out.append(
            _line(
                f"expert sum + shared expert 6 x 4096 rows {rows}",
                lambda p=per_token, s=shared: sum_experts(p, torch.bfloat16, s),
                lambda p=per_token, s=shared: sum_experts(p, torch.bfloat16) + s,
                same,
                f"bit-equal to the sum then the add {same}",
                failures,
            )
        )
    return out


def deepseek_v4_glue_checks(failures: list[str]) -> list[str]:
    gen = torch.Generator(device="cuda").manual_seed(0)
    with torch.no_grad():
        return (
            norm_checks(failures, gen)
            + head_rms_checks(failures, gen)
            + router_checks(failures, gen)
            + count_checks(failures, gen)
            + shared_add_checks(failures, gen)
        )
