"""CSA2 attention of the float64 DeepSeek-V4.1 reference: one shared latent per token (K == V), a sliding window
on every layer, and the compressed KV of the layer's group selected by the indexer.

Per layer ``l`` over new rows ``u`` (the normed sublayer input) at positions ``p``:

- ``qr = q_norm(wq_a u)``, ``q = wq_b qr`` as ``[heads, head_dim]`` (no per-head norm: the V4.1 release drops
  V4's), the last ``qk_rope_head_dim`` channels rotated as adjacent pairs at ``p``;
- the window latent ``kv = kv_norm(wkv u)``, its tail rotated at ``p``, then stored as FP8 E4M3 with an E8M0
  scale per 32 channels (amax floored at 1e-4), the rotated tail included;
- a kv source's compressor: ratio 1 is ``norm(wkv u)`` per token; ratio r > 1 pools each complete group of r
  consecutive tokens, per channel, with the softmax over the group of ``wgate u`` as weights, then ``norm``.
  Entry ``j`` stands for positions ``[j r, (j + 1) r)`` and is rotated at position ``j r`` (compress theta with
  YaRN), then stored as FP4 E2M1 with an E4M3 scale per 16 channels (the release's 890 bytes per token).
  The index keys ``k_norm(wk latent)`` (pre-rotation latent) are rotated at ``j r`` and stored as FP4 E2M1
  with an E8M0 scale per 32;
- an index source scores every entry ``j`` its row can see (``j < (p + 1) // r``):
  ``sum_h w_h relu(q_h . k_j)``, ``q_h`` the FP4-rounded rotated rows of ``wq_b qr`` and
  ``w = weights_proj(u) / sqrt(index_head_dim * index_n_heads)``, and keeps the ``index_topk`` best;
- attention over the window's ``sliding_window`` positions ending at ``p`` and the selected entries, scale
  ``head_dim^-0.5``, the per-head sink in the softmax denominator only; the output's rope tail un-rotated;
  grouped ``wo_a`` (block-diagonal over ``o_groups``) then ``wo_b``.

Readings taken where the sources leave room (each switchable in ``ReferenceOptions``):

- The candidate pool. The release's ``select_candidate_blocks`` scores blocks of ``candidate_block_size``
  entries by their best entry, pins the block holding the newest visible entry (partial or complete) and keeps
  the ``candidate_topk_blocks`` best blocks, the pinned one included (``candidate_pool="release"``, the
  default). The original engine's kernels keep the ``candidate_topk_blocks`` best COMPLETE blocks (the newest
  pinned only when it is complete) and always add the newest partial block's entries on top
  (``candidate_pool="engine"``): one block more whenever a partial block exists.
- An index source's selection never includes an entry outside the visible range or the candidate pool, even
  when fewer than ``index_topk`` entries qualify (the release's top-k can return masked picks that its
  ``idx < compress_len`` filter keeps; both the original engine and the Hugging Face port drop them).
- The candidate source's own selection is over every visible entry; later index sources are restricted.
- Dense projections take the activations unquantized (the original engine multiplies bf16 activations by the
  decoded weights; the release's demo quantizes activations to FP8 per 32 first).
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

import torch
from deepseek_v41_formats import (
    E2M1_TABLE,
    E4M3_TABLE,
    decode_e2m1,
    decode_e4m3,
    encode_e2m1,
    encode_e4m3,
    pow2_scale_exponent,
)
from deepseek_v41_reference_config import V41Config

F64 = torch.float64
Weights = dict[str, torch.Tensor]


@dataclass(frozen=True)
class ReferenceOptions:
    """What the reference applies. The defaults are the model; the switches exist to prove each part matters."""

    window_fp8: bool = True  # the window latents stored FP8 E4M3 + E8M0 / 32
    compressed_fp4: bool = True  # the compressed entries stored FP4 E2M1 + E4M3 / 16
    index_fp4: bool = True  # the index queries and keys rounded to FP4 E2M1 + E8M0 / 32
    candidate_pool: str = "release"  # "release" or "engine" (see the module docstring)
    restrict_to_candidates: bool = True  # later index sources select inside the candidate pool
    reuse_compressed_kv: bool = True  # layers that are not kv sources read their group's compressed KV
    reuse_selection: bool = True  # layers that are not index sources attend their index source's selection
    engram: bool = True
    single_pass_hc: bool = True  # a sublayer collapses with the coefficients the previous sublayer predicted


# ---- norms, rotations, rounding ---------------------------------------------------------------------------------


def rms_norm(x: torch.Tensor, weight: torch.Tensor | None, eps: float) -> torch.Tensor:
    y = x * torch.rsqrt(x.square().mean(-1, keepdim=True) + eps)
    return y if weight is None else y * weight


def rope_inv_freq(cfg: V41Config, compressed: bool) -> torch.Tensor:
    """Window-only layers: ``rope_theta``, no scaling. Compressed layers: ``compress_rope_theta`` with YaRN
    (``factor`` over ``original_max_position_embeddings``, the ``beta_fast..beta_slow`` band fading linearly,
    attention factor 1)."""
    dim = cfg.qk_rope_head_dim
    base = cfg.compress_rope_theta if compressed else cfg.rope_theta
    freqs = 1.0 / base ** (torch.arange(0, dim, 2, dtype=F64) / dim)
    if not compressed or cfg.original_max_position_embeddings <= 0 or cfg.rope_factor == 1.0:
        return freqs

    def correction(rotations: float) -> float:
        return (
            dim
            * math.log(cfg.original_max_position_embeddings / (rotations * 2 * math.pi))
            / (2 * math.log(base))
        )

    low = max(math.floor(correction(cfg.beta_fast)), 0)
    high = min(math.ceil(correction(cfg.beta_slow)), dim - 1)
    if low == high:
        high += 0.001
    ramp = ((torch.arange(dim // 2, dtype=F64) - low) / (high - low)).clamp(0, 1)
    smooth = 1 - ramp
    return freqs / cfg.rope_factor * (1 - smooth) + freqs * smooth


def rotate_tail(
    x: torch.Tensor, positions: torch.Tensor, inv_freq: torch.Tensor, inverse: bool = False
) -> torch.Tensor:
    """Rotate the last ``2 * len(inv_freq)`` channels as adjacent (even, odd) pairs; x is ``[rows, ..., D]``."""
    rd = 2 * inv_freq.numel()
    angle = positions.to(F64)[:, None] * inv_freq[None, :]
    shape = (angle.shape[0],) + (1,) * (x.dim() - 2) + (angle.shape[1],)
    cos, sin = angle.cos().view(shape), angle.sin().view(shape)
    if inverse:
        sin = -sin
    even, odd = x[..., -rd::2], x[..., -rd + 1 :: 2]
    rotated = torch.stack([even * cos - odd * sin, even * sin + odd * cos], dim=-1).flatten(-2)
    return torch.cat([x[..., :-rd], rotated], dim=-1)


def _blocks(x: torch.Tensor, size: int) -> torch.Tensor:
    return x.unflatten(-1, (-1, size))


# the cache formats: (block, element grid, largest element, amax floor, power-of-two scale?)
CACHE_FORMATS = {
    "fp8_e8m0": (32, E4M3_TABLE[:127], 448.0, 1e-4, True),  # the window latents
    "fp4_e8m0": (32, E2M1_TABLE[:8], 6.0, 6.0 * 2.0**-126, True),  # the index queries and keys
    "fp4_e4m3": (16, E2M1_TABLE[:8], 6.0, 6.0 * 2.0**-9, False),  # the compressed entries
}


def _scaled_blocks(x: torch.Tensor, kind: str) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(the blocks divided by their scales, the scales, the scales' unrounded value)."""
    block, _, fmax, floor, pow2 = CACHE_FORMATS[kind]
    b = _blocks(x, block)
    amax = b.abs().amax(-1).clamp_min(floor)
    ratio = amax / fmax
    if pow2:
        scale = torch.exp2(pow2_scale_exponent(amax, fmax).to(F64))
    else:
        scale = decode_e4m3(encode_e4m3(ratio))
    return b / scale.unsqueeze(-1), scale, ratio


