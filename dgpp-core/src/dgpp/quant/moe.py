"""MoE experts in a packed format: per-expert tensors stacked along a leading expert dim.

A drop-in for ``dgpp.nn.moe.FusedExperts`` (same ``forward(x, weights, ids)``). On CUDA the routed
experts run through one fused grouped GEMM that decodes the packed weights in registers
(``dgpp.quant.kernels.moe_launch``): no host sync, so the layer captures in a CUDA graph. The
reference (CPU, and CUDA under ``DGPP_QUANT_TORCH=1``) loops over the experts that were picked,
decoding each one's weights (``expert_weight``). Tensors load from the per-expert names releases
ship (``experts.N.gate_proj.weight_scale`` ...).

``engine.prefill_bf16_partials`` (lossy, off by default): each prefill row's weighted down-projection partial
(one per expert the token picked) is rounded to bf16 before the per-token sum, which still runs in fp32; the
fused kernel then writes half the bytes. Decode rows keep fp32 partials (``dgpp.step.prefill_rows``).
"""

from __future__ import annotations

from collections.abc import Mapping

import torch
from torch import nn

from dgpp.family import World
from dgpp.nn.batch_invariant import batch_invariant_linear
from dgpp.nn.mlp import silu_and_mul
from dgpp.nn.sources import Alternatives, Source
from dgpp.policy import current
from dgpp.quant.codebook import NF4Codebook, hadamard32
from dgpp.quant.format import QuantFormat, Shape
from dgpp.quant.kernels.moe_launch import fused_quant_moe, has_moe_kernel
from dgpp.quant.linear import packed_matmul
from dgpp.quant.params import check_tp_alignment, make_param, reblock_for_tp, tp_dim
from dgpp.step.prefill_rows import prefill_rows, row_mask

PROJECTIONS = ("gate_proj", "up_proj", "down_proj")


class _ExpertStack(nn.Module):
    """One projection of every expert: each stored tensor as a parameter [E, *stored]."""

    def __init__(self, fmt: QuantFormat, num_experts: int, shape: Shape, parallel: str, world: World) -> None:
        super().__init__()
        fmt, reblock = reblock_for_tp(fmt, shape, parallel, world.size)
        self.fmt, self.shape = fmt, shape
        self.names = tuple(fmt.tensor_shapes(shape))
        check_tp_alignment(fmt, shape, parallel, world.size)
        dim = tp_dim(fmt, parallel)
        for suffix, stored in fmt.tensor_shapes(shape).items():
            setattr(
                self,
                suffix,
                make_param(fmt, suffix, stored, dim, world, lead=(num_experts,), reblock=reblock),
            )

    def expert_tensors(self, expert: int) -> dict[str, torch.Tensor]:
        return {name: getattr(self, name)[expert] for name in self.names}

    def stacks(self) -> dict[str, torch.Tensor]:
        return {name: getattr(self, name) for name in self.names}


