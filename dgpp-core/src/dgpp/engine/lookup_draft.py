"""Prompt-lookup drafts (``engine.draft: "lookup"``): any model speculates with no draft weights.

A request's recent tokens are looked up among its own earlier tokens (prompt and output so far): the longest
suffix of ``engine.lookup_ngram`` down to ``engine.lookup_min_ngram`` tokens that occurred before proposes the
tokens that followed its latest earlier occurrence, up to ``engine.draft_depth`` of them. Text that copies,
edits or quotes its prompt is where it pays. The drafts are point masses, so the shared verify step
(``dgpp.engine.speculative.VerifyDecoder``) keeps greedy transcripts exact and sampled ones distributed as
plain sampling; a request with no match decodes plainly (one verify row).

Each request keeps its state on its sequence (``draft_state``): the n-gram index, extended by the tokens that
arrived since the last step (a step costs a few dictionary probes per request, never a scan of its prompt), and
how far its drafts have been right lately. A verify row costs time even when rejected (on a CPU, each row is a
GEMV of every weight), so a request drafts one token more than it last had accepted (up to the depth), and after
a step whose first draft was wrong it skips drafting for 1, 3, 7, 15 steps (doubling while they keep failing).
The skip and the length only decide what is verified, never what is emitted. Under ``engine.mtp_schedule`` the
schedule replaces the length rule: a request proposes up to the depth and verifies the drafts that its running
acceptance rate, taken as each draft's chance, pays for (``dgpp.engine.verify_schedule``).
"""

from __future__ import annotations

from dgpp.engine.draft_proposal import Proposal
from dgpp.engine.runner import ModelRunner
from dgpp.engine.speculative import VerifyDecoder
from dgpp.engine.verify_schedule import DraftTrack, ScheduleSettings
from dgpp.engine.work import DecodingSequence


class NgramIndex:
    """Every n-gram (``min_n <= n <= max_n``) of a token list that has a next token, mapped to the index of
    that next token at its latest occurrence; the list grows by appending."""

    def __init__(self, min_n: int, max_n: int) -> None:
        self.min_n, self.max_n = min_n, max_n
        self.tokens: list[int] = []
        self._next: dict[tuple[int, ...], int] = {}

    def extend(self, new: list[int]) -> None:
        tokens = self.tokens
        for token in new:
            tokens.append(token)
            end = len(tokens) - 1  # the n-grams ending just before ``token`` now have a next token
            for n in range(self.min_n, min(self.max_n, end) + 1):
                self._next[tuple(tokens[end - n : end])] = end

    def propose(self, k: int) -> list[int]:
        """Up to ``k`` tokens that followed the longest matching suffix's latest earlier occurrence; [] if none."""
        tokens = self.tokens
        for n in range(min(self.max_n, len(tokens)), self.min_n - 1, -1):
            at = self._next.get(tuple(tokens[-n:]))
            if at is not None:
                return tokens[at : at + k]
        return []


class LookupState(DraftTrack):
    """One request's drafting state: its n-gram index, its draft outcomes and how many drafts it has earned (see
    the module docstring)."""

    def __init__(self, min_n: int, max_n: int, depth: int) -> None:
        super().__init__()
        self.index = NgramIndex(min_n, max_n)
        self.limit = depth  # drafts to propose next time (unscheduled)

    def judged(self, drafted: int, accepted: int, depth: int | None = None) -> None:
        super().judged(drafted, accepted)
        if depth is not None:
            self.limit = min(depth, accepted + 1) if accepted else 1


class LookupDecoder(VerifyDecoder):
    """Speculative decoding with prompt-lookup drafts (see the module docstring)."""

    def __init__(
        self,
        runner: ModelRunner,
        depth: int,
        min_ngram: int,
        max_ngram: int,
        schedule: ScheduleSettings | None = None,
    ) -> None:
        if depth < 1:
            raise ValueError(f"engine.draft_depth must be at least 1, got {depth}")
        if not 1 <= min_ngram <= max_ngram:
            raise ValueError(
                f"engine.lookup_min_ngram ({min_ngram}) must be between 1 and engine.lookup_ngram ({max_ngram})"
            )
        super().__init__(runner, depth, "lookup", schedule)
        self.min_ngram, self.max_ngram = min_ngram, max_ngram

    def _propose(self, seqs: list[DecodingSequence]) -> Proposal:
        rule = self._rule(seqs)
        drafts = []
        for i, s in enumerate(seqs):
            state = self._state(s)
            room = self._room(s)
            if rule is None:
                room = min(room, state.limit)
            if state.resting():  # a backoff pass after failed drafts
                room = 0
            proposed = state.index.propose(room) if room else []
            if rule is not None:  # every lookup draft is worth the request's acceptance rate
                proposed = proposed[: rule.cut(i, [state.rate] * len(proposed))]
            drafts.append(proposed)
        return Proposal.of(drafts)

    def _judged(self, s: DecodingSequence, drafted: int, accepted: int) -> None:
        if drafted:
            s.draft_state.judged(drafted, accepted, None if self.schedule is not None else self.depth)

    def _track(self, s: DecodingSequence) -> LookupState:  # type: ignore[override]
        return self._state(s)

    def _state(self, s: DecodingSequence) -> LookupState:
        """The sequence's state, its index brought up to its prompt and output (built from the prompt once)."""
        state = s.draft_state
        if state is None:
            state = s.draft_state = LookupState(self.min_ngram, self.max_ngram, self.depth)
            state.index.extend(s.prompt)
        index = state.index
        seen = len(index.tokens) - len(s.prompt)
        if seen < len(s.output):
            index.extend(s.output[seen:])
        return state