def round_cache(x: torch.Tensor, kind: str) -> torch.Tensor:
    """``x`` stored in a cache format and read back (round to nearest element, ties to even)."""
    scaled, scale, _ = _scaled_blocks(x, kind)
    if kind == "fp8_e8m0":
        values = decode_e4m3(encode_e4m3(scaled))
    else:
        values = decode_e2m1(encode_e2m1(scaled).long())
    return (values * scale.unsqueeze(-1)).flatten(-2)


def round_fp8_e8m0(x: torch.Tensor) -> torch.Tensor:
    """E4M3 values with a power-of-two scale per 32 (amax floored at 1e-4): the window latents."""
    return round_cache(x, "fp8_e8m0")


def round_fp4_e8m0(x: torch.Tensor) -> torch.Tensor:
    """E2M1 values with a power-of-two scale per 32 (amax floored at 6 * 2^-126): the index queries and keys."""
    return round_cache(x, "fp4_e8m0")


def round_fp4_e4m3(x: torch.Tensor) -> torch.Tensor:
    """E2M1 values with an E4M3 scale per 16 (amax / 6 rounded to E4M3, floored at 2^-9): the entries."""
    return round_cache(x, "fp4_e4m3")


def _midpoint_distance(values: torch.Tensor, grid: torch.Tensor) -> torch.Tensor:
    """Relative distance of every ``|value|`` to the nearest midpoint between neighbours of ``grid``."""
    mids = (grid[1:] + grid[:-1]) / 2
    mag = values.abs().clamp(max=float(grid[-1]))
    return (mag.unsqueeze(-1) - mids).abs().min(-1).values / mag.clamp_min(1e-300)


