"""Cache forms the tests put in place of the packed ones (``DeepseekV41ForCausalLM.entry_formats``): the compressed
entries, index keys and window latents held as values in the compute dtype, rounded to their trained form (the
values the packed bytes decode to) or not rounded at all."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch

from dgpp_deepseek.v41_latent_formats import round_fp4_e4m3, round_fp4_e8m0, round_fp8_e8m0
from dgpp_deepseek.v41_model import DeepseekV41ForCausalLM


@dataclass(frozen=True)
class ValueEntries:
    """Rows of ``dim`` values in ``dtype``, passed through ``rounding`` on the way in (None: as computed)."""

    dim: int
    dtype: torch.dtype
    rounding: Callable[[torch.Tensor], torch.Tensor] | None

    @property
    def width(self) -> int:
        return self.dim

    def encode(self, values: torch.Tensor) -> torch.Tensor:
        return (values if self.rounding is None else self.rounding(values)).to(self.dtype)

    def decode(self, rows: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
        return rows.to(dtype)


def hold_values(model: DeepseekV41ForCausalLM, *, rounded: bool) -> None:
    """Every compressed pool and window ring of ``model`` holds values in its dtype from now on (rounded or not)."""
    cfg, formats = model.config, model.entry_formats
    formats.main = ValueEntries(cfg.head_dim, model.dtype, round_fp4_e4m3 if rounded else None)
    formats.index = ValueEntries(cfg.index_head_dim, model.dtype, round_fp4_e8m0 if rounded else None)
    formats.window = ValueEntries(cfg.head_dim, model.dtype, round_fp8_e8m0 if rounded else None)
