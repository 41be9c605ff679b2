"""Token sampling on the device, with no host sync: greedy, temperature, top-k, min-p, top-p.

``sample_tokens(logits [B, V], temperature [B], top_k [B], min_p [B], top_p [B], seeds [B]) -> [B] int64``.
A row with ``temperature <= 0`` is greedy (argmax, lowest id on ties). Otherwise, on ``z = logits / T``:
top-k keeps the ``k`` largest (ties at the k-th value kept too; ``k <= 0`` off), min-p keeps
``exp(z - max) >= min_p``, top-p keeps the smallest top set whose mass reaches ``p`` (of what
survived so far), and the draw is the exponential race ``argmax(z - log(-log u))`` (Gumbel-max),
which picks token ``i`` with probability ``softmax(z)_i`` over the kept set without any sort.

The uniforms ``u`` come from a counter-based hash of (seed, token id) that both paths compute
bit for bit, so the reference and the kernel draw the same token from the same seed. Change
``seeds`` every step (e.g. ``base + step`` on the device) to get fresh draws.

The Triton kernel runs one program per row and finds the top-k and top-p thresholds by bisection
on the float's order-preserving integer key (32 passes over the row, exact), so it never sorts.
This is a device-side fast path; the sampler with per-choice generators is ``dgpp.sample``.
"""

from __future__ import annotations

import torch

from dgpp.kernels._triton import tl, triton, use_triton

_M1, _M2 = 0x7FEB352D, 0x846CA68B  # lowbias32 multipliers (Wellons' integer hash)
_U32 = 0xFFFFFFFF


def _hash_u32_ref(x: torch.Tensor) -> torch.Tensor:
    """lowbias32 on int64 tensors holding uint32 values (products wrap; low 32 bits kept)."""
    x = x & _U32
    x = x ^ (x >> 16)
    x = (x * _M1) & _U32
    x = x ^ (x >> 15)
    x = (x * _M2) & _U32
    return x ^ (x >> 16)


def uniform_ref(seeds: torch.Tensor, vocab: int) -> torch.Tensor:
    """``[B, V]`` fp32 uniforms in (0, 1) for each (seed, token id)."""
    seed32 = _hash_u32_ref((seeds ^ (seeds >> 32)) & _U32)
    ids = torch.arange(vocab, device=seeds.device, dtype=torch.int64)
    bits = _hash_u32_ref(ids[None, :] ^ seed32[:, None])
    return ((bits >> 8).to(torch.float32) + 0.5) * (1.0 / (1 << 24))


def sample_tokens_ref(
    logits: torch.Tensor,
    temperature: torch.Tensor,
    top_k: torch.Tensor,
    min_p: torch.Tensor,
    top_p: torch.Tensor,
    seeds: torch.Tensor,
) -> torch.Tensor:
    rows, vocab = logits.shape
    u = uniform_ref(seeds, vocab)
    out = torch.empty(rows, dtype=torch.int64, device=logits.device)
    for r in range(rows):
        x = logits[r].float()
        temp = float(temperature[r])
        if temp <= 0:
            out[r] = torch.argmax(x)
            continue
        z = x / temp
        keep = torch.ones_like(z, dtype=torch.bool)
        k = int(top_k[r])
        if 0 < k < vocab:
            keep &= z >= torch.topk(z, k).values[-1]
        m = z.max()
        if float(min_p[r]) > 0:
            keep &= torch.exp(z - m) >= float(min_p[r])
        p = float(top_p[r])
        if p < 1.0:
            w = torch.where(keep, torch.exp(z - m), 0.0)
            vals, _ = torch.sort(torch.where(keep, z, float("-inf")), descending=True)
            mass_at = torch.cumsum(torch.sort(w, descending=True).values, 0)
            # threshold = the first value where the mass of everything >= it reaches p * total
            idx = int(torch.searchsorted(mass_at, p * w.sum()))
            keep &= z >= vals[min(idx, vocab - 1)]
        score = torch.where(keep, z - torch.log(-torch.log(u[r])), float("-inf"))
        out[r] = torch.argmax(score)
    return out


@triton.jit
def _hash_u32(x):
    # int64 holding a uint32, exactly as _hash_u32_ref: products wrap, the low 32 bits are kept
    x = x & 0xFFFFFFFF
    x = x ^ (x >> 16)
    x = (x * 0x7FEB352D) & 0xFFFFFFFF
    x = x ^ (x >> 15)
    x = (x * 0x846CA68B) & 0xFFFFFFFF
    return x ^ (x >> 16)


@triton.jit
def _sortable_key(z):
    # order-preserving map of fp32 onto int64: flip the magnitude bits of negatives
    bits = z.to(tl.int32, bitcast=True).to(tl.int64)
    return tl.where(bits < 0, -(bits & 0x7FFFFFFF) - 1, bits)


@triton.jit
def _mass_at_or_above(x_ptr, vocab, temp, m, lo_key, t, min_p, BLOCK: tl.constexpr, COUNT: tl.constexpr):
    """Count (COUNT) or softmax mass of the kept tokens whose key is >= t."""
    total = tl.zeros([BLOCK], tl.float32)
    for start in range(0, vocab, BLOCK):
        cols = start + tl.arange(0, BLOCK)
        z = tl.load(x_ptr + cols, mask=cols < vocab, other=float("-inf")).to(tl.float32) / temp
        key = _sortable_key(z)
        e = tl.exp(z - m)
        ok = (cols < vocab) & (key >= t) & (key >= lo_key) & (e >= min_p)
        if COUNT:
            total += tl.where(ok, 1.0, 0.0)
        else:
            total += tl.where(ok, e, 0.0)
    return tl.sum(total, axis=0)


