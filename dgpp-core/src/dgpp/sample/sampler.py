"""One choice's sampling state: penalties → logit bias → mask, then temperature → top-k → min-p → top-p → draw.

The draw is the batched one (``dgpp.sample.draw``: the exponential race keyed by a per-choice draw seed), whether
a step samples every row at once (``dgpp.sample.batch``), verifies drafts (``dgpp.sample.verify``) or samples one
row here (``ChoiceSampler.sample``); so a choice's tokens never depend on its batch mates.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field

import torch

from dgpp.sample.draw import RowParams, draw_tokens
from dgpp.sample.params import SamplingParams
from dgpp.sample.processors import TokenHistory, apply_logit_bias, apply_mask, apply_penalties
from dgpp.sample.rng import choice_generator, draw_seed

# JSON has no -inf: a token with zero mass reports this floor (as vLLM and OpenAI clients expect).
LOGPROB_FLOOR = -9999.0

MaskFn = Callable[[int], "torch.Tensor | None"]
AcceptFn = Callable[[int], None]


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
