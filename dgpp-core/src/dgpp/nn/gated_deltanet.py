"""Gated DeltaNet (GDN): the gated delta rule over varlen sequences with fp32 recurrent state in the state pool.

Per value head the state ``S`` is ``[dk, dv]``; one token does ``S <- exp(g)·S``, then writes the correction
``beta·(v - S^T k)`` along ``k`` (the delta rule), and reads ``o = S^T q``. q and k are L2-normalised and q is
scaled by ``dk^-1/2``; value head ``j`` reads key/query head ``j // (Hv/Hk)``.

Prefill uses the chunked (UT-transform) form: inside a chunk every token's contribution is solved at once, and
only the chunk-to-chunk state hand-off is sequential. Decode rows (one token) take the plain recurrent step.
Everything runs in fp32; outputs are rounded to the input dtype once.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from dgpp.engine.batch import ForwardBatch
from dgpp.engine.cache_spec import StateSpec
from dgpp.family import World
from dgpp.nn.causal_conv1d import CausalConv1d, token_layout
from dgpp.nn.linear import Linear
from dgpp.nn.norm import rms_normalize
from dgpp.nn.weights import WeightShapeError, copy_checked, default_weight_loader, narrow_for_rank, set_weight_attrs

CHUNK_SIZE = 64


def l2_normalize(x: torch.Tensor, eps: float = 1e-6) -> torch.Tensor:
    return x * torch.rsqrt((x * x).sum(dim=-1, keepdim=True) + eps)


def _prepare_qk(q: torch.Tensor, k: torch.Tensor, num_v_heads: int) -> tuple[torch.Tensor, torch.Tensor]:
    """fp32, L2-normalised, q scaled, and key heads repeated so that value head j reads key head j // group."""
    group = num_v_heads // q.shape[-2]
    q = l2_normalize(q.float())
    k = l2_normalize(k.float())
    q = q * q.shape[-1] ** -0.5
    if group > 1:
        q = q.repeat_interleave(group, dim=-2)
        k = k.repeat_interleave(group, dim=-2)
    return q, k


def initial_states(pool: torch.Tensor, slots: torch.Tensor, context_lens: list[int]) -> torch.Tensor:
    """Each sequence's starting state: its slot's state, or zeros when it starts at position 0."""
    states = pool[slots].float()
    fresh = torch.tensor([c == 0 for c in context_lens], dtype=torch.bool, device=pool.device)
    return torch.where(fresh[:, None, None, None], torch.zeros_like(states), states)


