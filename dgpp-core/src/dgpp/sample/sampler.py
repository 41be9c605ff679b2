"""One choice's sampling state: penalties → logit bias → mask, then temperature → top-k → min-p → top-p → draw.

The logit processors (penalties over a ``TokenHistory``, logit bias, token mask) work on one fp32 row in place,
in that order. The draw is the batched one (``dgpp.sample.draw``: the exponential race keyed by a per-choice draw
seed), whether a step samples every row at once or verifies drafts (``dgpp.sample.batch``) or samples one row here
(``ChoiceSampler.sample``); each choice owns a random stream (``choice_generator``), so a seeded choice draws the
same numbers however it is batched and its tokens never depend on its batch mates.
"""

from __future__ import annotations

import secrets
from collections.abc import Callable
from dataclasses import dataclass, field

import torch

from dgpp.sample.draw import RowParams, draw_tokens
from dgpp.sample.params import SamplingParams
from dgpp.splitmix import GOLDEN_GAMMA, MASK64, splitmix64

# JSON has no -inf: a token with zero mass reports this floor (as vLLM and OpenAI clients expect).
LOGPROB_FLOOR = -9999.0

MaskFn = Callable[[int], "torch.Tensor | None"]
AcceptFn = Callable[[int], None]
MASK63 = (1 << 63) - 1


# ---- per-choice random streams ----------------------------------------------------------------


def choice_seed(seed: int, choice_index: int) -> int:
    """The 63-bit stream seed of choice ``i`` of a request seeded ``s``: the seed is mixed before the choice
    index is added, so choice ``i`` of seed ``s`` is not choice 0 of seed ``s + i`` (the streams of nearby
    requests never overlap)."""
    return splitmix64((splitmix64(seed & MASK64) + choice_index * GOLDEN_GAMMA) & MASK64) & MASK63


def choice_generator(seed: int | None, choice_index: int) -> torch.Generator:
    """A CPU generator owned by one choice (``choice_seed``); unseeded choices get fresh entropy."""
    gen = torch.Generator(device="cpu")
    gen.manual_seed(secrets.randbits(63) if seed is None else choice_seed(seed, choice_index))
    return gen


def draw_seed(stream: int, draw_index: int) -> int:
    """The device draw's seed for the ``draw_index``-th sampled token of the choice whose stream seed is
    ``stream`` (a function of the two alone, so batching cannot change it)."""
    return splitmix64((splitmix64(stream) + draw_index * GOLDEN_GAMMA) & MASK64) & MASK63


# ---- logit processors -------------------------------------------------------------------------


class TokenHistory:
    """What penalties look at for one choice: which ids the prompt holds, and how often each id was generated.

    Repetition penalty covers prompt and output (HF / vLLM convention); presence and frequency penalties
    cover the output only (OpenAI's definition).
    """

    def __init__(self, vocab_size: int, prompt_ids: list[int], track: bool) -> None:
        self.track = track
        self.vocab_size = vocab_size
        self._prompt_ids = [t for t in prompt_ids if 0 <= t < vocab_size] if track else []
        self._pending: list[int] = []  # tokens accepted before the tensors exist
        self.counts: torch.Tensor | None = None
        self.prompt_seen: torch.Tensor | None = None

    def materialize(self, device: torch.device) -> None:
        """Build the tensors on the logits' device the first time penalties run (GPU rows stay on the GPU)."""
        if not self.track or self.counts is not None:
            return
        self.counts = torch.zeros(self.vocab_size, dtype=torch.int32, device=device)
        self.prompt_seen = torch.zeros(self.vocab_size, dtype=torch.bool, device=device)
        if self._prompt_ids:
            self.prompt_seen[torch.tensor(self._prompt_ids, dtype=torch.long, device=device)] = True
        for t in self._pending:
            self.counts[t] += 1
        self._pending = []

    def add(self, token: int) -> None:
        if not self.track or not 0 <= token < self.vocab_size:
            return
        if self.counts is None:
            self._pending.append(token)
        else:
            self.counts[token] += 1

    def extended(self, tokens: tuple[int, ...], device: torch.device) -> TokenHistory:
        """A copy that has also seen ``tokens`` (a verify row's earlier drafts, emitted only if they stand)."""
        if not self.track or not tokens:
            return self
        self.materialize(device)
        assert self.counts is not None
        copy = TokenHistory(self.vocab_size, [], False)
        copy.track, copy.prompt_seen = True, self.prompt_seen
        ids = torch.tensor([t for t in tokens if 0 <= t < self.vocab_size], dtype=torch.long, device=device)
        copy.counts = self.counts.index_add(0, ids, torch.ones_like(ids, dtype=self.counts.dtype))
        return copy


