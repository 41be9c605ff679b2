"""Gated DeltaNet (GDN) layer: ``[q|k|v]`` projection -> causal conv + SiLU -> gated delta rule (see
``gated_delta_rule.py``) -> gated RMSNorm with the ``z`` gate -> output projection, over the engine's state pool.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from dgpp.family import World
from dgpp.nn.batch_invariant import rows_elementwise
from dgpp.nn.causal_conv1d import CausalConv1d
from dgpp.nn.exact.recurrent import conv_rows, delta_rule_rows, recurrent_plan
from dgpp.nn.gated_delta_rule import (  # noqa: F401  (re-exported: the math's historical home)
    CHUNK_SIZE,
    chunked_gated_delta_rule,
    gated_delta_rule_varlen,
    gated_delta_step,
)
from dgpp.nn.gqa import fused_projections
from dgpp.nn.linear import Linear, UnquantizedLinearMethod
from dgpp.nn.norm import rms_normalize
from dgpp.nn.weights import (
    WeightShapeError,
    copy_checked,
    default_weight_loader,
    narrow_for_rank,
    set_weight_attrs,
)
from dgpp.step.batch import ForwardBatch
from dgpp.step.cache_spec import StateSpec


def stacked_parts_loader(part_sizes: tuple[int, ...], world: World):
    """``weight_loader`` for a tensor stacking separately head-sharded parts along dim 0 (``[q|k|v]``): each
    part is cut to this rank's heads and the cuts are stacked again, so a rank holds ``[q_r|k_r|v_r]``."""

    def load(param: torch.Tensor, loaded: torch.Tensor, shard: object = None) -> None:
        if shard is not None or loaded.shape[0] != sum(part_sizes):
            raise WeightShapeError(
                f"shape {list(loaded.shape)}: dim 0 should stack parts of {' + '.join(map(str, part_sizes))} rows"
            )
        parts = loaded.split(list(part_sizes), dim=0)
        copy_checked(param, torch.cat([narrow_for_rank(part, 0, world) for part in parts], dim=0))

    return load


class GatedRMSNorm(nn.Module):
    """Per-head RMSNorm (plain ``w``, not ``1+w``), rounded to the input dtype, then times ``silu(gate)`` (a
    subclass with ``sigmoid_gate = True``: ``sigmoid(gate)``). ``out_dtype``: ``x`` is cast to it first (the
    delta rule's fp32 output); on CUDA the cast, the norm and the gate are one launch."""

    sigmoid_gate = False

    def __init__(self, dim: int, eps: float = 1e-6, *, dtype: torch.dtype = torch.float32):
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.empty(dim, dtype=dtype), requires_grad=False)
        set_weight_attrs(self.weight, weight_loader=default_weight_loader)

    def forward(
        self, x: torch.Tensor, gate: torch.Tensor, out_dtype: torch.dtype | None = None
    ) -> torch.Tensor:
        out_dtype = out_dtype or x.dtype
        if x.is_cuda and x.dim() == 3:
            from dgpp.kernels.gated_rmsnorm import GatedRmsNormInputs, gated_rms_norm

            return gated_rms_norm(
                GatedRmsNormInputs(x, gate, self.weight, self.eps, out_dtype, self.sigmoid_gate)
            )
        x = x.to(out_dtype)
        normed = rms_normalize(x, self.eps).to(x.dtype)
        act = rows_elementwise(torch.sigmoid if self.sigmoid_gate else F.silu, gate.float())
        return (self.weight * normed * act).to(x.dtype)


