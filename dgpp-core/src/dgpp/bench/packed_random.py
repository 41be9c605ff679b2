"""Random weights drawn straight into packed formats, for geometries whose dense form would not fit a device
(DeepSeek-V4.1-Flash holds 27 GB of BF16 experts per layer, 7.2 GB as MXFP4).

Codes and scales are written directly, never encoded from dense values:

- FP8 E4M3 with block scales (``FP8Block``): codes drawn N(0, 16..32) (well inside E4M3's 448, so no NaN code),
  every block's scale one power of two, so a weight is N(0, ``std``);
- E2M1 pairs with group scales (``FP4Grouped``, MXFP4's E8M0 or NVFP4's E4M3 scales): every byte uniform (both
  nibbles uniform over the 16 codes, root-mean-square 2.93), every group's scale the power of two nearest to
  ``std / 2.93``.

So a packed weight has the spread ``dgpp bench`` gives a dense one (``initializer_range``) and a product keeps
its input's scale as it does there.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterator

import torch

from dgpp.nn.linear import Linear
from dgpp.quant.format import QuantFormat
from dgpp.quant.fp4 import FP4Grouped
from dgpp.quant.fp8 import FP8Block
from dgpp.quant.linear import QuantLinearMethod
from dgpp.quant.moe import PROJECTIONS, QuantExperts

E2M1_RMS = math.sqrt(sum(v * v for v in (0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0)) / 8)


def packed_groups(model: torch.nn.Module) -> Iterator[tuple[QuantFormat, dict[str, torch.Tensor]]]:
    """Every packed weight of ``model``: its format and its stored tensors (expert stacks: ``[E, *stored]``)."""
    for module in model.modules():
        if isinstance(module, Linear) and isinstance(module.quant_method, QuantLinearMethod):
            yield module.quant_method.fmt, {s: getattr(module, s) for s in module.quant_tensor_names}
        elif isinstance(module, QuantExperts):
            for proj in PROJECTIONS:
                stack = getattr(module, proj)
                yield stack.fmt, stack.stacks()


def _scale_value(t: torch.Tensor, exponent: int, e8m0: bool) -> None:
    """Every scale in ``t`` set to ``2^exponent`` in its storage: an E8M0 byte, an E4M3 code or a float."""
    if t.dtype == torch.uint8 and e8m0:
        t.fill_(127 + exponent)
    elif t.dtype == torch.uint8:  # an E4M3 scale kept as its bytes
        t.copy_(torch.full(t.shape, 2.0**exponent).to(torch.float8_e4m3fn).view(torch.uint8))
    else:
        t.fill_(2.0**exponent)


def _fill_rows(t: torch.Tensor, draw: Callable[[torch.Size], torch.Tensor], chunk: int = 1 << 28) -> None:
    """``t`` filled by ``draw(shape)`` in dim-0 slices of at most ``chunk`` elements (an expert stack holds
    billions; one draw of it in fp32 would need several times its bytes)."""
    rows = max(1, chunk // max(1, t[0].numel())) if t.dim() else 1
    if t.dim() == 0 or t.shape[0] <= rows:
        t.copy_(draw(t.shape))
        return
    for start in range(0, t.shape[0], rows):
        part = t[start : start + rows]
        part.copy_(draw(part.shape))


def fill_packed(model: torch.nn.Module, std: float, gen: torch.Generator) -> set[int]:
    """Every packed weight of ``model`` drawn in its format with weights of spread ``std`` (module doc); returns
    the ids of the tensors written (the caller draws the dense rest). A format with no random form here is a
    ValueError naming it."""
    device = gen.device
    written: set[int] = set()
    for fmt, tensors in packed_groups(model):
        if isinstance(fmt, FP8Block):
            exponent = math.floor(math.log2(std)) - 4
            spread = std / 2.0**exponent  # in [16, 32)

            def codes(shape: torch.Size, spread: float = spread) -> torch.Tensor:
                drawn = torch.randn(shape, generator=gen, device=device) * spread
                return drawn.clamp(-448, 448).to(torch.float8_e4m3fn)

            _fill_rows(tensors["weight"], codes)
            _scale_value(tensors[fmt.scale_name], exponent, e8m0=fmt.scale_format == "e8m0")
        elif isinstance(fmt, FP4Grouped):

            def nibbles(shape: torch.Size) -> torch.Tensor:
                return torch.randint(0, 256, shape, generator=gen, device=device, dtype=torch.uint8)

            _fill_rows(tensors[fmt.data_name], nibbles)
            exponent = round(math.log2(std / E2M1_RMS))
            _scale_value(tensors[fmt.scale_name], exponent, e8m0=fmt.scale_kind == "e8m0")
            if fmt.global_name:
                tensors[fmt.global_name].fill_(1.0)
        else:
            raise ValueError(f"dgpp bench draws no random {fmt.name} weights (FP8 block and FP4 only)")
        written.update(id(t) for t in tensors.values())
    return written