def rounding_margin(x: torch.Tensor, kind: str) -> torch.Tensor:
    """Per leading row, the smallest relative distance of any rounding decision (an element's code, a scale's
    code or power of two) to its boundary: below ~1e-6 an fp32 model may round the other way."""
    scaled, _, ratio = _scaled_blocks(x, kind)
    _, grid, _, _, pow2 = CACHE_FORMATS[kind]
    if pow2:
        frac = ratio / torch.exp2(torch.log2(ratio).round())
        scale_margin = (frac - 1).abs()
    else:
        scale_margin = _midpoint_distance(ratio, E4M3_TABLE[:127])
    element = _midpoint_distance(scaled, grid).flatten(1).min(1).values
    return torch.minimum(element, scale_margin.flatten(1).min(1).values)


def top_margin(scores: torch.Tensor, k: int) -> torch.Tensor:
    """Per row, the relative gap between the k-th and the (k+1)-th best score (inf: no contest)."""
    if scores.shape[-1] <= k:
        return torch.full(scores.shape[:-1], math.inf, dtype=F64)
    best = torch.sort(scores, dim=-1, descending=True).values
    a, b = best[..., k - 1], best[..., k]
    gap = (a - b).abs() / a.abs().clamp_min(1e-300)
    return torch.where(torch.isfinite(a) & torch.isfinite(b), gap, math.inf)


# ---- the per-sequence state ---------------------------------------------------------------------------------------


@dataclass
class GroupCache:
    """A kv source's compressed state: the tokens of its open group and the entries so far."""

    pending_kv: torch.Tensor
    pending_gate: torch.Tensor
    entries: torch.Tensor  # [N, head_dim] rotated (and rounded) latents
    index_keys: torch.Tensor  # [N, index_head_dim] rotated (and rounded) index keys


@dataclass
class CallShared:
    """What flows between the layers of one call over new rows: the group's selection and candidate pool."""

    selection: torch.Tensor | None = None  # bool [rows, N]
    candidates: torch.Tensor | None = None  # bool [rows, N]
    groups: dict[int, GroupCache] = field(default_factory=dict)
    margin: torch.Tensor | None = None  # [rows]: the closest decision to its boundary (None: not recorded)

    def note(self, margin: torch.Tensor) -> None:
        if self.margin is not None:
            self.margin = torch.minimum(self.margin, margin)


