"""The float64 reference with the release's bf16 storage points: a yardstick for a bf16 run.

The original engine (github.com/HawkBearPig/dgpp ``src/kernels/csa2.cu``, ``src/models/dsv41``) computes in
fp32 inside each kernel and stores bf16 between them: the hyper-connection streams, each sublayer's normed
input and output, the RMSNorm outputs (``q_norm``, ``kv_norm``, the compressor's and the index keys' norms) and
every rotated tensor (queries, the window latent, the index queries and keys, the attention output after the
inverse rotation). The three trained cache roundings then act on those bf16 values. ``bf16_storage()`` runs
the reference with exactly those values rounded to bf16 (everything else float64), so its distance from the
plain reference is what bf16 storage alone costs on a checkpoint, whatever engine computes it.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator
from typing import Any

import deepseek_v41_reference as reference
import deepseek_v41_reference_csa2 as csa2
import torch


def to_bf16(t: torch.Tensor) -> torch.Tensor:
    """``t`` rounded to bf16, kept in its dtype."""
    return t.to(torch.bfloat16).to(t.dtype)


def _stored(fn: Callable[..., torch.Tensor]) -> Callable[..., torch.Tensor]:
    def stored(*args: Any, **kwargs: Any) -> torch.Tensor:
        return to_bf16(fn(*args, **kwargs))

    return stored


# (module, function): the results the original engine writes out as bf16
_STORED = (
    (csa2, "rms_norm"),  # q_norm, kv_norm, the compressor's norm, k_norm
    (csa2, "rotate_tail"),  # q, the window latent, index q / k, the attention output rotated back
    (reference, "collapse"),  # the collapsed sublayer input
    (reference, "expand"),  # the streams
    (reference, "attention"),  # the attention sublayer's output
    (reference, "moe"),  # the MoE sublayer's output
    (reference, "engram"),  # the streams after Engram
)


@contextlib.contextmanager
def bf16_storage() -> Iterator[None]:
    """Within the block the reference rounds to bf16 where the original engine stores bf16 (module doc)."""
    saved = [(module, name, getattr(module, name)) for module, name in _STORED]
    site_input = reference.DeepseekV41Reference.site_input
    try:
        for module, name, fn in saved:
            setattr(module, name, _stored(fn))
        reference.DeepseekV41Reference.site_input = _stored(site_input)  # type: ignore[method-assign]
        yield
    finally:
        for module, name, fn in saved:
            setattr(module, name, fn)
        reference.DeepseekV41Reference.site_input = site_input  # type: ignore[method-assign]
