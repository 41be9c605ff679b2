"""Where the kernels get Triton from, and the rule that picks Triton or the torch reference.

Triton is an optional dependency (``dgpp-core[gpu]``): without it every op runs its torch
reference, so CPU-only installs still import ``dgpp.kernels``.
"""

from __future__ import annotations

import torch

from dgpp.policy import current

try:
    import triton
    import triton.language as tl

    HAS_TRITON = True
except ImportError:  # pragma: no cover - exercised only on installs without triton

    class _NoTriton:
        """Stands in for the ``triton`` module so kernel definitions still import."""

        @staticmethod
        def jit(fn=None, **_kwargs):
            return fn if fn is not None else (lambda f: f)

        @staticmethod
        def next_power_of_2(n: int) -> int:
            return 1 << max(0, (int(n) - 1).bit_length())

        @staticmethod
        def cdiv(a: int, b: int) -> int:
            return -(-a // b)

    triton = _NoTriton()  # type: ignore[assignment]
    tl = None  # type: ignore[assignment]
    HAS_TRITON = False

__all__ = ["HAS_TRITON", "next_pow2", "tl", "triton", "use_triton"]


def triton_enabled() -> bool:
    """Triton is installed and the policy runs its kernels (``DGPP_KERNELS=torch`` forces the references)."""
    return HAS_TRITON and current().triton_kernels


def use_triton(x: torch.Tensor) -> bool:
    """Triton on CUDA tensors; ``DGPP_KERNELS=torch`` forces the references (A/B checks on a GPU)."""
    return x.is_cuda and triton_enabled()


def next_pow2(n: int) -> int:
    return 1 << max(0, (int(n) - 1).bit_length())
