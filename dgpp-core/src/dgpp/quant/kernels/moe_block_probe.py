"""Which 64-row blocks of the fused expert GEMM give every row the bits of its 16-row blocks on this device, and
which of those and the 16-row blocks is fastest: probed once per formats, shapes, tiles, dtype and device, on the
layer's own weights.

Every block size runs the same K chain (the same K step, dot widths and order), so a row's value is fixed by
construction up to the tensor-core instruction: on Hopper Triton issues wgmma for one-dot 64-row blocks on 4 warps
and mma for 16-row ones, and only the device can say whether the two round alike. The blocked 64-row tiles (four
16-row dots on one decoded weight tile) issue the 16-row instruction; the probe checks them too."""

from __future__ import annotations

import torch

# (formats, shapes, top_k, candidate tiles, decode tiles, dtype, device) -> the fastest of the decode tiles and the
# candidates whose rows were bit-identical to theirs (``batch_probe.probed_once``: never inside a capture)
_CHOSEN: dict[tuple[object, ...], object] = {}
# tokens in groups of PROBE_TOKENS, each group on its own top_k experts: four full 64-row blocks and a partial one an
# expert, 17 16-row blocks (a prefill's ratio of weight decodes between the forms, which the timing compares), and
# up to PROBE_GROUPS groups so the experts' weights outgrow the L2 cache as a prefill's do (a form that re-reads its
# weights more often looks cheap while they stay cached)
PROBE_TOKENS = 272
PROBE_GROUPS = 8


def probe_inputs(
    hidden: int, top_k: int, num_experts: int, dtype: torch.dtype, device: torch.device
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Random rows (seeded), random routing weights, and group ``g`` of the tokens routed to experts
    ``g * top_k .. g * top_k + top_k - 1``."""
    groups = max(1, min(PROBE_GROUPS, num_experts // top_k))
    tokens = PROBE_TOKENS * groups
    gen = torch.Generator(device=device).manual_seed(0)
    x = torch.randn(tokens, hidden, generator=gen, device=device).to(dtype)
    weights = torch.rand(tokens, top_k, generator=gen, device=device)
    group = torch.arange(tokens, device=device) // PROBE_TOKENS
    ids = group[:, None] * top_k + torch.arange(top_k, device=device)
    return x, weights / weights.sum(1, keepdim=True), ids