@triton.jit
def _sample_kernel(
    logits_ptr,
    temp_ptr,
    topk_ptr,
    minp_ptr,
    topp_ptr,
    seed_ptr,
    out_ptr,
    vocab,
    row_stride,
    BLOCK: tl.constexpr,
):
    row = tl.program_id(0).to(tl.int64)
    x_ptr = logits_ptr + row * row_stride
    temp = tl.load(temp_ptr + row)
    greedy = temp <= 0
    do_sample = temp > 0
    temp = tl.where(greedy, 1.0, temp)
    # pass 1: max and argmax of z, and the smallest key (the bisections' lower bound)
    best = tl.full([BLOCK], float("-inf"), tl.float32)
    best_id = tl.zeros([BLOCK], tl.int32)
    low = tl.full([BLOCK], float("inf"), tl.float32)
    for start in range(0, vocab, BLOCK):
        cols = start + tl.arange(0, BLOCK)
        z = tl.load(x_ptr + cols, mask=cols < vocab, other=float("-inf")).to(tl.float32) / temp
        take = z > best  # strict: the earliest column keeps a tie
        best_id = tl.where(take, cols, best_id)
        best = tl.where(take, z, best)
        low = tl.minimum(low, tl.where(cols < vocab, z, float("inf")))
    m = tl.max(best, axis=0)
    argmax = tl.min(tl.where(best == m, best_id, vocab), axis=0)
    k = tl.load(topk_ptr + row)
    min_p = tl.load(minp_ptr + row).to(tl.float32)
    top_p = tl.load(topp_ptr + row).to(tl.float32)
    hi_key = _sortable_key(m) + 1
    lo_key = _sortable_key(tl.min(low, axis=0))
    if (k > 0) & (k < vocab) & do_sample:
        # largest key t with count(key >= t) >= k; invariant count(lo) >= k > count(hi)
        lo, hi = lo_key, hi_key
        for _ in range(33):
            mid = lo + (hi - lo) // 2
            n = _mass_at_or_above(x_ptr, vocab, temp, m, lo_key, mid, 0.0, BLOCK, True)
            lo = tl.where(n >= k, mid, lo)
            hi = tl.where(n >= k, hi, mid)
        lo_key = lo
    if (top_p < 1.0) & do_sample:
        target = top_p * _mass_at_or_above(x_ptr, vocab, temp, m, lo_key, lo_key, min_p, BLOCK, False)
        lo, hi = lo_key, hi_key
        for _ in range(33):
            mid = lo + (hi - lo) // 2
            mass = _mass_at_or_above(x_ptr, vocab, temp, m, lo_key, mid, min_p, BLOCK, False)
            lo = tl.where(mass >= target, mid, lo)
            hi = tl.where(mass >= target, hi, mid)
        lo_key = lo
    # the race: same hash as uniform_ref
    seed = tl.load(seed_ptr + row)
    seed32 = _hash_u32(seed ^ (seed >> 32))
    best = tl.full([BLOCK], float("-inf"), tl.float32)
    best_id = tl.zeros([BLOCK], tl.int32)
    for start in range(0, vocab, BLOCK):
        cols = start + tl.arange(0, BLOCK)
        z = tl.load(x_ptr + cols, mask=cols < vocab, other=float("-inf")).to(tl.float32) / temp
        ok = (cols < vocab) & (_sortable_key(z) >= lo_key) & (tl.exp(z - m) >= min_p)
        bits = _hash_u32(cols.to(tl.int64) ^ seed32)
        u = ((bits >> 8).to(tl.float32) + 0.5) * (1.0 / 16777216.0)
        score = tl.where(ok, z - tl.log(-tl.log(u)), float("-inf"))
        take = score > best
        best_id = tl.where(take, cols, best_id)
        best = tl.where(take, score, best)
    top = tl.max(best, axis=0)
    drawn = tl.min(tl.where(best == top, best_id, vocab), axis=0)
    tl.store(out_ptr + row, tl.where(greedy, argmax, drawn).to(tl.int64))


def sample_tokens_triton(
    logits: torch.Tensor,
    temperature: torch.Tensor,
    top_k: torch.Tensor,
    min_p: torch.Tensor,
    top_p: torch.Tensor,
    seeds: torch.Tensor,
) -> torch.Tensor:
    rows, vocab = logits.shape
    if logits.stride(-1) != 1:
        logits = logits.contiguous()
    out = torch.empty(rows, dtype=torch.int64, device=logits.device)
    if rows:
        _sample_kernel[(rows,)](
            logits,
            temperature.float(),
            top_k.to(torch.int32),
            min_p.float(),
            top_p.float(),
            seeds.to(torch.int64),
            out,
            vocab,
            logits.stride(0),
            BLOCK=min(4096, triton.next_power_of_2(vocab)),
            num_warps=8,
        )
    return out


def sample_tokens(
    logits: torch.Tensor,
    temperature: torch.Tensor,
    top_k: torch.Tensor,
    min_p: torch.Tensor,
    top_p: torch.Tensor,
    seeds: torch.Tensor,
) -> torch.Tensor:
    """One token id per row, chosen on the device; Triton on CUDA, torch elsewhere."""
    fn = sample_tokens_triton if use_triton(logits) else sample_tokens_ref
    return fn(logits, temperature, top_k, min_p, top_p, seeds)


def greedy_tokens(logits: torch.Tensor) -> torch.Tensor:
    """Argmax per row (lowest id on ties) without a host sync: the fast path for all-greedy batches."""
    return torch.argmax(logits, dim=-1)
