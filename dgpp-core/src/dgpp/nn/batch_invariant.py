"""Matrix products whose every output row is the same whatever other rows share the call.

On the CPU, ``F.linear`` picks a different GEMM kernel for 1-3, 5-7 and 9-11 rows (and for a single
output feature) than for larger shapes, so a token's logits could change in the last bit with the
number of tokens in the step (or routed to an expert) — enough to flip a greedy near-tie between a
batched and a solo run. Padding both the rows and the output features up to ``MIN_GEMM_DIM`` with
zeros always takes the large-shape kernel, whose rows measured bit-identical for every row count
(1..300) and shape tried. The padding costs nothing measurable at these sizes; CUDA has its own
kernels and is left alone.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

MIN_GEMM_DIM = 16


def batch_invariant_linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """``F.linear(x, weight, bias)`` with rows independent of the batch (see module docstring)."""
    if x.device.type != "cpu":
        return F.linear(x, weight, bias)
    rows, out_features = x.numel() // x.shape[-1], weight.shape[0]
    flat = x.reshape(rows, x.shape[-1])
    if rows < MIN_GEMM_DIM:
        flat = F.pad(flat, (0, 0, 0, MIN_GEMM_DIM - rows))
    w = weight if out_features >= MIN_GEMM_DIM else F.pad(weight, (0, 0, 0, MIN_GEMM_DIM - out_features))
    out = F.linear(flat, w)[:rows, :out_features]
    if bias is not None:
        out = out + bias
    return out.reshape(*x.shape[:-1], out_features)