class GatedDeltaNet(nn.Module):
    """A GDN token mixer: ``[q|k|v]`` projection -> causal conv + SiLU -> gated delta rule -> gated norm -> out.

    Its state (``cache_spec()``) is the conv history ``[kernel-1, conv_dim]`` in the activation dtype and
    the recurrent state ``[Hv, dk, dv]`` in fp32, both read and written through ``batch.cache.state[name]``.
    Parameter names follow the checkpoints (``in_proj_qkv``, ``in_proj_z``, ``in_proj_b``, ``in_proj_a``,
    ``conv1d``, ``A_log``, ``dt_bias``, ``norm``, ``out_proj``).

    Under tensor parallelism each rank holds ``1/world`` of the key heads and the value heads that read them
    (contiguous, so v head j still reads k head j // group); ``out_proj`` is row-parallel and its output is
    a partial sum that the caller all-reduces.
    """

    def __init__(
        self,
        name: str,
        *,
        hidden_size: int,
        num_k_heads: int,
        num_v_heads: int,
        head_k_dim: int,
        head_v_dim: int,
        conv_kernel: int,
        eps: float = 1e-6,
        dtype: torch.dtype = torch.float32,
        chunk_size: int = CHUNK_SIZE,
        world: World | None = None,
    ) -> None:
        super().__init__()
        world = world or World()
        if num_v_heads % num_k_heads:
            raise ValueError(
                f"{name}: value heads {num_v_heads} must be a multiple of key heads {num_k_heads}"
            )
        if num_k_heads % world.size:
            raise ValueError(f"{name}: {num_k_heads} key heads do not split over a TP world of {world.size}")
        self.name = name
        self.dtype = dtype
        self.num_k_heads, self.num_v_heads = num_k_heads // world.size, num_v_heads // world.size
        self.head_k_dim, self.head_v_dim = head_k_dim, head_v_dim
        self.key_dim, self.value_dim = self.num_k_heads * head_k_dim, self.num_v_heads * head_v_dim
        self.chunk_size = chunk_size
        full_parts = (num_k_heads * head_k_dim, num_k_heads * head_k_dim, num_v_heads * head_v_dim)
        column = dict(dtype=dtype, parallel="column", world=world)
        self.in_proj_qkv = Linear(hidden_size, sum(full_parts), **column)
        self.in_proj_z = Linear(hidden_size, num_v_heads * head_v_dim, **column)
        self.in_proj_b = Linear(hidden_size, num_v_heads, **column)
        self.in_proj_a = Linear(hidden_size, num_v_heads, **column)
        self.conv1d = CausalConv1d(sum(full_parts) // world.size, conv_kernel, dtype=dtype)
        for stacked in (self.in_proj_qkv.weight, self.conv1d.weight):
            set_weight_attrs(stacked, weight_loader=stacked_parts_loader(full_parts, world))
        self.A_log = nn.Parameter(torch.empty(self.num_v_heads, dtype=dtype), requires_grad=False)
        self.dt_bias = nn.Parameter(torch.empty(self.num_v_heads, dtype=dtype), requires_grad=False)
        for per_head in (self.A_log, self.dt_bias):
            set_weight_attrs(per_head, tp_dim=0, world=world, weight_loader=default_weight_loader)
        self.norm = GatedRMSNorm(head_v_dim, eps, dtype=dtype)
        self.out_proj = Linear(
            num_v_heads * head_v_dim, hidden_size, dtype=dtype, parallel="row", world=world
        )
        self.world = world
        self._layout_checked = False

    def _check_split_layout(self) -> None:
        """A quantized ``in_proj_qkv`` gets its format's own (contiguous) TP slicing, not the per-part one above,
        which would mix q, k and v heads on a rank: refuse that rather than compute garbage."""
        if self.world.size > 1 and not isinstance(self.in_proj_qkv.quant_method, UnquantizedLinearMethod):
            raise NotImplementedError(
                f"{self.name}.in_proj_qkv: a quantized [q|k|v] projection cannot be split over a TP world of "
                f"{self.world.size} yet (it needs per-part slicing); run this checkpoint on one rank"
            )
        self._layout_checked = True

    def cache_spec(self) -> StateSpec:
        return StateSpec(
            {
                "conv": (self.conv1d.state_shape(), self.dtype),
                "recurrent": ((self.num_v_heads, self.head_k_dim, self.head_v_dim), torch.float32),
            }
        )

    def forward(self, hidden: torch.Tensor, batch: ForwardBatch) -> torch.Tensor:
        if not self._layout_checked:
            self._check_split_layout()
        state = batch.cache.state[self.name]
        rows = hidden.shape[0]
        # CUDA, not decode-only: rows by the step's route (decode / verify rows through the decode kernels)
        plan = recurrent_plan(batch)
        # on CUDA [q|k|v] and z in one launch, b and a in another; the CPU keeps one product per projection
        qkv, z = fused_projections(hidden, (self.in_proj_qkv, self.in_proj_z), fuse_on_cpu=False)
        b, a = fused_projections(hidden, (self.in_proj_b, self.in_proj_a), fuse_on_cpu=False)
        mixed = conv_rows(self.conv1d, qkv, state["conv"], batch, plan)
        q, k, v = mixed.split([self.key_dim, self.key_dim, self.value_dim], dim=-1)
        q = q.reshape(rows, self.num_k_heads, self.head_k_dim)
        k = k.reshape(rows, self.num_k_heads, self.head_k_dim)
        v = v.reshape(rows, self.num_v_heads, self.head_v_dim)
        if hidden.is_cuda:  # the gates in one launch
            from dgpp import kernels

            g, beta = kernels.gdn_gates(a, b, self.A_log, self.dt_bias)
        else:
            beta = rows_elementwise(torch.sigmoid, b)
            # decay in log space, in fp32 (exp(A_log) overflows fp16 and loses bits in bf16)
            g = -self.A_log.float().exp() * rows_elementwise(F.softplus, a.float() + self.dt_bias)
        core = delta_rule_rows(q, k, v, g, beta, state["recurrent"], batch, plan, self.chunk_size)
        z = z.reshape(rows, self.num_v_heads, self.head_v_dim)
        return self.out_proj(self.norm(core, z, hidden.dtype).reshape(rows, self.value_dim))