def gated_delta_step(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor, beta: torch.Tensor, state: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """One token per sequence. q/k ``[B, Hk, dk]``, v ``[B, Hv, dv]``, g/beta ``[B, Hv]``, state ``[B, Hv, dk, dv]``
    (fp32). Returns (output ``[B, Hv, dv]`` fp32, new state)."""
    q, k = _prepare_qk(q, k, v.shape[-2])
    v, g, beta = v.float(), g.float(), beta.float()
    state = state * g.exp()[..., None, None]
    predicted = torch.einsum("bhkv,bhk->bhv", state, k)
    correction = (v - predicted) * beta[..., None]
    state = state + k[..., :, None] * correction[..., None, :]
    out = torch.einsum("bhkv,bhk->bhv", state, q)
    return out, state


def chunked_gated_delta_rule(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    g: torch.Tensor,
    beta: torch.Tensor,
    state: torch.Tensor,
    chunk_size: int = CHUNK_SIZE,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Padded batch form. q/k ``[B, L, Hk, dk]``, v ``[B, L, Hv, dv]``, g/beta ``[B, L, Hv]``, state
    ``[B, Hv, dk, dv]``. Padding rows must carry k = v = beta = g = 0 (they then leave the state untouched).
    Returns (output ``[B, L, Hv, dv]`` fp32, final state fp32)."""
    batch, length, num_v_heads, dv = v.shape
    q, k = _prepare_qk(q, k, num_v_heads)
    pad = (-length) % chunk_size
    num_chunks = (length + pad) // chunk_size

    def heads_first_chunked(x: torch.Tensor) -> torch.Tensor:  # [B, L, H, ...] -> [B, H, N, C, ...]
        x = x.float().transpose(1, 2)
        x = F.pad(x, (0, 0, 0, pad)) if x.dim() == 4 else F.pad(x, (0, pad))
        return x.reshape(batch, num_v_heads, num_chunks, chunk_size, *x.shape[3:])

    q, k, v, g, beta = (heads_first_chunked(x) for x in (q, k, v, g, beta))
    log_decay = g.cumsum(dim=-1)  # within each chunk, log of the decay from chunk start to position i
    causal = torch.ones(chunk_size, chunk_size, dtype=torch.bool, device=q.device).tril()
    # decay_between[i, j] = exp(log_decay_i - log_decay_j) for j <= i, zero above the diagonal
    decay_between = (log_decay[..., :, None] - log_decay[..., None, :]).masked_fill(~causal, float("-inf")).exp()

    k_beta = k * beta[..., None]
    # UT transform: (I + strict_lower(beta_i k_i·k_j decay_ij)) X = RHS, solved once per chunk for both
    # the beta-weighted values and the decayed keys that read the incoming state.
    # unitriangular: the solver takes the unit diagonal as given, so only the strict lower part is kept
    system = ((k_beta @ k.transpose(-1, -2)) * decay_between).tril(-1)
    values_solved = torch.linalg.solve_triangular(system, v * beta[..., None], upper=False, unitriangular=True)
    keys_solved = torch.linalg.solve_triangular(
        system, k_beta * log_decay.exp()[..., None], upper=False, unitriangular=True
    )

    intra = (q @ k.transpose(-1, -2)) * decay_between
    q_decayed = q * log_decay.exp()[..., None]
    k_to_end = k * (log_decay[..., -1:] - log_decay).exp()[..., None]
    chunk_decay = log_decay[..., -1].exp()[..., None, None]

    state = state.float()
    out = torch.empty_like(v)
    for n in range(num_chunks):
        new_values = values_solved[:, :, n] - keys_solved[:, :, n] @ state
        out[:, :, n] = q_decayed[:, :, n] @ state + intra[:, :, n] @ new_values
        state = state * chunk_decay[:, :, n] + k_to_end[:, :, n].transpose(-1, -2) @ new_values
    out = out.reshape(batch, num_v_heads, num_chunks * chunk_size, dv)[:, :, :length].transpose(1, 2)
    return out, state


def gated_delta_rule_varlen(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    g: torch.Tensor,
    beta: torch.Tensor,
    state_pool: torch.Tensor,
    state_slots: torch.Tensor,
    q_lens: list[int],
    context_lens: list[int],
    chunk_size: int = CHUNK_SIZE,
) -> torch.Tensor:
    """The gated delta rule over flattened token rows (``q_lens`` per sequence), state read from and written to
    ``state_pool[state_slots]``. q/k ``[T, Hk, dk]``, v ``[T, Hv, dv]``, g/beta ``[T, Hv]``. Returns ``[T, Hv, dv]``
    fp32 (zeros for padding rows, whose slot is -1). Single-token sequences take the recurrent step; longer
    ones the chunked form, padded together."""
    device = v.device
    out = torch.zeros(v.shape, dtype=torch.float32, device=device)
    seq_of_token, offset_in_seq, starts = token_layout(q_lens, device)
    live = [slot >= 0 for slot in state_slots.tolist()]  # slot -1: a padding row, nothing read or written
    decode = [i for i, n in enumerate(q_lens) if n == 1 and live[i]]
    prefill = [i for i, n in enumerate(q_lens) if n > 1 and live[i]]

    if decode:
        seqs = torch.tensor(decode, dtype=torch.int64, device=device)
        rows = starts[seqs]
        slots = state_slots[seqs]
        state = initial_states(state_pool, slots, [context_lens[i] for i in decode])
        out[rows], state = gated_delta_step(q[rows], k[rows], v[rows], g[rows], beta[rows], state)
        state_pool[slots] = state.to(state_pool.dtype)

    if prefill:
        seqs = torch.tensor(prefill, dtype=torch.int64, device=device)
        slots = state_slots[seqs]
        # Scatter each prefill sequence's rows into a zero-padded [B', Lmax] batch.
        batch_index = torch.full((len(q_lens),), -1, dtype=torch.int64, device=device)
        batch_index[seqs] = torch.arange(len(prefill), device=device)
        token_batch = batch_index[seq_of_token]
        rows = (token_batch >= 0).nonzero().squeeze(-1)
        max_len = max(q_lens[i] for i in prefill)

        def padded(x: torch.Tensor) -> torch.Tensor:
            buf = torch.zeros((len(prefill), max_len, *x.shape[1:]), dtype=x.dtype, device=device)
            buf[token_batch[rows], offset_in_seq[rows]] = x[rows]
            return buf

        state = initial_states(state_pool, slots, [context_lens[i] for i in prefill])
        chunk_out, state = chunked_gated_delta_rule(
            padded(q), padded(k), padded(v), padded(g), padded(beta), state, chunk_size
        )
        out[rows] = chunk_out[token_batch[rows], offset_in_seq[rows]]
        state_pool[slots] = state.to(state_pool.dtype)
    return out


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
    """Per-head RMSNorm (plain ``w``, not ``1+w``), rounded to the input dtype, then times ``silu(gate)``."""

    def __init__(self, dim: int, eps: float = 1e-6, *, dtype: torch.dtype = torch.float32):
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.empty(dim, dtype=dtype), requires_grad=False)
        set_weight_attrs(self.weight, weight_loader=default_weight_loader)

    def forward(self, x: torch.Tensor, gate: torch.Tensor) -> torch.Tensor:
        normed = rms_normalize(x, self.eps).to(x.dtype)
        return (self.weight * normed * F.silu(gate.float())).to(x.dtype)


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
            raise ValueError(f"{name}: value heads {num_v_heads} must be a multiple of key heads {num_k_heads}")
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
        self.out_proj = Linear(num_v_heads * head_v_dim, hidden_size, dtype=dtype, parallel="row", world=world)

    def cache_spec(self) -> StateSpec:
        return StateSpec(
            {
                "conv": (self.conv1d.state_shape(), self.dtype),
                "recurrent": ((self.num_v_heads, self.head_k_dim, self.head_v_dim), torch.float32),
            }
        )

    def forward(self, hidden: torch.Tensor, batch: ForwardBatch) -> torch.Tensor:
        state = batch.cache.state[self.name]
        rows = hidden.shape[0]
        mixed = self.conv1d(self.in_proj_qkv(hidden), state["conv"], batch)
        q, k, v = mixed.split([self.key_dim, self.key_dim, self.value_dim], dim=-1)
        q = q.reshape(rows, self.num_k_heads, self.head_k_dim)
        k = k.reshape(rows, self.num_k_heads, self.head_k_dim)
        v = v.reshape(rows, self.num_v_heads, self.head_v_dim)
        beta = self.in_proj_b(hidden).sigmoid()
        # decay in log space, in fp32 (exp(A_log) overflows fp16 and loses bits in bf16)
        g = -self.A_log.float().exp() * F.softplus(self.in_proj_a(hidden).float() + self.dt_bias)
        if hidden.is_cuda and batch.is_decode_only:  # Triton decode step on the pooled state, no host sync
            # (prefill stays on the torch chunked form: on the H200 it beat dgpp.kernels' chunked kernel, whose
            # UT solve is still sequential per program; docs/benchmarks.md)
            from dgpp import kernels

            core = kernels.gated_delta_rule(
                q, k, v, g, beta, state["recurrent"], batch.state_slots, batch.query_start_loc,
                batch.context_lens == 0, True,
            ).to(hidden.dtype)
        else:
            core = gated_delta_rule_varlen(
                q, k, v, g, beta, state["recurrent"], batch.state_slots,
                batch.q_lens_cpu, batch.context_lens_cpu, self.chunk_size,
            ).to(hidden.dtype)
        z = self.in_proj_z(hidden).reshape(rows, self.num_v_heads, self.head_v_dim)
        return self.out_proj(self.norm(core, z).reshape(rows, self.value_dim))