class QuantExperts(nn.Module):
    """``E`` SwiGLU experts whose gate/up/down projections are stored in ``fmt`` (one format, or one per
        projection: exports such as Flint's mix FP8 block-128 and NVFP4 across gate/up/down within a layer);
        TP splits the intermediate dim (gate/up column, down row) like ``FusedExperts``, and ``swiglu_limit`` clamps
    the SwiGLU inputs as there. ``use_fused``: None
        picks the fused kernel on CUDA (unless ``DGPP_QUANT_TORCH=1``) when gate and up share a format (the
        kernel decodes them together; down may differ); True/False force it (tests run it on CPU under the
        Triton interpreter)."""

    use_fused: bool | None = None

    def __init__(
        self,
        fmt: QuantFormat | Mapping[str, QuantFormat],
        num_experts: int,
        hidden_size: int,
        intermediate_size: int,
        *,
        world: World | None = None,
        swiglu_limit: float | None = None,
    ) -> None:
        super().__init__()
        self.swiglu_limit = swiglu_limit
        self.world = world or World()
        if intermediate_size % self.world.size:
            raise ValueError(
                f"moe intermediate size {intermediate_size} is not divisible by world {self.world.size}"
            )
        formats = dict(fmt) if isinstance(fmt, Mapping) else dict.fromkeys(PROJECTIONS, fmt)
        if sorted(formats) != sorted(PROJECTIONS):
            raise ValueError(f"expert formats must name {', '.join(PROJECTIONS)}, got {sorted(formats)}")
        self.formats = formats
        self.fmt = formats["gate_proj"]  # the gate/up format the fused kernel decodes
        self.num_experts = num_experts
        self.inter = inter = intermediate_size // self.world.size
        self.gate_proj = _ExpertStack(
            formats["gate_proj"], num_experts, (inter, hidden_size), "column", self.world
        )
        self.up_proj = _ExpertStack(
            formats["up_proj"], num_experts, (inter, hidden_size), "column", self.world
        )
        self.down_proj = _ExpertStack(
            formats["down_proj"], num_experts, (hidden_size, inter), "row", self.world
        )

    def checkpoint_sources(self) -> dict[str, Alternatives]:
        out: dict[str, Alternatives] = {}
        for proj in PROJECTIONS:
            for suffix in getattr(self, proj).names:
                out[f"{proj}.{suffix}"] = [
                    [Source(f"{e}.{proj}.{suffix}", e) for e in range(self.num_experts)]
                ]
        return out

    def expert_weight(self, proj: str, expert: int, dtype: torch.dtype) -> torch.Tensor:
        """The decoded [out, in] weight of one expert's projection (the per-expert decode path)."""
        stack: _ExpertStack = getattr(self, proj)
        return stack.fmt.decode(stack.expert_tensors(expert), stack.shape, dtype)

    def _project(self, proj: str, expert: int, x: torch.Tensor) -> torch.Tensor:
        stack: _ExpertStack = getattr(self, proj)
        if isinstance(
            stack.fmt, NF4Codebook
        ):  # quantized in the rotated basis: rotate the input the same way
            x = hadamard32(x)
        if (
            not x.is_cuda
        ):  # the dense experts' CPU product: a row's bits do not depend on how many rows an expert got
            return batch_invariant_linear(
                x, stack.fmt.decode(stack.expert_tensors(expert), stack.shape, x.dtype)
            )
        return packed_matmul(stack.fmt, stack.expert_tensors(expert), x, stack.shape)

    def fused(self, x: torch.Tensor) -> bool:
        if self.use_fused is not None:
            return self.use_fused
        fusable = self.formats["up_proj"] == self.fmt and all(
            has_moe_kernel(f) for f in self.formats.values()
        )
        return x.is_cuda and fusable and not current().quant_torch_only

    def forward(self, x: torch.Tensor, weights: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
        bf16_rows = prefill_rows(x) if current().prefill_bf16_partials else None
        if self.fused(x):
            return fused_quant_moe(
                (self.gate_proj.fmt, self.gate_proj.stacks(), self.up_proj.stacks()),
                (self.down_proj.fmt, self.down_proj.stacks()),
                x,
                weights,
                ids,
                self.inter,
                swiglu_limit=self.swiglu_limit,
                bf16_partial_rows=bf16_rows,
            )
        return self.forward_reference(x, weights, ids, bf16_rows)

    def forward_reference(
        self,
        x: torch.Tensor,
        weights: torch.Tensor,
        ids: torch.Tensor,
        bf16_partial_rows: torch.Tensor | str | None = None,
    ) -> torch.Tensor:
        """One pass per expert that was picked (at most ``E`` however many tokens), each decoding its weights;
        the weighted partials of ``bf16_partial_rows`` (``dgpp.step.prefill_rows``) rounded to bf16 first."""
        rounded = None if bf16_partial_rows is None else row_mask(bf16_partial_rows, x.shape[0], x.device)
        out = torch.zeros_like(x)
        for expert in torch.unique(ids).tolist():
            token_idx, slot = torch.where(ids == expert)
            rows = x[token_idx]
            hidden = silu_and_mul(
                self._project("gate_proj", expert, rows),
                self._project("up_proj", expert, rows),
                self.swiglu_limit,
            )
            y = self._project("down_proj", expert, hidden)
            part = y * weights[token_idx, slot, None]
            if rounded is not None:
                part = torch.where(rounded[token_idx, None], part.to(torch.bfloat16).to(part.dtype), part)
            out.index_add_(0, token_idx, part.to(out.dtype))
        return out
