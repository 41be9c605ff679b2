"""The fp32 math of torch's CUDA ops inside Triton kernels that must give their bits: CUDA's ``expf``, ``cosf`` and
``sinf`` (libdevice, as torch's ``exp`` / ``sigmoid`` / ``softmax`` / ``cos`` / ``sin`` call; ``tl.exp`` and
``tl.cos`` are approximate) on a GPU, numpy's in Triton's interpreter (which has no libdevice), and the launch
option that keeps ``a * b + c`` two roundings, as separate torch ops are."""

from __future__ import annotations

from dgpp.kernels._triton import HAS_TRITON, tl, triton

NO_FMA = {"enable_fp_fusion": False}  # a launch option of compiled kernels: no fused multiply-add

if HAS_TRITON and not triton.knobs.runtime.interpret:
    from triton.language.extra import libdevice

    @triton.jit
    def exp(x):
        return libdevice.exp(x)

    @triton.jit
    def cos_sin(x):
        return libdevice.cos(x), libdevice.sin(x)

else:

    @triton.jit
    def exp(x):
        return tl.exp(x)

    @triton.jit
    def cos_sin(x):
        return tl.cos(x), tl.sin(x)


@triton.jit
def round_to_bf16(x):
    """fp32 ``x`` rounded to the nearest bf16 (ties to even), kept in fp32: what a CUDA fp32 -> bf16 cast gives,
    spelled out in integer ops because Triton's interpreter truncates that cast (finite values)."""
    bits = x.to(tl.uint32, bitcast=True)
    bits = (bits + 0x7FFF + ((bits >> 16) & 1)) & 0xFFFF0000
    return bits.to(tl.float32, bitcast=True)
