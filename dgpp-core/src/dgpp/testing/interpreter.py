"""A Triton-interpreter dot whose rows do not depend on the tile's row count, as on the GPU.

The interpreter computes ``tl.dot`` with ``np.matmul``, which hands the tile to the BLAS library: OpenBLAS
picks its kernel (and so each output element's summation order) by the matrix shape, so on some CPUs
(measured on an AMD EPYC with ``OPENBLAS_CORETYPE=Haswell``) row 0 of a 17-row tile differs in its last
bit from the same row alone. A GPU's MMA sums every output element over K in one fixed order whatever
the tile's M, and the exactness tests check kernels against that property. ``np.einsum`` without
``optimize`` runs its own loop, summing over k in ascending order for every element: the same bits for a
row whatever shares its tile.
"""

from __future__ import annotations

import numpy as np


def use_fixed_order_dot() -> None:
    """Replace the interpreter's ``create_dot`` with the fixed-order one (idempotent; CPU tests only)."""
    from triton.runtime import interpreter

    builder = interpreter.InterpreterBuilder
    if getattr(builder.create_dot, "_dgpp_fixed_order", False):
        return
    original = builder.create_dot

    def create_dot(self, a, b, d, input_precision, max_num_imprecise_acc):
        if a.data.ndim != 2 or b.data.ndim != 2 or a.dtype.primitive_bitwidth == 8 and a.dtype.is_floating():
            return original(self, a, b, d, input_precision, max_num_imprecise_acc)
        acc = d.data.dtype
        product = np.einsum("ik,kj->ij", a.data.astype(acc), b.data.astype(acc), optimize=False)
        return interpreter.TensorHandle(product + d.data, d.dtype.scalar)

    create_dot._dgpp_fixed_order = True
    builder.create_dot = create_dot
