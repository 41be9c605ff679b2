"""Whether the fused expert GEMM's 64-row blocks give every row the bits of its 16-row blocks on this device:
probed once per formats, shapes, tiles, dtype and device, on the layer's own weights.

Both block sizes run the same K chain (the same K step, dot widths and order), so a row's value is fixed by
construction up to the tensor-core instruction: on Hopper Triton issues wgmma for 64-row blocks on 4 warps and
mma for 16-row ones, and only the device can say whether the two round alike."""

from __future__ import annotations

import torch

# (formats, shapes, top_k, block tiles, decode tiles, dtype, device) -> the 64-row blocks were bit-identical
# (``batch_probe.probed_once``: never probed inside a CUDA-graph capture)
_EXACT: dict[tuple[object, ...], bool] = {}
PROBE_TOKENS = 80  # every token on the same experts: a full 64-row block and a partial one each


def probe_inputs(
    hidden: int, top_k: int, dtype: torch.dtype, device: torch.device
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Random rows (seeded), random routing weights, and every token routed to experts ``0..top_k-1``."""
    gen = torch.Generator(device=device).manual_seed(0)
    x = torch.randn(PROBE_TOKENS, hidden, generator=gen, device=device).to(dtype)
    weights = torch.rand(PROBE_TOKENS, top_k, generator=gen, device=device)
    ids = torch.arange(top_k, device=device).expand(PROBE_TOKENS, top_k).contiguous()
    return x, weights / weights.sum(1, keepdim=True), ids
