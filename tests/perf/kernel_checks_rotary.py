"""DeepSeek-V4's trailing interleaved RoPE kernel (``dgpp.kernels.trailing_rotary``) on the GPU at the release's
shapes (64 query heads and the one latent head of 512, a 64-channel rope slice; the indexer's 64 heads of 128)
against ``TrailingRotary``'s torch chain on the same device: plain and YaRN frequencies, bf16 angles or fp32,
the forward and the inverse turn. Both call CUDA's ``cosf`` / ``sinf`` and round op for op, so they must agree
bit for bit; each is timed (CUDA events)."""

from __future__ import annotations

import itertools

import torch
from check_glm5_cuda import _timed

from dgpp.kernels.trailing_rotary import trailing_rotary
from dgpp.nn.rotary import RopeScaling, YarnScaling, rotary_embedding
from dgpp.policy import overriding

ROPES = {
    "plain": RopeScaling(theta=10000.0),
    "yarn": RopeScaling(
        theta=160000.0,
        rope_type="yarn",
        yarn=YarnScaling(factor=16.0, original_max_position=65536, beta_fast=32.0, beta_slow=1.0),
    ),
}
SHAPES = {"q": (64, 512), "latent": (1, 512), "index q": (64, 128)}


def trailing_rotary_checks(failures: list[str]) -> list[str]:
    out: list[str] = []
    gen = torch.Generator(device="cuda").manual_seed(0)
    for (rope_name, rope), (shape_name, (heads, dim)), fp32_angles, inverse in itertools.product(
        ROPES.items(), SHAPES.items(), (False, True), (False, True)
    ):
        turn = rotary_embedding(
            rope, dim, 64, style="interleaved", trailing=True, fp32_angles=fp32_angles
        ).cuda()
        for rows in (1, 64):
            x = torch.randn(rows, heads, dim, generator=gen, device="cuda").bfloat16()
            positions = torch.randint(0, 1 << 20, (rows,), generator=gen, device="cuda", dtype=torch.int32)
            positions[:3] = torch.tensor([1, 0, 2])[: min(rows, 3)]  # the smallest angles, 0 among them

            def kernel(x=x, positions=positions, turn=turn, fp32_angles=fp32_angles, inverse=inverse):
                return trailing_rotary(
                    x, positions, turn.inv_freq, turn.magnitude, fp32_angles=fp32_angles, inverse=inverse
                )

            def chain(x=x, positions=positions, turn=turn, inverse=inverse):
                with overriding(triton_kernels=False):
                    return turn.rotate(x, positions, inverse=inverse)

            got, want = kernel(), chain()
            t_kernel, t_chain = _timed(kernel), _timed(chain)
            same = torch.equal(got, want)
            line = (
                f"trailing rotary {rope_name} {shape_name} rows {rows} fp32_angles={fp32_angles} inverse={inverse}: "
                f"{'bit-equal' if same else 'DIFFER, max ' + str(float((got.float() - want.float()).abs().max()))} "
                f"to the torch chain; {t_kernel * 1e6:.1f} us vs {t_chain * 1e6:.1f} us"
            )
            out.append(line)
            if not same:
                failures.append(line)
    return out
