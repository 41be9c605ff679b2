"""Draw one token per row of a logits batch on the logits' device, with no host sync.

Every sampled row uses the exponential race of ``dgpp.kernels.sampling``: token ``i`` wins with probability
``softmax(z)_i`` over the kept set, the uniforms coming from a counter-based hash of (row seed, token id), so a
row's token depends on its logits and its seed alone (never on its batch mates). Rows are split by what they ask:

- greedy rows: ``argmax`` (lowest id on ties), bit-exact with the reference sampler;
- plain rows (temperature, maybe min-p): the Triton kernel on CUDA (two passes over the row, no bisection), the
  same race in torch elsewhere;
- top-k rows with a small ``k``: the ``k`` best candidates (``torch.topk``), ordered as the reference orders them
  (descending logit, then ascending id), then min-p / top-p / the race on those candidates alone;
- top-p rows without a small ``k``: the same on the fully sorted row.

The filters follow the reference sampler (``dgpp.sample.sampler.filtered_distribution``): top-k keeps ``k``
tokens, min-p keeps ``p >= min_p * p_max``, top-p keeps every token before the one whose cumulative mass reaches
``p`` and that one too. Logits are shifted so each row's maximum is 0 before dividing by the temperature, so a
tiny temperature sends every other token to ``-inf`` (the greedy limit) instead of overflowing.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from dgpp.kernels._triton import use_triton
from dgpp.kernels.sampling import _hash_u32_ref, sample_tokens_triton

#: top-k rows up to this ``k`` draw from ``torch.topk`` candidates; larger ``k`` sorts the whole row
CANDIDATE_MAX = 1024


@dataclass(frozen=True)
class RowParams:
    """What the draw needs of one row. ``greedy`` rows ignore the rest."""

    greedy: bool
    temperature: float = 1.0
    top_k: int = 0
    min_p: float = 0.0
    top_p: float = 1.0
    seed: int = 0


def draw_tokens(logits: torch.Tensor, rows: list[RowParams]) -> torch.Tensor:
    """``[R]`` int64 token ids on ``logits``' device for fp32 ``logits [R, V]`` (already penalised, biased, masked)."""
    n, vocab = logits.shape
    if n != len(rows):
        raise ValueError(f"logits has {n} rows but {len(rows)} row params were given")
    groups: dict[str, list[int]] = {"greedy": [], "plain": [], "candidates": [], "sorted": []}
    for i, r in enumerate(rows):
        groups[group_of(r, vocab)].append(i)
    if len(groups["greedy"]) == n:
        return torch.argmax(logits, dim=-1)
    out = torch.empty(n, dtype=torch.int64, device=logits.device)
    for name, idx in groups.items():
        if not idx:
            continue
        whole = len(idx) == n
        index = None if whole else torch.tensor(idx, dtype=torch.int64).to(logits.device, non_blocking=True)
        x = logits if whole else logits.index_select(0, index)
        picked = _draw_group(name, x, [rows[i] for i in idx])
        if whole:
            return picked
        out.index_copy_(0, index, picked)
    return out


def group_of(r: RowParams, vocab: int) -> str:
    if r.greedy:
        return "greedy"
    k = r.top_k if 0 < r.top_k < vocab else 0
    if k and k <= CANDIDATE_MAX:
        return "candidates"
    if r.top_p < 1.0 or k:
        return "sorted"
    return "plain"


def _draw_group(name: str, x: torch.Tensor, rows: list[RowParams]) -> torch.Tensor:
    if name == "greedy":
        return torch.argmax(x, dim=-1)
    if name == "plain" and use_triton(x):
        temp, min_p, _, _, seeds = row_tensors(rows, x.device)
        zeros = torch.zeros(len(rows), dtype=torch.int32, device=x.device)
        z = x - x.amax(dim=-1, keepdim=True)
        return sample_tokens_triton(
            z, temp.float(), zeros, min_p.float(), torch.ones_like(temp).float(), seeds
        )
    kept = kept_set(name, x, rows)
    return kept.race(kept.keep)


