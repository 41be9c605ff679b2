"""PLE: Qwen3.8-Flash-Next's per-layer hashed n-gram embedding, injected into every residual stream.

Hash (exactly the reference's): for n-gram order ``n`` in ``2..ngram_size`` and token ``t``,
``mixed = tok[t]·m0 ^ tok[t-1]·m1 ^ ... ^ tok[t-n+1]·m(n-1)`` in int64, where a token before the start of
its EOS-delimited segment (or of the sequence) reads as EOS. Each order has ``heads_per_ngram`` heads;
head ``h`` looks up row ``offset_h + mixed mod prime_h`` of the layer's table. The odd multipliers come
from ``dgpp.splitmix`` (the state stepping by its golden gamma) over ``seed + 10007·ple_index``; the primes
are the consecutive primes from ``ngram_vocab_size_base`` on, ``heads`` of them per PLE layer in layer order.

The previous ``ngram_size - 1`` token ids and the dilated conv's last ``(kernel-1)·ngram_size`` inputs cross
decode steps: they are this layer's ``StateSpec`` entry (``ngram_context``, ``conv``), snapshotted with the
rest of the request state. A sequence starting at position 0 reads EOS context and a zero conv history.
The table itself lives in ``table.py`` (resident or memory-mapped).
"""

from __future__ import annotations

import itertools
import math
from typing import cast

import torch
import torch.nn.functional as F
from torch import nn

from dgpp.kernels.ngram_decode import NgramInjectInputs, NgramRowsInputs, ngram_inject, ngram_rows
from dgpp.nn.batch_invariant import batch_invariant_rows
from dgpp.nn.exact.recurrent import RecurrentPlan, recurrent_plan
from dgpp.nn.linear import Linear
from dgpp.nn.weights import default_weight_loader, set_weight_attrs
from dgpp.plugin_api import ForwardBatch, StateSpec
from dgpp.splitmix import GOLDEN_GAMMA, MASK64, splitmix64
from dgpp_qwen.layers.gated_residual import GroupedRMSNorm
from dgpp_qwen.qwen4_exp_config import NGramConfig

_LAYER_SEED_STRIDE = 10007
Sequences = list[tuple[int, int]]  # (sequence index, its first row in the step)


