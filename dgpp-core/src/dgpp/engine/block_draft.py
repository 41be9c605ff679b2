"""Block drafts (``engine.mtp`` with a ``BlockDrafter``: DeepSeek-V4's DSpark stages, a DFlash2 checkpoint): the
drafter proposes a request's whole block of drafts in one forward, and the verify step every drafter shares
(``dgpp.engine.speculative.VerifyDecoder``) judges them.

The drafter's context is one paged K/V row per position of the request, made from the target's feature rows
(``Model.last_hidden``: which features is the family's convention for its drafter). A row is written once the
input at its position stands: every prompt row right after its prefill step (``after_prefill``), and the
accepted inputs of a verify (``_keep``) at the start of the next pass, all requests in one drafter call. A pass
at position ``c`` (``c`` tokens cached, the last emitted token fed at ``c``) then drafts ``c + 1 ..`` from the
context rows before ``c``; the block itself writes nothing, so K/V past the accepted prefix never needs undoing.
The context rows share the target's block tables (same block geometry), so a prefix-cache hit finds the rows the
request that wrote the blocks left there.

Each request verifies up to ``engine.mtp_depth`` of its block's drafts (no more than the block holds); under
``engine.mtp_schedule`` the drafter's per-draft confidences decide how many of them pay for their rows.
"""

from __future__ import annotations

import torch

from dgpp.engine.draft_proposal import Proposal
from dgpp.engine.runner import ModelRunner, build_batch
from dgpp.engine.speculative import VerifyDecoder
from dgpp.engine.verify_schedule import PassRule, ScheduleSettings
from dgpp.engine.work import DecodingSequence, SeqWork
from dgpp.step.batch import ForwardBatch
from dgpp.step.cache_spec import StateSpec
from dgpp.step.model import BlockDrafter
from dgpp.step.pools import CachePools