def row_tensors(
    rows: list[RowParams], device: torch.device
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """temperature, min-p, top-p (float64), top-k and seeds (int64) of ``rows`` on ``device``: one host->device
    copy for the float params, one for the 63-bit seeds."""
    floats = torch.tensor(
        [[r.temperature, r.min_p, r.top_p, float(r.top_k)] for r in rows], dtype=torch.float64
    ).to(device, non_blocking=True)
    seeds = torch.tensor([r.seed for r in rows], dtype=torch.int64).to(device, non_blocking=True)
    return floats[:, 0], floats[:, 1], floats[:, 2], floats[:, 3].to(torch.int64), seeds


@dataclass
class KeptSet:
    """The tokens a group of sampled rows may draw, after temperature, top-k, min-p and top-p: candidate ``ids``
    (None: every id of the vocabulary, in order), their tempered logits ``z`` and the ``keep`` mask, ``[n, W]``;
    ``seeds`` ``[n]`` key the rows' uniforms."""

    ids: torch.Tensor | None
    z: torch.Tensor
    keep: torch.Tensor
    seeds: torch.Tensor

    def token_ids(self) -> torch.Tensor:
        if self.ids is not None:
            return self.ids
        return torch.arange(self.z.shape[1], device=self.z.device).expand(self.z.shape[0], -1)

    def race(self, keep: torch.Tensor) -> torch.Tensor:
        """The exponential race over ``keep``: token ``i`` wins with probability ``softmax(z)_i`` over it, from
        the uniforms of (row seed, token id)."""
        ids = self.token_ids()
        seed32 = _hash_u32_ref((self.seeds ^ (self.seeds >> 32)) & 0xFFFFFFFF)
        bits = _hash_u32_ref(ids ^ seed32[:, None])
        u = ((bits >> 8).to(torch.float32) + 0.5) * (1.0 / (1 << 24))
        score = torch.where(keep, self.z - torch.log(-torch.log(u)), float("-inf"))
        return ids.gather(-1, torch.argmax(score, dim=-1, keepdim=True)).squeeze(-1)


def kept_set(name: str, x: torch.Tensor, rows: list[RowParams]) -> KeptSet:
    """The kept set of sampled rows of one group (``plain``, ``candidates`` or ``sorted``) of fp32 ``x``."""
    temp, min_p, top_p, top_k, seeds = row_tensors(rows, x.device)
    z = x - x.amax(dim=-1, keepdim=True)  # row max 0: no overflow at tiny temperatures
    if name == "plain":
        zt = z / temp.float()[:, None]
        return KeptSet(None, zt, torch.exp(zt) >= min_p.float()[:, None], seeds)
    if name == "candidates":
        width = min(max(r.top_k for r in rows), x.shape[1])
        vals, ids = torch.topk(z, width, dim=-1)
        # the reference's order among equal logits is ascending id: sort by id, then stably by value
        by_id = torch.argsort(ids, dim=-1)
        vals, ids = vals.gather(-1, by_id), ids.gather(-1, by_id)
        by_val = torch.argsort(vals, dim=-1, descending=True, stable=True)
        vals, ids = vals.gather(-1, by_val), ids.gather(-1, by_val)
    else:
        vals, ids = torch.sort(z, dim=-1, descending=True, stable=True)
    return _filtered(vals, ids, temp.float(), top_k, min_p.float(), top_p, seeds)


def _plain_race(
    z: torch.Tensor, temp: torch.Tensor, min_p: torch.Tensor, seeds: torch.Tensor
) -> torch.Tensor:
    """The kernel's no-filter path in torch (min-p only): same formula, so the same winners."""
    zt = z / temp[:, None]
    kept = KeptSet(None, zt, torch.exp(zt) >= min_p[:, None], seeds)
    return kept.race(kept.keep)


def _filtered(
    vals: torch.Tensor,
    ids: torch.Tensor,
    temp: torch.Tensor,
    top_k: torch.Tensor,
    min_p: torch.Tensor,
    top_p: torch.Tensor,
    seeds: torch.Tensor,
) -> KeptSet:
    """Top-k, min-p and top-p over candidates in draw order (``vals`` descending, first is 0)."""
    width = vals.shape[1]
    pos = torch.arange(width, device=vals.device)
    z = vals / temp[:, None]
    keep = torch.isfinite(vals) & ((top_k[:, None] <= 0) | (pos[None, :] < top_k[:, None]))
    e = torch.where(keep, torch.exp(z), 0.0)  # the first candidate has z = 0, e = 1
    keep &= e >= min_p[:, None] * e[:, :1]
    mass = torch.where(keep, e, 0.0).to(torch.float64)
    cumulative = torch.cumsum(mass, dim=-1) / mass.sum(dim=-1, keepdim=True)
    # keep everything before the crossing and the crossing token itself (top_p 1 keeps all)
    crossing = (cumulative < top_p[:, None]).sum(dim=-1, keepdim=True)
    keep &= (top_p[:, None] >= 1.0) | (pos[None, :] <= crossing)
    return KeptSet(ids, z, keep, seeds)