def hash_multipliers(vocab_size: int, ngram_size: int, ple_index: int, seed: int) -> list[int]:
    """Odd multipliers, one per n-gram position, small enough that ``token · m`` fits in int64."""
    half_bound = max(1, ((1 << 63) - 1) // max(vocab_size, 1) // 2)
    layer_seed = seed + _LAYER_SEED_STRIDE * ple_index
    return [
        2 * (splitmix64((layer_seed + GOLDEN_GAMMA * (i + 1)) & MASK64) % half_bound) + 1
        for i in range(ngram_size)
    ]


def _is_prime(n: int) -> bool:
    if n < 2 or n % 2 == 0:
        return n == 2
    return all(n % d for d in range(3, math.isqrt(n) + 1, 2))


def head_vocab_sizes(base: int, ple_index: int, num_heads: int) -> list[int]:
    """The primes of this PLE layer's heads: numbers ``ple_index·heads .. +heads`` (0-based) among the
    consecutive primes ``>= base``."""
    primes: list[int] = []
    candidate = base
    while len(primes) < (ple_index + 1) * num_heads:
        if _is_prime(candidate):
            primes.append(candidate)
        candidate += 1
    return primes[ple_index * num_heads :]


def shifted_in_segment(history: torch.Tensor, shift: int, eos: int) -> torch.Tensor:
    """``history[t - shift]`` where no EOS lies in ``history[t-shift+1 .. t-1]`` and ``t >= shift``, else EOS."""
    if shift == 0:
        return history
    length = history.shape[0]
    positions = torch.arange(length, device=history.device)
    eos_at = torch.where(history == eos, positions, -1)
    last_eos_before = torch.cat([eos_at.new_full((1,), -1), torch.cummax(eos_at, 0).values[:-1]])
    valid = (positions - (last_eos_before + 1) >= shift) & (positions >= shift)
    source = history[(positions - shift).clamp_min(0)]
    return torch.where(valid, source, torch.full_like(history, eos))


class NGramHasher(nn.Module):
    """Token history -> table row ids ``[L, heads]`` for one PLE layer."""

    multipliers: torch.Tensor  # buffers, declared for the type checker
    sizes: torch.Tensor
    offsets: torch.Tensor

    def __init__(self, cfg: NGramConfig, vocab_size: int, ple_index: int) -> None:
        super().__init__()
        self.cfg = cfg
        sizes = head_vocab_sizes(cfg.vocab_size_base, ple_index, cfg.num_heads)
        offsets = [sum(sizes[:h]) for h in range(len(sizes))]
        self.rows_needed = sum(sizes)  # the largest row id is rows_needed - 1
        self.table_rows = (
            math.ceil(self.rows_needed / cfg.vocab_divisor) * cfg.vocab_divisor
        )  # as transformers pads
        self.register_buffer(
            "multipliers",
            torch.tensor(hash_multipliers(vocab_size, cfg.ngram_size, ple_index, cfg.seed)),
            persistent=False,
        )
        self.register_buffer("sizes", torch.tensor(sizes, dtype=torch.int64), persistent=False)
        self.register_buffer("offsets", torch.tensor(offsets, dtype=torch.int64), persistent=False)

    def forward(self, history: torch.Tensor, length: int) -> torch.Tensor:
        """Row ids of the last ``length`` tokens of ``history`` (int64, context first)."""
        cfg = self.cfg
        shifted = [shifted_in_segment(history, s, cfg.eos_token_id) for s in range(cfg.ngram_size)]
        ids = []
        for order in range(2, cfg.ngram_size + 1):
            heads = slice((order - 2) * cfg.heads_per_ngram, (order - 1) * cfg.heads_per_ngram)
            mixed = shifted[0] * self.multipliers[0]
            for pos in range(1, order):
                mixed = torch.bitwise_xor(mixed, shifted[pos] * self.multipliers[pos])
            ids.append(torch.remainder(mixed[:, None], self.sizes[heads]) + self.offsets[heads])
        return torch.cat(ids, dim=-1)[-length:]


class DilatedDepthwiseConv(nn.Module):
    """``weight [C, 1, K]``; output ``t`` = Σ_k w[:, k] · x[t - (K-1-k)·dilation], accumulated in fp32 tap by
    tap (row-independent), from a history of the previous ``(K-1)·dilation`` inputs."""

    def __init__(self, channels: int, kernel: int, dilation: int, *, dtype: torch.dtype) -> None:
        super().__init__()
        self.kernel, self.dilation = kernel, dilation
        self.weight = nn.Parameter(torch.empty(channels, 1, kernel, dtype=dtype), requires_grad=False)
        set_weight_attrs(self.weight, weight_loader=default_weight_loader)

    @property
    def history(self) -> int:
        return (self.kernel - 1) * self.dilation

    def forward(self, padded: torch.Tensor) -> torch.Tensor:
        """``padded`` ``[history + L, C]`` -> ``[L, C]`` fp32."""
        length = padded.shape[0] - self.history
        weight = self.weight[:, 0, :].float()
        out = torch.zeros(length, padded.shape[1], dtype=torch.float32, device=padded.device)
        for k in range(self.kernel):
            start = k * self.dilation
            out += padded[start : start + length].float() * weight[:, k]
        return out


class PLELayer(nn.Module):
    """One PLE site (checkpoint names under ``ple.``: ``ple_embedding``, ``key_proj``, ``value_proj``,
    ``norm_key``, ``norm_query``, ``norm_conv``, ``conv1d``). ``forward`` adds to the hyper state ``[T, hc·H]``:
    per stream ``σ(ssqrt(k̂·q̂/√H)) · value``, plus ``silu(conv(norm(that)))``. CUDA decode steps take
    ``dgpp.kernels.ngram_decode`` (two launches besides the table gather and the two projections)."""

    @property
    def hasher(self) -> NGramHasher:
        """The n-gram hasher the table was built for (held by the table, which names only its row counts)."""
        return cast(NGramHasher, self.ple_embedding.hasher)

    def __init__(
        self,
        cfg: NGramConfig,
        name: str,
        ple_index: int,
        *,
        vocab_size: int,
        hidden_size: int,
        hc_count: int,
        eps: float,
        dtype: torch.dtype,
    ) -> None:
        super().__init__()
        from dgpp_qwen.layers.table import NGramEmbedding

        self.name, self.cfg, self.dtype = name, cfg, dtype
        self.hidden_size, self.hc_count = hidden_size, hc_count
        width = hidden_size * hc_count
        hasher = NGramHasher(cfg, vocab_size, ple_index)
        self.table_rows = hasher.table_rows  # the padded rows the hash addresses
        self.ple_embedding = NGramEmbedding(hasher, cfg.embed_dim // cfg.num_heads)
        self.key_proj = Linear(cfg.embed_dim, width, dtype=dtype)
        self.value_proj = Linear(cfg.embed_dim, hidden_size, dtype=dtype)
        self.norm_key = GroupedRMSNorm(width, hidden_size, eps, dtype=dtype)
        self.norm_query = GroupedRMSNorm(width, hidden_size, eps, dtype=dtype)
        self.norm_conv = GroupedRMSNorm(width, hidden_size, eps, dtype=dtype)
        self.conv1d = DilatedDepthwiseConv(width, cfg.conv_kernel, cfg.ngram_size, dtype=dtype)

    def allocate_tables(self, device: torch.device | str) -> list[torch.Tensor]:
        """The n-gram table (``table_rows`` rows in the layer's dtype), resident and uninitialised: ``dgpp bench``
        fills it with random rows, as it fills the parameters."""
        return [self.ple_embedding.allocate(self.table_rows, self.dtype, device)]

    def cache_spec(self) -> StateSpec:
        return StateSpec(
            {
                "ngram_context": ((self.cfg.ngram_size - 1,), torch.int64),
                "conv": ((self.conv1d.history, self.hidden_size * self.hc_count), self.dtype),
            }
        )

    def _row_ids(
        self, batch: ForwardBatch, context: torch.Tensor, ids: torch.Tensor, sequences: Sequences
    ) -> None:
        """Table rows of ``sequences`` (``(sequence, first row)``) into ``ids [T, heads]``; stores each live
        sequence's last token ids as its next context."""
        eos, keep = self.cfg.eos_token_id, self.cfg.ngram_size - 1
        for i, start in sequences:
            q_len = batch.q_lens_cpu[i]
            if not q_len:
                continue
            slot = int(batch.state_slots[i])
            tokens = batch.input_ids[start : start + q_len]
            fresh = batch.context_lens_cpu[i] == 0 or slot < 0
            previous = tokens.new_full((keep,), eos) if fresh else context[slot]
            history = torch.cat([previous, tokens])
            ids[start : start + q_len] = self.hasher(history, q_len)
            if slot >= 0:
                context[slot] = history[-keep:]

    def _conv(
        self,
        x: torch.Tensor,
        batch: ForwardBatch,
        conv_state: torch.Tensor,
        out: torch.Tensor,
        sequences: Sequences,
    ) -> None:
        """``silu(conv(x))`` of ``sequences``' rows into ``out``, each over its own conv history (then updated)."""
        hist = self.conv1d.history
        for i, start in sequences:
            q_len = batch.q_lens_cpu[i]
            slot = int(batch.state_slots[i])
            fresh = batch.context_lens_cpu[i] == 0 or slot < 0
            previous = x.new_zeros(hist, x.shape[1]) if fresh else conv_state[slot].to(x.dtype)
            padded = torch.cat([previous, x[start : start + q_len]])
            out[start : start + q_len] = batch_invariant_rows(F.silu, self.conv1d(padded).to(x.dtype))
            if slot >= 0:
                conv_state[slot] = padded[-hist:].to(conv_state.dtype)

    def _gated(self, hyper: torch.Tensor, key: torch.Tensor, value: torch.Tensor) -> torch.Tensor:
        """Per stream ``σ(ssqrt(k̂·q̂/√H)) · value`` (``key``: the key projection, before its norm)."""
        streams = (self.hc_count, self.hidden_size)
        key = self.norm_key(key).unflatten(-1, streams)
        query = self.norm_query(hyper).unflatten(-1, streams)
        gate = (key * query).sum(dim=-1, keepdim=True) / math.sqrt(self.hidden_size)
        gate = gate.abs().clamp_min(1e-6).sqrt() * gate.sign()  # signed square root
        # sigmoid on padded rows: a CPU vector tail would make a row depend on the step's row count
        gate = batch_invariant_rows(torch.sigmoid, gate.flatten(1)).unsqueeze(-1)
        return (gate * value.unsqueeze(-2)).flatten(-2)

    def _kernel_rows(
        self,
        hyper: torch.Tensor,
        batch: ForwardBatch,
        state: dict[str, torch.Tensor],
        plan: RecurrentPlan | None,
    ) -> torch.Tensor:
        """CUDA: decode rows through the n-gram kernels, which read no host value (a decode-only step is
        graph-safe). Under the step's route (``plan``) a verify's rows go one position at a time through the same
        kernels, as plain decode takes them; a prefill chunk keeps the torch form, one sequence per call."""
        cfg, hasher, context = self.cfg, self.hasher, state["ngram_context"]
        if plan is None:
            steps: list[tuple[torch.Tensor | None, torch.Tensor, torch.Tensor]] = [
                (None, batch.state_slots, batch.fresh_flags())
            ]
            bulk: Sequences = []
        else:
            steps = [(rows, plan.state_slots[seqs], fresh) for rows, seqs, fresh in plan.steps]
            bulk = [(seq, first) for first, _end, seq, _ctx in plan.bulk]
        ids = torch.empty(hyper.shape[0], cfg.num_heads, dtype=torch.int64, device=hyper.device)
        for rows, slots, fresh in steps:
            tokens = batch.input_ids if rows is None else batch.input_ids[rows]
            hash_inputs = (
                hasher.multipliers,
                hasher.sizes,
                hasher.offsets,
                cfg.heads_per_ngram,
                cfg.eos_token_id,
            )
            found = ngram_rows(NgramRowsInputs(tokens, context, slots, fresh, *hash_inputs))
            if rows is None:
                ids = found
            else:
                ids[rows] = found
        self._row_ids(batch, context, ids, bulk)
        embeddings = self.ple_embedding(ids).to(self.dtype)
        key, value = self.key_proj(embeddings), self.value_proj(embeddings)

        def inject(rows: torch.Tensor | None, slots: torch.Tensor, fresh: torch.Tensor) -> torch.Tensor:
            h, k, v = (hyper, key, value) if rows is None else (hyper[rows], key[rows], value[rows])
            return ngram_inject(
                NgramInjectInputs(
                    h,
                    k,
                    v,
                    (self.norm_key.weight, self.norm_query.weight, self.norm_conv.weight),
                    self.conv1d.weight[:, 0, :],
                    state["conv"],
                    slots,
                    fresh,
                    self.hc_count,
                    self.conv1d.dilation,
                    self.norm_key.eps,
                )
            )

        if plan is None:
            return inject(*steps[0])
        out = torch.empty_like(hyper)
        for rows, slots, fresh in steps:
            out[rows] = inject(rows, slots, fresh)
        if bulk:
            gated = self._gated(hyper, key, value)
            convolved = torch.empty_like(gated)
            self._conv(self.norm_conv(gated), batch, state["conv"], convolved, bulk)
            for first, end, _seq, _ctx in plan.bulk:
                out[first:end] = hyper[first:end] + (gated[first:end] + convolved[first:end])
        return out

    def forward(self, hyper: torch.Tensor, batch: ForwardBatch) -> torch.Tensor:
        """The hyper state with this layer's n-gram injection added."""
        state = batch.cache.state[self.name]
        plan = recurrent_plan(batch)
        if hyper.is_cuda and (batch.is_decode_only or plan is not None):
            return self._kernel_rows(hyper, batch, state, plan)
        every: Sequences = list(enumerate(itertools.accumulate(batch.q_lens_cpu[:-1], initial=0)))
        ids = torch.empty(hyper.shape[0], self.cfg.num_heads, dtype=torch.int64, device=hyper.device)
        self._row_ids(batch, state["ngram_context"], ids, every)
        embeddings = self.ple_embedding(ids).to(self.dtype)
        gated = self._gated(hyper, self.key_proj(embeddings), self.value_proj(embeddings))
        convolved = torch.empty_like(gated)
        self._conv(self.norm_conv(gated), batch, state["conv"], convolved, every)
        return hyper + (gated + convolved)