class BlockDraftDecoder(VerifyDecoder):
    """Speculative decoding with a block drafter (see the module docstring)."""

    keeps_hidden = True

    def __init__(
        self, runner: ModelRunner, drafter: BlockDrafter, depth: int, schedule: ScheduleSettings | None = None
    ) -> None:
        if depth < 1:
            raise ValueError(f"engine.mtp_depth must be at least 1, got {depth}")
        if depth > drafter.drafts:
            raise ValueError(
                f"engine.mtp_depth {depth} exceeds the {drafter.drafts} drafts of {type(drafter).__name__}'s block"
            )
        spec = drafter.cache_spec()
        stateful = [name for name, s in spec.items() if isinstance(s, StateSpec)]
        if stateful:
            raise ValueError(f"block drafter cache entries {stateful} keep per-request state; only paged K/V")
        super().__init__(runner, depth, "mtp", schedule)
        runner.model.keep_hidden = True  # the drafter's features of every row (off by default)
        self.drafter = drafter
        pools = runner.pools
        self.draft_pools = CachePools(
            spec, pools.num_blocks, pools.block_size, pools.num_state_slots, runner.device
        )
        # per request: where its written context ends, and the accepted rows not written yet (first position, rows)
        self._context_end: dict[DecodingSequence, int] = {}
        self._pending: dict[DecodingSequence, tuple[int, torch.Tensor]] = {}

    # ---- context ------------------------------------------------------------------------------
    @torch.inference_mode()
    def after_prefill(self, chunks: list[tuple[DecodingSequence, int, int]]) -> None:
        """Right after a target step whose rows are exactly the prefill ``chunks`` ``(seq, start, end)``, in
        order: write the context rows of every prompt position the step ran."""
        features = self._features()
        self._prune()
        for s, _, _ in chunks:
            self._pending.pop(s, None)
        self._absorb([(s, start, end - start) for s, start, end in chunks], features)
        for s, _, end in chunks:
            self._context_end[s] = end

    def _keep(self, s: DecodingSequence, first: int, hidden: torch.Tensor) -> None:
        self._pending[s] = (first, hidden.clone())

    def _flush(self, seqs: list[DecodingSequence]) -> None:
        """Write the accepted rows the last verify left for ``seqs``, in one drafter call."""
        items, rows = [], []
        for s in seqs:
            pending = self._pending.pop(s, None)
            if pending is None:
                continue
            first, hidden = pending
            if not hidden.shape[0]:  # its sampling failed: nothing stands
                continue
            if self._context_end.get(s) != first:  # the context has a gap: this request drafts no more
                self._context_end.pop(s, None)
                continue
            items.append((s, first, hidden.shape[0]))
            rows.append(hidden)
            self._context_end[s] = first + hidden.shape[0]
        if items:
            self._absorb(items, torch.cat(rows))

    def _absorb(self, items: list[tuple[DecodingSequence, int, int]], features: torch.Tensor) -> None:
        """The drafter writes the context rows of ``(seq, first position, count)`` items from ``features`` (their
        rows, in order)."""
        batch = self._batch([(s, first, [0] * n) for s, first, n in items])  # the tokens are not read
        self.drafter.absorb(batch, features)

    def _batch(self, items: list[tuple[DecodingSequence, int, list[int]]]) -> ForwardBatch:
        """The drafter's batch over ``(seq, first position, tokens)`` items (its pools, the target's tables)."""
        works = [SeqWork(s.slot, s.block_table, first, tokens, media=s.media) for s, first, tokens in items]  # type: ignore[arg-type]
        return build_batch(works, self.draft_pools, self.runner.device)

    def _features(self) -> torch.Tensor:
        features = self.model.last_hidden
        if features is None:
            raise RuntimeError(
                f"{type(self.model).__name__} sets no last_hidden: it cannot drive a block drafter"
            )
        return features

    def _prune(self) -> None:
        for s in [s for s in self._context_end if s.retired is not None]:
            del self._context_end[s]
        for s in [s for s in self._pending if s.retired is not None]:
            del self._pending[s]

    # ---- drafting -----------------------------------------------------------------------------
    def _propose(self, seqs: list[DecodingSequence]) -> Proposal:
        self._flush(seqs)
        rule = self._rule(seqs)
        depths = []
        for s in seqs:
            room = self._room(s) if self._context_end.get(s) == s.computed else 0
            if room and rule is not None and self._track(s).resting():
                room = 0  # its drafts kept failing: a plain row (its context still follows it)
            depths.append(room)
        return self._draft(seqs, depths, rule)

    def _draft(self, seqs: list[DecodingSequence], depths: list[int], rule: PassRule | None) -> Proposal:
        """Each drafting request's block, in one drafter call; its first ``depths[i]`` drafts are proposed (under
        a schedule ``rule``, the leading ones whose confidence pays for their rows)."""
        device = self.runner.device
        drafting = [i for i, d in enumerate(depths) if d]
        if not drafting:
            return Proposal([0] * len(seqs), device=torch.zeros(0, dtype=torch.int64, device=device))
        batch = self._batch([(seqs[i], seqs[i].computed, [seqs[i].output[-1]]) for i in drafting])
        tokens, confidence = self.drafter.draft(batch)
        if rule is None:  # the drafts stay on the device
            width = tokens.shape[1]
            keep = [row * width + j for row, i in enumerate(drafting) for j in range(depths[i])]
            index = torch.tensor(keep, dtype=torch.int64).to(device, non_blocking=True)
            counts = [0] * len(seqs)
            for i in drafting:
                counts[i] = depths[i]
            return Proposal(counts, device=tokens.reshape(-1).index_select(0, index))
        both = torch.stack([tokens.double(), confidence.double()]).tolist()  # one device->host copy
        lists: list[list[int]] = [[] for _ in seqs]
        for row, i in enumerate(drafting):
            picks, sure = both[0][row][: depths[i]], both[1][row][: depths[i]]
            lists[i] = [int(t) for t in picks[: rule.cut(i, sure)]]
        return Proposal.of(lists)
