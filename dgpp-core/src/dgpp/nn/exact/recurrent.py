"""Gated DeltaNet / causal conv rows by the step's route (``dgpp.nn.exact.routing``), on CUDA.

The stock GDN layer takes the recurrent decode kernels for a decode-only step and the chunked varlen form
for any step with a multi-row sequence, so a decode row sharing a step with a prefill chunk, or a verify
row, came out different from plain decode. Here canonical rows always take the decode kernels: the rows
of a multi-row canonical sequence (a verify's 1+depth rows, or every prompt row under ``batch_invariant``)
run as successive one-token steps over the pooled state, step ``j`` holding row ``j`` of every sequence
that has one, which is exactly what plain decode does token by token. Bulk (prefill-chunk) rows keep the
chunked form, one call per sequence (the chunked form pads its sequences into one batch, so a chunk's bits
would otherwise follow the other chunks of the step).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from dgpp.nn.causal_conv1d import CausalConv1d
from dgpp.policy import current
from dgpp.step.batch import ForwardBatch
from dgpp.step.route import StepRoute, route_for

RowStep = tuple[torch.Tensor, torch.Tensor, torch.Tensor]  # (rows, sequences, fresh) on the device


@dataclass
class RecurrentPlan:
    """The decode-kernel steps and the chunked calls (one per prefill-chunk sequence) of one step."""

    steps: list[RowStep]
    state_slots: torch.Tensor
    bulk: tuple[tuple[int, int, int, int], ...] = ()  # (first row, end row, sequence, context) per chunk

    def conv(
        self, x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, conv_state: torch.Tensor
    ) -> torch.Tensor:
        """Causal conv + SiLU of every row (``weight [channels, kernel]``), updating ``conv_state`` in place."""
        from dgpp.kernels.causal_conv1d import causal_conv1d_decode
        from dgpp.nn.causal_conv1d import causal_conv1d_varlen

        out = torch.empty_like(x)
        for rows, seqs, fresh in self.steps:
            out[rows] = causal_conv1d_decode(
                x[rows], weight, bias, conv_state, self.state_slots[seqs], fresh, True
            )
        for a, b, seq, ctx in self.bulk:
            out[a:b] = causal_conv1d_varlen(
                x[a:b], weight, bias, conv_state, self.state_slots[seq : seq + 1], [b - a], [ctx], "silu"
            ).to(out.dtype)
        return out

    def delta(
        self,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        g: torch.Tensor,
        beta: torch.Tensor,
        state_pool: torch.Tensor,
        chunk_size: int,
    ) -> torch.Tensor:
        """The gated delta rule of every row (fp32 ``[T, Hv, dv]``), updating the pooled state in place."""
        from dgpp.kernels.gated_delta import gdn_decode_step_triton
        from dgpp.nn.gated_delta_rule import gated_delta_rule_varlen

        out = torch.empty(v.shape, dtype=torch.float32, device=v.device)
        for rows, seqs, fresh in self.steps:
            out[rows] = gdn_decode_step_triton(
                q[rows], k[rows], v[rows], g[rows], beta[rows], state_pool, self.state_slots[seqs], fresh
            ).float()
        for a, b, seq, ctx in self.bulk:
            out[a:b] = gated_delta_rule_varlen(
                q[a:b],
                k[a:b],
                v[a:b],
                g[a:b],
                beta[a:b],
                state_pool,
                self.state_slots[seq : seq + 1],
                [b - a],
                [ctx],
                chunk_size,
            ).float()
        return out


def plan_rows(batch: ForwardBatch, route: StepRoute) -> RecurrentPlan:
    """Split ``batch``'s sequences: canonical ones into one-token steps, the rest into chunked calls of their own."""
    device = batch.input_ids.device
    q_lens, ctx = batch.q_lens_cpu, batch.context_lens_cpu
    starts = [0]
    for n in q_lens:
        starts.append(starts[-1] + n)
    canonical = [i for i, n in enumerate(q_lens) if n > 0 and (route.per_row or n == 1)]
    bulk = [i for i, n in enumerate(q_lens) if n > 1 and not route.per_row]
    steps: list[RowStep] = []
    for j in range(max((q_lens[i] for i in canonical), default=0)):
        seqs = [i for i in canonical if q_lens[i] > j]
        rows = [starts[i] + j for i in seqs]
        fresh = [j == 0 and ctx[i] == 0 for i in seqs]
        steps.append(
            (
                _device(rows, torch.int64, device),
                _device(seqs, torch.int64, device),
                _device(fresh, torch.bool, device),
            )
        )
    return RecurrentPlan(steps, batch.state_slots, tuple((starts[i], starts[i + 1], i, ctx[i]) for i in bulk))


def _device(values: list, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    return torch.tensor(values, dtype=dtype).to(device, non_blocking=True)


def recurrent_plan(batch: ForwardBatch) -> RecurrentPlan | None:
    """The plan for a CUDA step that is not decode-only (decode-only steps keep the stock, graph-safe path), or
    None when routing is off / no route is set."""
    if not batch.input_ids.is_cuda or batch.is_decode_only:
        return None
    route = batch.route
    policy = current()
    if route is None and policy.exact_routing and policy.batch_invariant:
        route = route_for(batch.q_lens_cpu, batch.input_ids.device, per_row=True)
    return None if route is None else plan_rows(batch, route)


def conv_rows(
    conv: CausalConv1d,
    x: torch.Tensor,
    conv_state: torch.Tensor,
    batch: ForwardBatch,
    plan: RecurrentPlan | None,
) -> torch.Tensor:
    """Causal conv + SiLU of the step's rows: by ``plan`` when routed, else the layer's own dispatch (the
    graph-safe decode kernel on a decode-only step, the varlen form otherwise)."""
    if plan is not None:
        return plan.conv(x, conv.weight[:, 0, :], conv.bias, conv_state)
    return conv(x, conv_state, batch)


def delta_rule_rows(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    g: torch.Tensor,
    beta: torch.Tensor,
    state_pool: torch.Tensor,
    batch: ForwardBatch,
    plan: RecurrentPlan | None,
    chunk_size: int,
) -> torch.Tensor:
    """The gated delta rule of the step's rows (fp32 ``[T, Hv, dv]``; ``g`` per head or per head and key channel):
    on the CPU every row one recurrent step (a row's bits never depend on the prefill chunking or on the other
    sequences of the step); on CUDA by ``plan`` when routed; a decode-only CUDA step on the recurrent Triton step,
    which reads only device tensors (graph-safe); else the torch varlen form (on CUDA prefill it beat the chunked
    kernel, whose UT solve is sequential per program: docs/benchmarks.md)."""
    from dgpp.nn.gated_delta_rule import gated_delta_rule_rows, gated_delta_rule_varlen

    if not v.is_cuda:
        return gated_delta_rule_rows(
            q, k, v, g, beta, state_pool, batch.state_slots, batch.q_lens_cpu, batch.context_lens_cpu
        )
    if plan is not None:
        return plan.delta(q, k, v, g, beta, state_pool, chunk_size)
    if batch.is_decode_only:
        from dgpp import kernels

        slots, starts = batch.state_slots, batch.query_start_loc
        return kernels.gated_delta_rule(
            q, k, v, g, beta, state_pool, slots, starts, batch.fresh_flags(), True
        )
    return gated_delta_rule_varlen(
        q, k, v, g, beta, state_pool, batch.state_slots, batch.q_lens_cpu, batch.context_lens_cpu, chunk_size
    )
