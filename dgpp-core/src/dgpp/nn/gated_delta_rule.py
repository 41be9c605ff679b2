"""The gated delta rule (GDN's token mixing) over varlen sequences, with fp32 recurrent state in the state pool.

Per value head the state ``S`` is ``[dk, dv]``; one token does ``S <- exp(g)·S``, then writes the correction
``beta·(v - S^T k)`` along ``k`` (the delta rule), and reads ``o = S^T q``. q and k are L2-normalised and q is
scaled by ``dk^-1/2``; value head ``j`` reads key/query head ``j // (Hv/Hk)``.

The decay ``g`` is one log-factor per head (GDN) or one per head and key channel (Kimi delta attention, KDA:
``S <- diag(exp(g))·S`` decays each key row of the state on its own); every function here takes either shape.

Two forms. The chunked (UT-transform) form solves every token's contribution inside a chunk at once and hands the
state on sequentially from chunk to chunk; its rounding follows where the chunks fall, so a prompt cut into
prefill chunks, or padded beside other prompts, comes out a few ulps away from the prompt in one piece. The row
form (``gated_delta_rule_rows``) takes every row as one recurrent step with products whose bits do not depend on
the rows beside them, so a row's result depends only on its own sequence: the CPU's canonical form. Everything runs
in fp32; outputs are rounded to the input dtype once.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from dgpp.kernels._triton import use_triton
from dgpp.kernels.delta_chunk_prep import chunk_prep_triton
from dgpp.kernels.delta_chunk_walk import ChunkWalkInputs, chunk_walk
from dgpp.nn.batch_invariant import rows_elementwise
from dgpp.nn.causal_conv1d import token_layout

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
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    g: torch.Tensor,
    beta: torch.Tensor,
    state: torch.Tensor,
) -> tuple[torch.Tensor, torch.Tensor]:
    """One token per sequence. q/k ``[B, Hk, dk]``, v ``[B, Hv, dv]``, beta ``[B, Hv]``, g ``[B, Hv]`` or per key
    channel ``[B, Hv, dk]``, state ``[B, Hv, dk, dv]`` (fp32). Returns (output ``[B, Hv, dv]`` fp32, new state)."""
    q, k = _prepare_qk(q, k, v.shape[-2])
    v, g, beta = v.float(), g.float(), beta.float()
    state = state * (g.exp()[..., None] if g.dim() == q.dim() else g.exp()[..., None, None])
    predicted = torch.einsum("bhkv,bhk->bhv", state, k)
    correction = (v - predicted) * beta[..., None]
    state = state + k[..., :, None] * correction[..., None, :]
    out = torch.einsum("bhkv,bhk->bhv", state, q)
    return out, state


def _row_independent_step(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    decay: torch.Tensor,
    beta: torch.Tensor,
    state: torch.Tensor,
) -> tuple[torch.Tensor, torch.Tensor]:
    """``gated_delta_step`` on prepared (normalised, head-repeated, fp32) inputs and ``decay = exp(g)``, its two
    state products written as multiply-then-sum over the key channel: each output is one fixed-order sum over its
    own state column, whatever the number of sequences (a batched matrix product may block its sums by the batch
    size)."""
    state = state * (decay[..., None] if decay.dim() == q.dim() else decay[..., None, None])
    predicted = (state * k[..., :, None]).sum(dim=-2)
    correction = (v - predicted) * beta[..., None]
    state = state + k[..., :, None] * correction[..., None, :]
    return (state * q[..., :, None]).sum(dim=-2), state


def gated_delta_rule_rows(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    g: torch.Tensor,
    beta: torch.Tensor,
    state_pool: torch.Tensor,
    state_slots: torch.Tensor,
    q_lens: list[int],
    context_lens: list[int],
) -> torch.Tensor:
    """The gated delta rule over flattened token rows (shapes as ``gated_delta_rule_varlen``), every row one
    recurrent step: step ``j`` holds row ``j`` of each sequence that has one, so a row's bits are the same in a
    one-shot prompt, in any cut of it into prefill chunks, as a decode or verify row, and beside any other
    sequences. Returns ``[T, Hv, dv]`` fp32 (zeros for padding rows, whose slot is -1)."""
    device = v.device
    out = torch.zeros(v.shape, dtype=torch.float32, device=device)
    slot_list = state_slots.tolist()
    # longest first: the sequences still running at step j are always a prefix of this order
    order = sorted((i for i, n in enumerate(q_lens) if n > 0 and slot_list[i] >= 0), key=lambda i: -q_lens[i])
    if not order:
        return out
    starts = [0]
    for n in q_lens:
        starts.append(starts[-1] + n)
    slots = state_slots[torch.tensor(order, dtype=torch.int64, device=device)]
    state = initial_states(state_pool, slots, [context_lens[i] for i in order])
    q, k = _prepare_qk(q, k, v.shape[-2])
    v, beta = v.float(), beta.float()
    decay = rows_elementwise(torch.exp, g.float())  # all rows at once, each with its bits alone
    first_rows = torch.tensor([starts[i] for i in order], dtype=torch.int64, device=device)
    running = len(order)
    for j in range(q_lens[order[0]]):
        while q_lens[order[running - 1]] <= j:
            running -= 1
        rows = first_rows[:running] + j
        out[rows], state[:running] = _row_independent_step(
            q[rows], k[rows], v[rows], decay[rows], beta[rows], state[:running]
        )
    state_pool[slots] = state.to(state_pool.dtype)
    return out


def chunked_gated_delta_rule(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    g: torch.Tensor,
    beta: torch.Tensor,
    state: torch.Tensor,
    chunk_size: int = CHUNK_SIZE,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Padded batch form. q/k ``[B, L, Hk, dk]``, v ``[B, L, Hv, dv]``, beta ``[B, L, Hv]``, g ``[B, L, Hv]`` or per
    key channel ``[B, L, Hv, dk]``, state ``[B, Hv, dk, dv]``. Padding rows must carry k = v = beta = g = 0 (they
    then leave the state untouched). Returns (output ``[B, L, Hv, dv]`` fp32, final state fp32)."""
    batch, length, num_v_heads, dv = v.shape
    num_chunks = -(-length // chunk_size)
    if g.dim() == v.dim():
        q, k = _prepare_qk(q, k, num_v_heads)
        chunks = [_heads_first_chunked(x, chunk_size) for x in (q, k, v, g, beta)]
        out, state = _per_channel_chunks(*chunks, state.float())
        return _rows_first(out, length), state
    # every chunk's UT transform at once (one launch on CUDA), then the chunk-to-chunk hand-off of the state
    # (dgpp.kernels.delta_chunk_walk, one launch on CUDA)
    prepare = chunk_prep_triton if use_triton(v) else chunk_operands
    out, state = chunk_walk(prepare(q, k, v, g, beta, state, chunk_size))
    out = out.view(batch, num_v_heads, num_chunks, chunk_size, dv)
    return _rows_first(out, length), state.view(batch, num_v_heads, *state.shape[1:])


def _heads_first_chunked(x: torch.Tensor, chunk_size: int) -> torch.Tensor:
    """``[B, L, H, ...]`` -> fp32 ``[B, H, N, C, ...]``, the last chunk zero-padded."""
    batch, length, heads = x.shape[:3]
    pad = (-length) % chunk_size
    x = x.float().transpose(1, 2)
    x = F.pad(x, (0, 0, 0, pad)) if x.dim() == 4 else F.pad(x, (0, pad))
    return x.reshape(batch, heads, (length + pad) // chunk_size, chunk_size, *x.shape[3:])


def _rows_first(x: torch.Tensor, length: int) -> torch.Tensor:
    """``[B, H, N, C, dv]`` -> ``[B, L, H, dv]`` (the padding rows dropped)."""
    batch, heads, num_chunks, chunk_size, dv = x.shape
    return x.reshape(batch, heads, num_chunks * chunk_size, dv)[:, :, :length].transpose(1, 2)


def chunk_operands(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    g: torch.Tensor,
    beta: torch.Tensor,
    state: torch.Tensor,
    chunk_size: int,
) -> ChunkWalkInputs:
    """The walk's operands (one decay per head) as torch products: every chunk's UT transform solved at once
    (``dgpp.kernels.delta_chunk_prep`` is the one-launch form)."""
    batch, _, num_v_heads, _ = v.shape
    q, k = _prepare_qk(q, k, num_v_heads)
    q, k, v, g, beta = (_heads_first_chunked(x, chunk_size) for x in (q, k, v, g, beta))
    log_decay = g.cumsum(dim=-1)  # within each chunk, log of the decay from chunk start to position i
    causal = torch.ones(chunk_size, chunk_size, dtype=torch.bool, device=q.device).tril()
    # decay_between[i, j] = exp(log_decay_i - log_decay_j) for j <= i, zero above the diagonal
    decay_between = (
        (log_decay[..., :, None] - log_decay[..., None, :]).masked_fill(~causal, float("-inf")).exp()
    )

    k_beta = k * beta[..., None]
    # UT transform: (I + strict_lower(beta_i k_i·k_j decay_ij)) X = RHS, solved once per chunk for both
    # the beta-weighted values and the decayed keys that read the incoming state.
    # unitriangular: the solver takes the unit diagonal as given, so only the strict lower part is kept
    system = ((k_beta @ k.transpose(-1, -2)) * decay_between).tril(-1)
    values_solved = torch.linalg.solve_triangular(
        system, v * beta[..., None], upper=False, unitriangular=True
    )
    keys_solved = torch.linalg.solve_triangular(
        system, k_beta * log_decay.exp()[..., None], upper=False, unitriangular=True
    )
    heads = batch * num_v_heads

    def by_head(x: torch.Tensor) -> torch.Tensor:  # [B, H, N, ...] -> [B*H, N, ...]
        return x.reshape(heads, *x.shape[2:]).contiguous()

    return ChunkWalkInputs(
        by_head(values_solved),
        by_head(keys_solved),
        by_head(q * log_decay.exp()[..., None]),
        by_head((q @ k.transpose(-1, -2)) * decay_between),
        by_head(k * (log_decay[..., -1:] - log_decay).exp()[..., None]),
        by_head(log_decay[..., -1].exp()),
        state.float().reshape(heads, *state.shape[2:]).contiguous(),
    )


def _per_channel_chunks(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    g: torch.Tensor,
    beta: torch.Tensor,
    state: torch.Tensor,
) -> tuple[torch.Tensor, torch.Tensor]:
    """The chunked form with a decay per key channel (KDA), chunk by chunk: q/k/g ``[B, H, N, C, dk]``, v
    ``[B, H, N, C, dv]``, beta ``[B, H, N, C]``. The pairwise decays ``exp(G_i - G_j)`` are per channel
    (``[C, C, dk]``), so they are built one chunk at a time; masked to -inf above the diagonal before ``exp`` (a
    positive exponent there would overflow)."""
    chunk_size = q.shape[-2]
    log_decay = g.cumsum(dim=-2)
    causal = torch.ones(chunk_size, chunk_size, dtype=torch.bool, device=q.device).tril()
    out = torch.empty_like(v)
    for n in range(q.shape[2]):
        qn, kn, vn, bn, decay = q[:, :, n], k[:, :, n], v[:, :, n], beta[:, :, n, :, None], log_decay[:, :, n]
        between = (decay[..., :, None, :] - decay[..., None, :, :]).masked_fill(
            ~causal[..., None], float("-inf")
        )
        between = between.exp()  # [B, H, C, C, dk]: exp(G_i - G_j) for j <= i, else 0
        k_beta = kn * bn
        system = torch.einsum("bhic,bhjc,bhijc->bhij", k_beta, kn, between).tril(-1)
        values_solved = torch.linalg.solve_triangular(system, vn * bn, upper=False, unitriangular=True)
        keys_solved = torch.linalg.solve_triangular(
            system, k_beta * decay.exp(), upper=False, unitriangular=True
        )
        intra = torch.einsum("bhic,bhjc,bhijc->bhij", qn, kn, between)
        new_values = values_solved - keys_solved @ state
        out[:, :, n] = (qn * decay.exp()) @ state + intra @ new_values
        last = decay[..., -1:, :]  # [B, H, 1, dk]
        state = (
            state * last.exp().transpose(-1, -2) + (kn * (last - decay).exp()).transpose(-1, -2) @ new_values
        )
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
    ``state_pool[state_slots]``. q/k ``[T, Hk, dk]``, v ``[T, Hv, dv]``, beta ``[T, Hv]``, g ``[T, Hv]`` or
    ``[T, Hv, dk]``. Returns ``[T, Hv, dv]``
    fp32 (zeros for padding rows, whose slot is -1). Single-token sequences take the recurrent step; longer
    ones the chunked form, padded together (one such sequence: its own rows, unpadded)."""
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

    # one prompt (the routed path's call per sequence): its rows as they lie, no scatter into a padded batch
    if len(prefill) == 1:
        (i,) = prefill
        first = sum(q_lens[:i])
        rows_of = slice(first, first + q_lens[i])
        slots = state_slots[i : i + 1]
        state = initial_states(state_pool, slots, [context_lens[i]])
        chunk_out, state = chunked_gated_delta_rule(
            *(x[rows_of][None] for x in (q, k, v, g, beta)), state, chunk_size
        )
        out[rows_of] = chunk_out[0]
        state_pool[slots] = state.to(state_pool.dtype)
    elif prefill:
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
