"""Transactional speculative decoding: an MTP drafter (``engine.mtp``, ``engine.mtp_depth``), and the verify step
every drafter kind shares (``VerifyDecoder``; prompt-lookup drafts in ``dgpp.engine.lookup_draft``).

One decode pass, for every live request at position ``c`` (``c`` tokens cached, last token ``x`` not yet fed):

1. **Draft.** The drafter row at position ``p`` reads the target's hidden at ``p`` and the token at ``p + 1`` and
   predicts the token at ``p + 2``. The rows the drafter has not seen yet (the request's *backlog*: the target
   hidden rows of the last accepted inputs, ending at ``c - 1``) run first, over the drafter's own paged K/V;
   the last one proposes ``d1``. Deeper drafts run the drafter on its own output (provisional K/V rows past the
   accepted prefix are rewritten by the next pass's backlog). The drafts stay on the device
   (``dgpp.engine.draft_proposal``): only their counts shape the verify on the host.
2. **Verify.** One target forward over ``[x, d1 .. dD]`` at ``c .. c + D`` for every request, through the same
   ``ModelRunner`` as plain decode (so batched ≡ solo still holds); logits of every row. With decode graphs on
   (CUDA), the rows replay a captured decode step, one decode row each (``dgpp.engine.verify_graphs``).
3. **Judge** every row of the batch in one pass on the device (``dgpp.sample.batch.sample_rows``: greedy rows
   compare their argmax with the draft, sampled rows run the ratio test, each row keyed by its choice's own draw
   seed), one device->host copy; then emit each request's tokens in order, stopping at the first rejected draft,
   at retirement (EOS / length: a multi-token step can retire mid-list), or after the bonus row.
4. **Commit.** ``computed`` advances by the emitted count; K/V written past it is invisible (positions are read
   up to ``computed``) and overwritten later. A hybrid model's recurrent/conv state saw every verify row, so it
   is restored from the snapshot taken before the verify and the accepted rows are run again (exact; per-row
   state snapshots in the kernels would save that second forward).

A drafter may keep per-request state of its own (e.g. the ring of rows an index-key pooler has not pooled yet,
GLM-5.3-Flash's MTP layer): it sees every accepted position once, in order, through the backlog; the provisional rows
of deeper drafts would advance that state past the accepted prefix, so it is saved before them and put back after.

Greedy requests thus emit exactly the plain greedy transcript, whatever the drafter proposes. Steps 2-4 do not
depend on where drafts come from (``VerifyDecoder``); step 1 is the MTP drafter's (``SpeculativeDecoder``). With
``engine.mtp_schedule`` each request verifies only the drafts its predicted survival pays for
(``dgpp.engine.verify_schedule``); a grammar-constrained request or a forced walk verifies none (its next rows'
masks are not known before the drafts are judged).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING

import torch

from dgpp.engine.draft_proposal import Proposal
from dgpp.engine.graphs import verify_graphs
from dgpp.engine.runner import ModelRunner, build_batch
from dgpp.engine.speculative_stats import SpecDecodeStats
from dgpp.engine.verify_schedule import DraftTrack, PassRule, ScheduleSettings, VerifySchedule
from dgpp.engine.work import DecodingSequence, SeqWork
from dgpp.sample.batch import DrawnRows, Row, sample_rows
from dgpp.step.cache_spec import StateSpec, stored_as
from dgpp.step.model import Drafter
from dgpp.step.pools import CachePools

if TYPE_CHECKING:
    from dgpp.sample.sampler import SampleResult

EmitFn = Callable[[DecodingSequence, "SampleResult"], None]
FailFn = Callable[[DecodingSequence, Exception], None]


class VerifyDecoder:
    """The verify and commit half of speculative decoding (steps 2-4 of the module docstring), shared by every
    drafter kind: a subclass proposes each request's drafts (``_propose``) and may keep the hidden rows of the
    accepted inputs (``_keep``, when ``keeps_hidden``). Drafts are point masses, so the ratio test applies to
    sampled rows."""

    keeps_hidden = False

    def __init__(
        self, runner: ModelRunner, depth: int, drafter_name: str, schedule: ScheduleSettings | None = None
    ) -> None:
        # with decode graphs on, verify steps replay them too, each verify row as its own decode row, in one graph
        # set sized for depth + 1 rows a request (dgpp.engine.verify_graphs); eager for a model whose verify rows
        # share per-request state (a hybrid's recurrent state, a compressed or window entry)
        runner.graphs = verify_graphs(runner.graphs, runner.model, depth)
        self.runner = runner
        self.model = runner.model
        self.depth = depth
        self.stats = SpecDecodeStats(depth, drafter_name)
        self.schedule = VerifySchedule(schedule) if schedule is not None else None
        self.stats.scheduled = self.schedule is not None

    def after_prefill(self, chunks: list[tuple[DecodingSequence, int, int]]) -> None:
        """Called after every target prefill step with its ``(seq, start, end)`` chunks; no-op by default."""

    def _propose(self, seqs: list[DecodingSequence]) -> Proposal:
        """Each request's drafts (at most ``_room(s)``; none: the row decodes plainly)."""
        raise NotImplementedError

    def _keep(self, s: DecodingSequence, first: int, hidden: torch.Tensor) -> None:
        """The target's hidden rows of the inputs that stand, from position ``first``; unused by default."""

    def _judged(self, s: DecodingSequence, drafted: int, accepted: int) -> None:
        """``accepted`` of the request's ``drafted`` tokens were kept this step (the schedule's record)."""
        if self.schedule is not None and drafted:
            self._track(s).judged(drafted, accepted)

    def _room(self, s: DecodingSequence) -> int:
        """Drafts worth verifying: no more than the tokens still allowed, the block table or the positions hold;
        none for a grammar-constrained request or a forced walk (a row's mask follows the tokens before it)."""
        if s.sampler.mask_fn is not None or s.sampler.samples_alone:
            return 0
        room = len(s.block_table) * self.runner.pools.block_size - 1 - s.computed
        remaining = s.params.max_tokens - len(s.output) - 1
        positions = self.model.info.max_position - 1 - s.computed
        return max(0, min(self.depth, room, remaining, positions))

    def _rule(self, seqs: list[DecodingSequence]) -> PassRule | None:
        """This pass's schedule (None: every proposed draft is verified)."""
        return self.schedule.rule([s.params for s in seqs]) if self.schedule is not None else None

    @staticmethod
    def _track(s: DecodingSequence) -> DraftTrack:
        """The request's draft outcomes (kept on its sequence)."""
        if s.draft_state is None:
            s.draft_state = DraftTrack()
        return s.draft_state  # type: ignore[no-any-return]

    # ---- decode --------------------------------------------------------------------------------
    @torch.inference_mode()
    def decode(self, seqs: list[DecodingSequence], emit: EmitFn, fail: FailFn) -> int:
        """One speculative decode step for ``seqs`` (all in DECODE); ``emit`` is the scheduler's per-token
        commit (EOS / length retirement), ``fail`` retires a request whose sampling raised. Returns the verify
        forward's row count (``/metrics`` ``decode_batch.last_rows_per_request``)."""
        self._prune()
        proposal = self._propose(seqs)
        counts = proposal.counts
        hybrid = bool(self.model.info.hybrid)
        snapshot = self._save_state([s for s, k in zip(seqs, counts, strict=True) if k]) if hybrid else None
        starts = [s.computed for s in seqs]
        device = self.runner.device
        # the rows' tokens go in on the device (the drafts may never have left it); each row computes what plain
        # decode would, and every row's fp32 logits come back
        input_ids, drafts = proposal.verify_rows([s.output[-1] for s in seqs], device)
        works = [
            SeqWork(s.slot, s.block_table, c, [s.output[-1]] * (k + 1), every_row_logits=True, media=s.media)  # type: ignore[arg-type]
            for s, c, k in zip(seqs, starts, counts, strict=True)
        ]
        logits = self.runner.step(works, verify=True, input_ids=input_ids)
        hidden = self.model.last_hidden
        # penalties count the drafts ahead of a row: read on the host only when a request has penalties
        penalised = any(k and s.sampler.history.track for s, k in zip(seqs, counts, strict=True))
        before = proposal.lists() if penalised else [[] for _ in seqs]
        rows = [
            Row(s.sampler, j < k, j, tuple(b[:j]) if s.sampler.history.track else ())
            for s, k, b in zip(seqs, counts, before, strict=True)
            for j in range(k + 1)
        ]
        drawn = sample_rows(logits, rows, drafts)  # every row judged at once, one device->host copy
        offset, redo, committed = 0, [], 0
        for s, c, k in zip(seqs, starts, counts, strict=True):
            kept = self._commit(s, c, k, drawn, offset, emit, fail)
            committed += kept
            if s.retired is None:
                if hybrid and kept < k + 1:
                    redo.append((s, c, kept))
                elif self.keeps_hidden:
                    self._keep(s, c, hidden[offset : offset + kept])
            offset += k + 1
        if self.schedule is not None:
            self.schedule.observe(committed, offset)
            self.stats.schedule_lambda = self.schedule.value(len(seqs))
        if redo:
            self._rerun_accepted(redo, snapshot)
        return offset

    def _commit(
        self,
        s: DecodingSequence,
        c: int,
        drafted: int,
        drawn: DrawnRows,
        offset: int,
        emit: EmitFn,
        fail: FailFn,
    ) -> int:
        """Emit this request's judged rows (``drafted`` drafts, then its last row) in order; the number of verify
        rows whose inputs stand (>= 1, or 0 when its sampling failed)."""
        accepted = emitted = 0
        for j in range(drafted + 1):
            result = drawn.result(offset + j)
            if isinstance(result, Exception):  # this request's sampling (its grammar) failed: only it ends
                fail(s, result)
                break
            s.computed = c + j + 1
            emit(s, result)
            emitted += 1
            took = drawn.accepted[offset + j]
            accepted += took
            if not took or s.retired is not None:  # a rejection, or EOS / length on an accepted draft
                break
        s.sampler.advance(emitted)  # the next draw's seed follows the tokens taken
        self.stats.verified(drafted, accepted)
        self._judged(s, drafted, accepted)
        return s.computed - c

    # ---- hybrid state --------------------------------------------------------------------------
    def _save_state(self, seqs: list[DecodingSequence]) -> dict[int, list[torch.Tensor]]:
        """Each slot's state tensors before the verify (the state after ``c`` tokens)."""
        pools = self.runner.pools
        return {s.slot: [t[s.slot].clone() for ts in pools.state.values() for t in ts.values()] for s in seqs}  # type: ignore[index]

    def _rerun_accepted(
        self, redo: list[tuple[DecodingSequence, int, int]], snapshot: dict[int, list[torch.Tensor]] | None
    ) -> None:
        """Restore the pre-verify state and feed only the inputs that stand, so the state is the accepted one."""
        assert snapshot is not None
        pools = self.runner.pools
        for s, _, _ in redo:
            tensors = [t for ts in pools.state.values() for t in ts.values()]
            for t, saved in zip(tensors, snapshot[s.slot], strict=True):  # type: ignore[index]
                t[s.slot].copy_(saved)
        # the inputs that stand: the token fed at c, then the drafts accepted after it (all now in the output)
        # logits of the last rows are wanted only so the head never sees an empty batch
        works = [
            SeqWork(s.slot, s.block_table, c, s.tokens[c : c + kept], media=s.media)  # type: ignore[arg-type]
            for s, c, kept in redo
        ]
        self.runner.step(works, verify=True)  # the state must be the one plain decode reaches, row by row
        hidden, offset = self.model.last_hidden, 0
        for s, c, kept in redo:
            if self.keeps_hidden:
                self._keep(s, c, hidden[offset : offset + kept])
            offset += kept

    def _prune(self) -> None:
        """Drop what is kept for retired requests; nothing by default."""