def apply_penalties(
    row: torch.Tensor,
    history: TokenHistory,
    repetition: float,
    presence: float,
    frequency: float,
) -> None:
    if not history.track:
        return
    history.materialize(row.device)
    assert history.counts is not None and history.prompt_seen is not None
    vocab = row.shape[0]
    counts = history.counts[:vocab]
    if repetition != 1.0:
        seen = history.prompt_seen[:vocab] | (counts > 0)
        # divide positive logits and multiply negative ones, so a seen token always becomes less likely
        penalized = torch.where(row > 0, row / repetition, row * repetition)
        row.copy_(torch.where(seen, penalized, row))
    if frequency != 0.0:
        row.sub_(counts.to(row.dtype) * frequency)
    if presence != 0.0:
        row.sub_((counts > 0).to(row.dtype) * presence)


def apply_logit_bias(
    row: torch.Tensor, bias_ids: torch.Tensor | None, bias_values: torch.Tensor | None
) -> None:
    if bias_ids is None or bias_values is None:
        return
    row.index_add_(0, bias_ids.to(row.device), bias_values.to(device=row.device, dtype=row.dtype))


def apply_mask(row: torch.Tensor, allowed: torch.Tensor | None) -> None:
    """``allowed`` is a bool tensor over the vocabulary (True = may be emitted); masked ids get zero mass."""
    if allowed is None:
        return
    n = min(row.shape[0], allowed.shape[0])
    row[:n].masked_fill_(~allowed[:n].to(device=row.device, dtype=torch.bool), float("-inf"))
    if allowed.shape[0] < row.shape[0]:
        row[n:] = float("-inf")


@dataclass
class SampleResult:
    """The picked token, and (when asked) its logprob and the top alternatives ``[(id, logprob)]``."""

    token: int
    logprob: float | None = None
    top_logprobs: list[tuple[int, float]] = field(default_factory=list)


class ChoiceSampler:
    """Sampling state of one choice: its params, generator, penalty history and grammar callbacks.

    ``mask_fn(vocab_size)`` returns the allowed-token bool tensor for the next position (or None for no
    constraint); ``accept_fn(token)`` tells the grammar what was emitted.
    """

    def __init__(
        self,
        params: SamplingParams,
        vocab_size: int,
        prompt_ids: list[int],
        choice_index: int = 0,
        mask_fn: MaskFn | None = None,
        accept_fn: AcceptFn | None = None,
    ) -> None:
        self.params = params
        self.vocab_size = vocab_size
        self.generator = choice_generator(params.seed, choice_index)
        self.history = TokenHistory(vocab_size, prompt_ids, params.has_penalties)
        self.mask_fn = mask_fn
        self.accept_fn = accept_fn
        self.bias_ids: torch.Tensor | None = None
        self.bias_values: torch.Tensor | None = None
        if params.logit_bias:
            items = sorted(params.logit_bias.items())
            self.bias_ids = torch.tensor([int(k) for k, _ in items], dtype=torch.long)
            self.bias_values = torch.tensor([float(v) for _, v in items], dtype=torch.float32)
        self.draws = 0  # sampled tokens drawn so far: the next draw's seed follows from it

    # True for a sampler whose ``sample`` must see its row itself (``dgpp.sample.forced``): the batch draw
    # leaves that row to it
    samples_alone = False

    @property
    def needs_processing(self) -> bool:
        """Whether a penalty, a logit bias or a grammar mask changes this choice's logits before the draw."""
        return self.history.track or self.bias_ids is not None or self.mask_fn is not None

    def draw_params(self, ahead: int = 0) -> RowParams:
        """The draw's parameters for the token ``ahead`` places after this choice's next one (a verify row behind
        ``ahead`` drafts); the seed follows from the choice's stream and its draw count alone (``draw_seed``,
        journaled under tensor parallelism, so every rank draws the same). Takes no draw (``advance``)."""
        p = self.params
        if p.greedy:
            return RowParams(greedy=True)
        seed = draw_seed(self.generator.initial_seed(), self.draws + ahead)
        return RowParams(False, p.temperature, p.top_k, p.min_p, p.top_p, seed)

    def advance(self, tokens: int) -> None:
        """``tokens`` sampled tokens were taken: the next draw uses the seed after them (greedy choices draw none)."""
        if not self.params.greedy:
            self.draws += tokens

    def processed_logits(self, logits: torch.Tensor, before: tuple[int, ...] = ()) -> torch.Tensor:
        """Penalties, bias and mask applied to a fp32 copy of ``logits`` (before temperature), on its device;
        ``before``: tokens of this step ahead of the row (verified drafts), counted by the penalties too."""
        row = logits.detach().to(dtype=torch.float32).clone()
        p = self.params
        history = self.history.extended(before, row.device)
        apply_penalties(row, history, p.repetition_penalty, p.presence_penalty, p.frequency_penalty)
        apply_logit_bias(row, self.bias_ids, self.bias_values)
        if self.mask_fn is not None:
            if before:  # the grammar state past unverified drafts is not known here
                raise ValueError("a grammar-constrained row cannot be judged behind drafts")
            apply_mask(row, self.mask_fn(row.shape[0]))
            if not bool(torch.isfinite(row).any()):
                raise ValueError("every token is masked: nothing can be sampled")
        return row

    def sample(self, logits: torch.Tensor) -> SampleResult:
        """One token from one logits row (the batched draw on a batch of one), taking a draw."""
        row = self.processed_logits(logits)
        token = int(draw_tokens(row[None], [self.draw_params()])[0])
        self.advance(1)
        return self.result(row, token)

    def result(self, row: torch.Tensor, token: int) -> SampleResult:
        """``token``'s result from this choice's processed ``row``, with what the reference sampler reports when
        logprobs are asked: the raw distribution for greedy choices, the filtered and renormalized one for
        sampled choices (a verify reports the target's, not the residual it may have drawn from)."""
        p = self.params
        if not p.logprobs:
            return SampleResult(token=token)
        if p.greedy:
            logprobs = torch.log_softmax(row, dim=0)
        else:
            ids, probs = filtered_distribution(row, p)
            logprobs = torch.full_like(row, float("-inf"))
            logprobs[ids] = torch.log(probs / probs.sum())
        return result_with_logprobs(token, logprobs, p.top_logprobs)

    def accept(self, token: int) -> None:
        """Record an emitted token (penalty history, grammar state)."""
        self.history.add(token)
        if self.accept_fn is not None:
            self.accept_fn(token)