def new_group(cfg: V41Config) -> GroupCache:
    d = cfg.head_dim
    return GroupCache(
        torch.zeros(0, d, dtype=F64),
        torch.zeros(0, d, dtype=F64),
        torch.zeros(0, d, dtype=F64),
        torch.zeros(0, cfg.index_head_dim, dtype=F64),
    )


# ---- the compressor, the indexer, the candidate pool ---------------------------------------------------------------


def compress(
    cfg: V41Config, w: Weights, p: str, ratio: int, u: torch.Tensor, group: GroupCache
) -> torch.Tensor:
    """The pre-rotation latents of the groups the new rows complete (``[m, head_dim]``)."""
    kv = u @ w[p + "compressor.wkv.weight"].T
    if ratio == 1:
        latent = kv
    else:
        gate = u @ w[p + "compressor.wgate.weight"].T
        kv, gate = torch.cat([group.pending_kv, kv]), torch.cat([group.pending_gate, gate])
        usable = kv.shape[0] // ratio * ratio
        group.pending_kv, group.pending_gate = kv[usable:], gate[usable:]
        kv, gate = kv[:usable].unflatten(0, (-1, ratio)), gate[:usable].unflatten(0, (-1, ratio))
        latent = (kv * gate.softmax(dim=1)).sum(dim=1)
    return rms_norm(latent, w[p + "compressor.norm.weight"], cfg.rms_norm_eps)