class SpeculativeDecoder(VerifyDecoder):
    """Drafts, verifies and commits decode steps for the scheduler (see the module docstring).

    The drafter's K/V lives in its own ``CachePools`` with the target's block geometry, so a request's
    ``block_table`` addresses both. ``after_prefill`` must see every target prefill step, so the drafter's
    K/V covers the prompt. ``kv_dtype`` (``engine.kv_dtype``): the format of the drafter's K/V, as the target's."""

    keeps_hidden = True

    def __init__(
        self,
        runner: ModelRunner,
        drafter: Drafter,
        depth: int,
        kv_dtype: str = "auto",
        schedule: ScheduleSettings | None = None,
    ) -> None:
        if depth < 1:
            raise ValueError(f"engine.mtp_depth must be at least 1, got {depth}")
        spec = stored_as(drafter.cache_spec(), kv_dtype)  # the drafter's K/V in the target's format
        self._stateful = any(isinstance(s, StateSpec) for s in spec.values())
        super().__init__(runner, depth, "mtp", schedule)
        runner.model.keep_hidden = True  # the drafter reads every row of the target's hidden (off by default)
        self.drafter = drafter
        pools = runner.pools
        self.draft_pools = CachePools(
            spec, pools.num_blocks, pools.block_size, pools.num_state_slots, runner.device
        )
        # target hidden rows the drafter has not consumed yet: seq -> (first position, rows)
        self._backlog: dict[DecodingSequence, tuple[int, torch.Tensor]] = {}

    # ---- prefill: the drafter follows the prompt ----------------------------------------------
    @torch.inference_mode()
    def after_prefill(self, chunks: list[tuple[DecodingSequence, int, int]]) -> None:
        """Right after a target step whose rows are exactly the prefill ``chunks`` ``(seq, start, end)``, in
        order: run the drafter over every row whose next token is already known (the prompt), keep the last."""
        hidden = self.model.last_hidden
        if hidden is None:
            raise RuntimeError(
                f"{type(self.model).__name__} sets no last_hidden: it cannot drive an MTP drafter"
            )
        self._prune()
        offset = 0
        ready: list[tuple[DecodingSequence, int, torch.Tensor]] = []
        for s, start, end in chunks:
            rows = hidden[offset : offset + end - start]
            offset += end - start
            first, pending = self._backlog.pop(s, (start, rows[:0]))
            rows = torch.cat([pending, rows]) if pending.shape[0] else rows
            ready.append((s, first, rows))
        runnable = [(s, first, rows[:-1]) for s, first, rows in ready if rows.shape[0] > 1]
        if runnable:
            self._draft_step(
                [(s, first, s.prompt[first + 1 : first + rows.shape[0] + 1]) for s, first, rows in runnable],
                torch.cat([rows for _, _, rows in runnable]),
                0,
                want_logits=False,
            )
        for s, first, rows in ready:
            self._backlog[s] = (first + rows.shape[0] - 1, rows[-1:].clone())

    def _propose(self, seqs: list[DecodingSequence]) -> Proposal:
        rule = self._rule(seqs)
        depths = []
        for s in seqs:
            room = self._room(s) if s in self._backlog else 0
            if room and rule is not None and self._track(s).resting():
                room = 0  # its drafts kept failing: a plain row (the drafter still reads its backlog)
            depths.append(room)
        return self._draft(seqs, depths, rule)

    def _keep(self, s: DecodingSequence, first: int, hidden: torch.Tensor) -> None:
        self._backlog[s] = (first, hidden.clone())

    def _prune(self) -> None:
        for s in [s for s in self._backlog if s.retired is not None]:
            del self._backlog[s]

    # ---- drafting ------------------------------------------------------------------------------
    def _draft(
        self, seqs: list[DecodingSequence], depths: list[int], rule: PassRule | None = None
    ) -> Proposal:
        """Up to ``depths[i]`` greedy drafts per request, chained on the device. Without a schedule they stay
        there; under a schedule ``rule`` they come to the host with their probabilities under the drafter (one
        copy) and each request keeps the leading drafts whose survival pays for their rows."""
        items, rows = [], []
        for s in seqs:
            first, backlog = self._backlog.pop(s, (s.computed, None))
            if backlog is None:
                continue
            if first + backlog.shape[0] != s.computed:
                raise RuntimeError(
                    f"request {s.request_id}: drafter backlog ends at {first + backlog.shape[0]}, "
                    f"the sequence at {s.computed}"
                )
            # the backlog ends at c - 1; its next tokens end with the last emitted one (fed at c)
            items.append((s, first, s.tokens[first + 1 : first + backlog.shape[0] + 1]))
            rows.append(backlog)
        device = self.runner.device
        if not items:
            return Proposal([0] * len(seqs), device=torch.zeros(0, dtype=torch.int64, device=device))
        hidden, logits = self._draft_step(items, torch.cat(rows), 0)
        index = {s: i for i, s in enumerate(seqs)}
        chain = [(index[s], s) for s, _, _ in items]
        saved = self._save_draft_state([s for _, s in chain]) if self._stateful and self.depth > 1 else {}
        try:
            where, picks, sure = self._chain(depths, chain, hidden, logits, rule is not None)
        finally:
            for slot, tensors in saved.items():  # the drafter's state as the accepted rows left it
                for t, kept in zip(self._draft_state_tensors(), tensors, strict=True):
                    t[slot].copy_(kept)
        order = torch.tensor([r for w in where for r in w], dtype=torch.int64).to(device, non_blocking=True)
        drafts = torch.cat(picks).index_select(0, order)
        counts = [len(w) for w in where]
        if rule is None:
            return Proposal(counts, device=drafts)
        both = torch.stack([drafts.double(), torch.cat(sure).index_select(0, order).double()]).tolist()
        lists, at = [], 0
        for i, n in enumerate(counts):
            tokens, confidences = both[0][at : at + n], both[1][at : at + n]
            lists.append([int(t) for t in tokens[: rule.cut(i, confidences)]])
            at += n
        return Proposal.of(lists)

    def _draft_state_tensors(self) -> list[torch.Tensor]:
        return [t for ts in self.draft_pools.state.values() for t in ts.values()]

    def _save_draft_state(self, seqs: list[DecodingSequence]) -> dict[int, list[torch.Tensor]]:
        return {s.slot: [t[s.slot].clone() for t in self._draft_state_tensors()] for s in seqs}  # type: ignore[index]

    def _chain(
        self,
        depths: list[int],
        chain: list[tuple[int, DecodingSequence]],
        hidden: torch.Tensor,
        logits: torch.Tensor | None,
        with_confidence: bool,
    ) -> tuple[list[list[int]], list[torch.Tensor], list[torch.Tensor]]:
        """Greedy drafts from the backlog's last rows, then the drafter on its own output (provisional rows), on
        the device: each chain step's picks (and with ``with_confidence`` their probabilities under the drafter),
        and where each request's drafts are among those picks concatenated in step order."""
        device = self.runner.device
        where: list[list[int]] = [[] for _ in depths]
        picks: list[torch.Tensor] = []
        sure: list[torch.Tensor] = []
        base = 0
        for step in range(self.depth):
            assert logits is not None
            picked = torch.argmax(logits, dim=-1)  # greedy drafts; ties to the lowest id
            picks.append(picked)
            if with_confidence:
                sure.append(torch.softmax(logits, dim=-1).gather(-1, picked[:, None]).squeeze(-1))
            keep = []
            for row, (i, _) in enumerate(chain):
                if len(where[i]) < depths[i]:
                    where[i].append(base + row)
                    if len(where[i]) < depths[i]:
                        keep.append(row)
            base += len(chain)
            if not keep or step + 1 == self.depth:
                break
            chain = [chain[r] for r in keep]
            kept = torch.tensor(keep, dtype=torch.int64).to(device, non_blocking=True)
            hidden = hidden.index_select(0, kept)
            # the next row of each chain is fed its last draft (on the device; the listed token is a placeholder)
            items = [(s, s.computed - 1 + len(where[i]), [0]) for i, s in chain]
            hidden, logits = self._draft_step(items, hidden, step + 1, input_ids=picked.index_select(0, kept))
        return where, picks, sure

    def _draft_step(
        self,
        items: list[tuple[DecodingSequence, int, list[int]]],
        previous: torch.Tensor,
        step: int,
        want_logits: bool = True,
        input_ids: torch.Tensor | None = None,
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """The drafter over ``(seq, first position, next tokens)`` rows fed ``previous`` hidden rows; the hidden and
        (``want_logits``) fp32 logits of each item's last row."""
        works = [SeqWork(s.slot, s.block_table, first, tokens, media=s.media) for s, first, tokens in items]  # type: ignore[arg-type]
        batch = build_batch(works, self.draft_pools, self.runner.device)
        if input_ids is not None:  # the items' tokens, already on the device
            batch.input_ids = input_ids.to(batch.input_ids.dtype)
        hidden = self.drafter(batch, previous, step)
        if not want_logits:
            return hidden, None
        logits = self.drafter.compute_logits(hidden, step)
        return hidden, logits.float()