def filtered_distribution(row: torch.Tensor, p: SamplingParams) -> tuple[torch.Tensor, torch.Tensor]:
    """Temperature, top-k, min-p and top-p on a processed fp32 row.

    Returns the surviving ids in draw order (descending logit, then ascending id) and their fp32
    probabilities (not yet renormalized after the last filter; callers divide by the sum).
    """
    # a stable descending sort keeps equal logits in ascending id order
    vals, ids = torch.sort(row, descending=True, stable=True)
    n = int(torch.isfinite(vals).sum())
    if n == 0:
        raise ValueError("every token is masked: nothing can be sampled")
    if p.top_k > 0:
        n = min(n, p.top_k)
    # shifted so the best logit is 0: a tiny temperature sends the others to -inf (its limit) instead of
    # overflowing to inf - inf = nan
    vals, ids = (vals[:n] - vals[0]) / p.temperature, ids[:n]
    probs = torch.softmax(vals, dim=0)
    if p.min_p > 0.0:
        keep = int((probs >= p.min_p * probs[0]).sum())
        probs, ids = probs[:keep], ids[:keep]
    if p.top_p < 1.0:
        cumulative = torch.cumsum((probs / probs.sum()).to(torch.float64), dim=0)
        # keep every token before the crossing and the crossing token itself
        at = torch.tensor([p.top_p], dtype=torch.float64, device=cumulative.device)
        crossing = int(torch.searchsorted(cumulative, at, right=False)[0])
        keep = min(crossing + 1, probs.shape[0])
        probs, ids = probs[:keep], ids[:keep]
    return ids, probs


def result_with_logprobs(token: int, logprobs: torch.Tensor | None, top_logprobs: int) -> SampleResult:
    """``token``'s result, with its logprob and the ``top_logprobs`` best alternatives when ``logprobs`` is given
    (also used by speculative decoding's ratio test, which reports what the plain sampler would)."""
    result = SampleResult(token=token)
    if logprobs is not None:
        result.logprob = _finite(float(logprobs[token]))
        if top_logprobs > 0:
            k = min(top_logprobs, logprobs.shape[0])
            vals, idx = torch.sort(logprobs, descending=True, stable=True)
            pairs = zip(idx[:k].tolist(), vals[:k].tolist(), strict=True)  # one device sync, not 2k
            result.top_logprobs = [(int(i), _finite(float(v))) for i, v in pairs]
    return result


def _finite(x: float) -> float:
    return x if x > LOGPROB_FLOOR else LOGPROB_FLOOR