def candidate_block_scores(
    cfg: V41Config, scores: torch.Tensor, visible: torch.Tensor, mode: str
) -> tuple[torch.Tensor, torch.Tensor]:
    """(the blocks' scores, pinned ones +inf and unusable ones -inf; the entries every pool adds)."""
    bs = cfg.candidate_block_size
    rows, n = scores.shape
    nblocks = -(-n // bs)
    padded = torch.full((rows, nblocks * bs), -math.inf, dtype=F64)
    padded[:, :n] = scores
    block_score = padded.unflatten(-1, (nblocks, bs)).amax(-1)
    ids = torch.arange(nblocks)
    if mode == "release":
        newest = (visible - 1).clamp_min(0) // bs
        pinned = (ids[None] == newest[:, None]) & (visible[:, None] > 0)
        return torch.where(pinned, math.inf, block_score), torch.zeros(rows, n, dtype=torch.bool)
    if mode == "engine":
        complete = visible // bs
        pinned_id = torch.where(visible % bs == 0, complete - 1, -1)
        block_score = torch.where(ids[None] >= complete[:, None], -math.inf, block_score)
        block_score = torch.where(ids[None] == pinned_id[:, None], math.inf, block_score)
        j = torch.arange(n)[None]
        return block_score, (j >= (complete * bs)[:, None]) & (j < visible[:, None])
    raise ValueError(f"candidate_pool: {mode!r} is neither 'release' nor 'engine'")


def candidate_pool(cfg: V41Config, scores: torch.Tensor, visible: torch.Tensor, mode: str) -> torch.Tensor:
    """bool ``[rows, N]``: the entries of the candidate blocks of every row (scores -inf where invisible)."""
    n = scores.shape[1]
    block_score, extra = candidate_block_scores(cfg, scores, visible, mode)
    keep = top_mask(block_score, cfg.candidate_topk_blocks)
    keep = keep.repeat_interleave(cfg.candidate_block_size, dim=-1)[:, :n] | extra
    return keep & (torch.arange(n)[None] < visible[:, None])


def top_mask(scores: torch.Tensor, k: int) -> torch.Tensor:
    """bool mask of each row's ``k`` best finite-or-+inf scores; ties go to the lower index."""
    order = sorted_desc(scores)
    rank = torch.empty_like(order)
    rank.scatter_(-1, order, torch.arange(scores.shape[-1]).expand_as(order).contiguous())
    return (rank < k) & (scores > -math.inf)


def sorted_desc(scores: torch.Tensor) -> torch.Tensor:
    """Indices ordering each row by descending score, ties by ascending index (a stable sort)."""
    return torch.sort(-scores, dim=-1, stable=True).indices


def index_select(
    cfg: V41Config,
    opts: ReferenceOptions,
    w: Weights,
    layer: int,
    u: torch.Tensor,
    qr: torch.Tensor,
    positions: torch.Tensor,
    group: GroupCache,
    shared: CallShared,
) -> torch.Tensor:
    """An index source's selection: bool ``[rows, N]`` over its group's entries."""
    p = f"layers.{layer}.attn.indexer."
    ratio = cfg.ratio(layer)
    heads, dim = cfg.index_n_heads, cfg.index_head_dim
    inv_freq = rope_inv_freq(cfg, compressed=True)
    q = rotate_tail((qr @ w[p + "wq_b.weight"].T).view(-1, heads, dim), positions, inv_freq)
    if opts.index_fp4:
        if shared.margin is not None:
            shared.note(rounding_margin(q, "fp4_e8m0"))
        q = round_fp4_e8m0(q)
    weights = (u @ w[p + "weights_proj.weight"].T) * (dim**-0.5 * heads**-0.5)
    dots = torch.einsum("thd,nd->thn", q, group.index_keys).clamp_min(0)
    scores = (dots * weights[:, :, None]).sum(1)
    visible = (positions + 1) // ratio
    n = group.index_keys.shape[0]
    scores = torch.where(torch.arange(n)[None] < visible[:, None], scores, -math.inf)
    if layer == cfg.candidate_source_layer_id:
        shared.candidates = candidate_pool(cfg, scores, visible, opts.candidate_pool)
        if shared.margin is not None:
            blocks = candidate_block_scores(cfg, scores, visible, opts.candidate_pool)[0]
            shared.note(top_margin(blocks, cfg.candidate_topk_blocks))
    elif cfg.uses_candidates(layer) and opts.restrict_to_candidates and shared.candidates is not None:
        scores = torch.where(shared.candidates, scores, -math.inf)
    if shared.margin is not None:
        shared.note(top_margin(scores, cfg.index_topk))
    return top_mask(scores, cfg.index_topk)


def publish_entries(
    cfg: V41Config,
    opts: ReferenceOptions,
    w: Weights,
    layer: int,
    latent: torch.Tensor,
    group: GroupCache,
    shared: CallShared,
    positions: torch.Tensor,
) -> None:
    """Append a kv source's new entries (and, when it owns them, index keys) to its group."""
    ratio = cfg.ratio(layer)
    first = group.entries.shape[0]
    ids = first + torch.arange(latent.shape[0])
    at = ids * ratio
    inv_freq = rope_inv_freq(cfg, compressed=True)
    key_name = f"layers.{layer}.attn.indexer.wk.weight"
    stored = []
    if key_name in w:
        keys = rms_norm(
            latent @ w[key_name].T, w[f"layers.{layer}.attn.indexer.k_norm.weight"], cfg.rms_norm_eps
        )
        keys = rotate_tail(keys, at, inv_freq)
        if opts.index_fp4:
            stored.append((keys, "fp4_e8m0"))
            keys = round_fp4_e8m0(keys)
        group.index_keys = torch.cat([group.index_keys, keys])
    entries = rotate_tail(latent, at, inv_freq)
    if opts.compressed_fp4:
        stored.append((entries, "fp4_e4m3"))
        entries = round_fp4_e4m3(entries)
    group.entries = torch.cat([group.entries, entries])
    if shared.margin is not None and latent.shape[0]:
        # an entry's rounding reaches the rows from the one that completes its group on
        rows = (ids + 1) * ratio - 1 - int(positions[0])
        for values, kind in stored:
            margin = torch.full_like(shared.margin, math.inf)
            margin.scatter_reduce_(0, rows, rounding_margin(values, kind), "amin")
            shared.note(margin)


def publish_rows(
    cfg: V41Config,
    opts: ReferenceOptions,
    w: Weights,
    layer: int,
    u: torch.Tensor,
    shared: CallShared,
    positions: torch.Tensor,
) -> None:
    """A kv source's compressor over the rows ``u`` (at ``positions``): the groups they complete become
    entries (and index keys, from the pre-rotation latent) of the layer's group."""
    group = shared.groups.setdefault(layer, new_group(cfg))
    latent = compress(cfg, w, f"layers.{layer}.attn.", cfg.ratio(layer), u, group)
    publish_entries(cfg, opts, w, layer, latent, group, shared, positions)


def attention(
    cfg: V41Config,
    opts: ReferenceOptions,
    w: Weights,
    layer: int,
    u: torch.Tensor,
    positions: torch.Tensor,
    window: list[torch.Tensor],
    shared: CallShared,
    publish: bool = True,
    window_floor: int = 0,
) -> torch.Tensor:
    """One CSA2 layer over new rows ``u`` ``[rows, hidden]``; ``window[layer]`` holds the stored window latent
    of every earlier position (row = position; rows never computed are zero and never attended) and is extended
    here. ``publish=False``: a kv source's entries for these rows were published before (``publish_rows``).
    ``window_floor``: the earliest position the window attends (the bounded prefill's segment start)."""
    p = f"layers.{layer}.attn."
    ratio = cfg.ratio(layer)
    heads, hd = cfg.num_attention_heads, cfg.head_dim
    inv_freq = rope_inv_freq(cfg, compressed=ratio > 0)
    qr = rms_norm(u @ w[p + "wq_a.weight"].T, w[p + "q_norm.weight"], cfg.rms_norm_eps)
    q = rotate_tail((qr @ w[p + "wq_b.weight"].T).view(-1, heads, hd), positions, inv_freq)
    kv = rotate_tail(
        rms_norm(u @ w[p + "wkv.weight"].T, w[p + "kv_norm.weight"], cfg.rms_norm_eps), positions, inv_freq
    )
    if opts.window_fp8 and shared.margin is not None:
        shared.note(rounding_margin(kv, "fp8_e8m0"))
    gap = int(positions[0]) - window[layer].shape[0]
    window[layer] = torch.cat(
        [window[layer], torch.zeros(gap, hd, dtype=F64), round_fp8_e8m0(kv) if opts.window_fp8 else kv]
    )
    keys = window[layer]
    key_pos = torch.arange(keys.shape[0])
    first = (positions - cfg.sliding_window + 1).clamp_min(window_floor)
    allowed = (key_pos[None] <= positions[:, None]) & (key_pos[None] >= first[:, None])

    if ratio > 0:
        source = cfg.kv_source_of(layer)
        if layer == source:
            shared.selection = shared.candidates = None
            if publish:  # the source's selection sees its own new entries
                publish_rows(cfg, opts, w, layer, u, shared, positions)
        group = shared.groups[source]
        if layer in cfg.index_source_layer_ids:
            shared.selection = index_select(cfg, opts, w, layer, u, qr, positions, group, shared)
        selected = shared.selection
        assert selected is not None
        if layer != source and not opts.reuse_compressed_kv:
            selected = torch.zeros_like(selected)
        elif layer not in cfg.index_source_layer_ids and not opts.reuse_selection:
            visible = (positions + 1) // ratio
            selected = torch.arange(group.entries.shape[0])[None] < visible[:, None]
        keys = torch.cat([keys, group.entries])
        allowed = torch.cat([allowed, selected], dim=1)

    scores = torch.einsum("thd,nd->thn", q, keys) * hd**-0.5
    scores = torch.where(allowed[:, None, :], scores, -math.inf)
    sink = w[p + "attn_sink"].view(1, heads)
    top = torch.maximum(scores.amax(-1), sink)
    probs = torch.exp(scores - top[..., None])
    out = torch.einsum("thn,nd->thd", probs, keys) / (probs.sum(-1) + torch.exp(sink - top))[..., None]
    out = rotate_tail(out, positions, inv_freq, inverse=True)
    groups = cfg.o_groups
    wo_a = w[p + "wo_a.weight"].view(groups, cfg.o_lora_rank, -1)
    low = torch.einsum("tgk,grk->tgr", out.reshape(out.shape[0], groups, -1), wo_a).flatten(1)
    return low @ w[p + "wo_b.weight"].T
