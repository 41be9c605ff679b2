"""Kimi delta attention (KDA): a delta-rule token mixer whose forget gate decays every key channel on its own.

Per token: ``q``/``k``/``v`` from separate projections, each through its own depthwise causal conv + SiLU; the
log-decay per head and key channel ``g = bound · sigmoid(exp(A_log_h) · (f_b(f_a(x)) + dt_bias))`` (the safe
form, ``bound`` < 0; without a bound ``-exp(A_log_h) · softplus(...)``); ``beta = sigmoid(b_proj(x))`` per head.
The state update is the gated delta rule (``dgpp.nn.gated_delta_rule``, which takes a per-channel ``g``), on
L2-normed q/k with q scaled by ``dk^-½``. The output is RMS-normed per head (one weight shared by the heads), times
``sigmoid(g_b(g_a(x)))``, then ``o_proj``.

Per request the layer keeps, as state entries of one ``StateSpec``, the conv history of q, k and v (``kernel - 1``
rows each) and the fp32 recurrent state ``[H, dk, dv]``; chunked prefill and the prefix cache's snapshots carry
them like Gated DeltaNet's. On CUDA a decode-only step runs the recurrent Triton step (``dgpp.kernels.gated_delta``,
per-channel decay) and the conv decode kernel, reading only device tensors (graph-safe); verify rows and
``batch_invariant`` rows take the same kernels row by row (``dgpp.nn.exact.recurrent``). Parameter names follow GLM-5.3-Flash / Kimi-Linear checkpoints. Under tensor
parallelism heads split over the ranks (projections column-parallel, ``o_proj`` row-parallel: the caller
all-reduces); ``f_a_proj`` / ``g_a_proj`` (the low-rank halves) and ``o_norm`` are replicated.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from dgpp.family import World
from dgpp.nn.batch_invariant import rows_elementwise
from dgpp.nn.causal_conv1d import CausalConv1d
from dgpp.nn.exact.recurrent import conv_rows, delta_rule_rows, recurrent_plan
from dgpp.nn.gated_delta_rule import CHUNK_SIZE
from dgpp.nn.linear import Linear
from dgpp.nn.norm import rms_normalize
from dgpp.nn.weights import default_weight_loader, set_weight_attrs
from dgpp.step.batch import ForwardBatch
from dgpp.step.cache_spec import StateSpec

# each projection's conv module and the state tensor holding its history
_CONVS = (("q_conv1d", "q_conv"), ("k_conv1d", "k_conv"), ("v_conv1d", "v_conv"))


class SigmoidGatedRMSNorm(nn.Module):
    """Per-head RMSNorm in fp32 (plain ``w``), times ``sigmoid(gate)``, rounded to the input dtype once."""

    def __init__(self, dim: int, eps: float, *, dtype: torch.dtype) -> None:
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.empty(dim, dtype=dtype), requires_grad=False)
        set_weight_attrs(self.weight, weight_loader=default_weight_loader)

    def forward(self, x: torch.Tensor, gate: torch.Tensor) -> torch.Tensor:
        normed = self.weight.float() * rms_normalize(x, self.eps)
        return (normed * rows_elementwise(torch.sigmoid, gate.float())).to(x.dtype)


class KimiDeltaAttention(nn.Module):
    """One KDA layer; ``name`` is its state entry (``cache_spec()``: ``q_conv`` / ``k_conv`` / ``v_conv`` /
    ``recurrent``)."""

    def __init__(
        self,
        name: str,
        *,
        hidden_size: int,
        num_heads: int,
        head_dim: int,
        conv_kernel: int,
        lower_bound: float | None,
        eps: float,
        dtype: torch.dtype,
        chunk_size: int = CHUNK_SIZE,
        world: World | None = None,
    ) -> None:
        super().__init__()
        world = world or World()
        if num_heads % world.size:
            raise ValueError(f"{name}: {num_heads} KDA heads do not split over a TP world of {world.size}")
        self.name, self.dtype, self.chunk_size = name, dtype, chunk_size
        self.num_heads, self.head_dim = num_heads // world.size, head_dim
        self.lower_bound = lower_bound
        width = num_heads * head_dim
        self.local_width = self.num_heads * head_dim
        column = dict(dtype=dtype, parallel="column", world=world)
        self.q_proj = Linear(hidden_size, width, **column)
        self.k_proj = Linear(hidden_size, width, **column)
        self.v_proj = Linear(hidden_size, width, **column)
        for conv, _ in _CONVS:  # fp32 taps, as the checkpoints keep them
            layer = CausalConv1d(self.local_width, conv_kernel, dtype=torch.float32)
            set_weight_attrs(layer.weight, tp_dim=0, world=world)
            setattr(self, conv, layer)
        self.f_a_proj = Linear(hidden_size, head_dim, dtype=dtype, world=world)
        self.f_b_proj = Linear(head_dim, width, **column)
        self.A_log = nn.Parameter(torch.empty(self.num_heads, dtype=torch.float32), requires_grad=False)
        self.dt_bias = nn.Parameter(torch.empty(self.local_width, dtype=torch.float32), requires_grad=False)
        for per_head in (self.A_log, self.dt_bias):
            set_weight_attrs(per_head, tp_dim=0, world=world, weight_loader=default_weight_loader)
        self.b_proj = Linear(hidden_size, num_heads, **column)
        self.g_a_proj = Linear(hidden_size, head_dim, dtype=dtype, world=world)
        self.g_b_proj = Linear(head_dim, width, **column)
        self.o_norm = SigmoidGatedRMSNorm(head_dim, eps, dtype=dtype)
        self.o_proj = Linear(width, hidden_size, dtype=dtype, parallel="row", world=world)

    def cache_spec(self) -> StateSpec:
        history = (self.q_conv1d.state_shape(), self.dtype)
        recurrent = ((self.num_heads, self.head_dim, self.head_dim), torch.float32)
        return StateSpec({**{key: history for _, key in _CONVS}, "recurrent": recurrent})

    def cache_entries(self, dtype: torch.dtype) -> dict[str, StateSpec]:
        """The layer's one state entry (the model's ``cache_spec`` collects it)."""
        return {self.name: self.cache_spec()}

    def decay(self, x: torch.Tensor) -> torch.Tensor:
        """Log-decay per head and key channel, ``[T, H, dk]`` fp32."""
        gate = (self.f_b_proj(self.f_a_proj(x)).float() + self.dt_bias).view(
            -1, self.num_heads, self.head_dim
        )
        rate = self.A_log.float().exp()[:, None]
        if self.lower_bound is not None:
            return self.lower_bound * rows_elementwise(torch.sigmoid, rate * gate)
        return -rate * rows_elementwise(F.softplus, gate)

    def forward(self, hidden: torch.Tensor, batch: ForwardBatch) -> torch.Tensor:
        state = batch.cache.state[self.name]
        rows, shape = hidden.shape[0], (hidden.shape[0], self.num_heads, self.head_dim)
        # CUDA, not decode-only: rows by the step's route (decode / verify rows through the decode kernels)
        plan = recurrent_plan(batch)
        q, k, v = (
            conv_rows(getattr(self, conv), proj(hidden), state[key], batch, plan).reshape(shape)
            for (conv, key), proj in zip(_CONVS, (self.q_proj, self.k_proj, self.v_proj), strict=True)
        )
        beta = rows_elementwise(torch.sigmoid, self.b_proj(hidden))
        decay = self.decay(hidden)
        core = delta_rule_rows(q, k, v, decay, beta, state["recurrent"], batch, plan, self.chunk_size)
        core = core.to(hidden.dtype)
        gate = self.g_b_proj(self.g_a_proj(hidden)).view(shape)
        return self.o_proj(self.o_norm(core, gate).reshape(rows, self.local_width))
