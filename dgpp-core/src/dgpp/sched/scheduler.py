"""The scheduler tick: cancels → admission → chunked prefill within budget → one decode pass.

It is single-threaded (the step loop thread owns it) and deterministic: live sequences are kept and
decoded in admission order (``seq_id``), chunk boundaries sit at absolute multiples of the chunk size
whatever the budget, and every decision depends only on what was submitted and cancelled.

A prompt with images prefills alone: its chunk is the only work of its forward (no other prompt, no decode row),
one chunk per tick, so the decode rows still run in a forward of their own every tick. The prefix cache keys such
a prompt on ``Sequence.cache_tokens`` (placeholders standing for the images' processed pixels).
"""

from __future__ import annotations

import time
from collections import deque
from typing import Any

import structlog

from dgpp.engine.work import SeqWork, StepRunner
from dgpp.sample.batch import sample_batch
from dgpp.sample.sampler import SampleResult
from dgpp.sched.block_pool import BlockPool, OutOfBlocks, SlotPool
from dgpp.sched.config import SchedulerConfig
from dgpp.sched.overlap import InFlight, OverlapSteps
from dgpp.sched.prefix_cache import PrefixCache
from dgpp.sched.published import SchedulerStats
from dgpp.sched.request import RetireReason, SeqEvent, SeqStatus, Sequence

log = structlog.get_logger("dgpp.engine")


class QueueFull(RuntimeError):
    """More sequences are waiting than ``engine.queue_limit`` allows (HTTP 503 ``overloaded``)."""


class Scheduler(OverlapSteps):
    """Continuous batching over a ``StepRunner``; see the module docstring for the tick."""

    def __init__(
        self,
        config: SchedulerConfig,
        runner: StepRunner,
        blocks: BlockPool,
        slots: SlotPool,
        prefix_cache: PrefixCache,
        eos_token_ids: frozenset[int] | set[int] = frozenset(),
        *,
        speculative: Any = None,
        overlap_events: bool = False,
        overlap_steps: bool = False,
    ) -> None:
        self.config = config
        self.runner = runner
        self.blocks = blocks
        self.slots = slots
        self.prefix_cache = prefix_cache
        self.eos_token_ids = frozenset(eos_token_ids)
        self.waiting: deque[Sequence] = deque()
        self._waiting_requests = 0  # leaders in ``waiting``: kept as it changes, so reading it walks nothing
        self.live: list[Sequence] = []  # admission order
        self.stats = SchedulerStats()
        self._next_seq_id = 0
        self._cancels: dict[str, RetireReason] = {}
        self._events: dict[Sequence, SeqEvent] = {}
        # engine.mtp: a dgpp.engine.speculative.SpeculativeDecoder runs the decode pass (None: plain decode)
        self.speculative: Any = speculative
        # serving: a tick's events are handed to the sinks once the next step is on the GPU, so the HTTP side
        # formats them while the GPU computes instead of competing with the engine thread for the GIL between
        # steps; the last tick before idle hands them out at once (see tick)
        self.overlap_events = overlap_events
        self._ready: dict[Sequence, SeqEvent] = {}
        # serving on a GPU: decode steps launch before the previous step's tokens are read (dgpp.sched.overlap);
        # the runner's ``step`` must take ``input_ids`` (device ids replacing the works' tokens)
        self.overlap_steps = overlap_steps
        self._inflight: InFlight | None = None

    # ---- inputs (called on the step loop thread between ticks) -----------------------------------
    @property
    def waiting_requests(self) -> int:
        """Requests (not choices) in the queue: ``engine.queue_limit`` counts these."""
        return self._waiting_requests

    def submit(self, seqs: list[Sequence], check_limit: bool = True) -> None:
        """Queue the choices of one request together; all or none (``QueueFull``). The step loop thread passes
        ``check_limit=False``: ``EngineInbox.submit`` already enforced the limit when the request arrived."""
        if check_limit and self.waiting_requests + 1 > self.config.queue_limit:
            raise QueueFull(
                f"{self.waiting_requests} requests waiting; engine.queue_limit is {self.config.queue_limit}"
            )
        for s in seqs:
            s.seq_id = self._next_seq_id
            self._next_seq_id += 1
            self.waiting.append(s)
            self._waiting_requests += s.leader is None

    def cancel(self, request_id: str, reason: RetireReason = RetireReason.CANCELLED) -> None:
        self._cancels[request_id] = reason

    @property
    def has_work(self) -> bool:
        return bool(self.waiting or self.live or self._cancels or self._inflight)

    # ---- the tick -----------------------------------------------------------------------------
    def tick(self) -> None:
        started = time.monotonic()
        if self._inflight is not None:
            if self._chain():  # the next step is on the GPU and the previous one's tokens are out
                self._flush_events()
                self.stats.step_ms += (time.monotonic() - started) * 1000.0
                return
            self._drain(self._inflight)
        self._apply_cancels()
        self._admit()
        decoding = [s for s in self.live if s.status is SeqStatus.DECODE]
        if self.config.admission == "grow":
            decoding = self._grow(decoding)
        # the budget counts prompt tokens, so short prompts share a forward (a burst costs per token, not
        # per request); each prompt still advances one chunk per round, so chunk boundaries never move
        budget = self.config.chunk_tokens * (self.config.busy_chunks if decoding else self.config.idle_chunks)
        decode_pending = self.speculative is None  # decode rows join the first round without an image prompt
        imaged: set[int] = (
            set()
        )  # prompts with images prefilled this tick: one chunk each, then decode rows run
        while True:
            round_seqs: list[Sequence] = []
            for s in self.live:
                if s.status is not SeqStatus.PREFILL or s.seq_id in imaged:
                    continue
                n = self._chunk_end(s) - s.computed
                if n > budget:  # first come, first served: nobody behind it jumps the queue
                    break
                if s.media is not None:  # a prompt with images prefills alone: no other prompt or decode row
                    round_seqs = round_seqs or [s]
                    budget -= n if round_seqs[0] is s else 0
                    break
                round_seqs.append(s)
                budget -= n
            alone = any(s.media is not None for s in round_seqs)
            imaged.update(s.seq_id for s in round_seqs if s.media is not None)
            rows = decoding if decode_pending and not alone else []
            if not round_seqs and not rows:
                break
            self._run_round(round_seqs, rows)
            decode_pending = decode_pending and alone
            if budget <= 0 or not round_seqs:
                break
        if self.speculative is not None:
            self._run_speculative(decoding)
        self._flush_ready()
        if self.overlap_events and self.speculative is None and self.live:
            _stamp(self._events)
            self._ready, self._events = self._events, {}  # the next tick's first round hands them out
        else:
            self._flush_events()
        self.stats.step_ms += (time.monotonic() - started) * 1000.0

    # ---- cancels and retirement ---------------------------------------------------------------
    def _apply_cancels(self) -> None:
        if not self._cancels:
            return
        cancels, self._cancels = self._cancels, {}
        for s in list(self.waiting):
            if s.request_id in cancels:
                self._unqueue(s)
                self._retire(s, cancels[s.request_id])
        for s in list(self.live):
            if s.request_id in cancels:
                self._retire(s, cancels[s.request_id])

    def _retire(self, s: Sequence, reason: RetireReason) -> None:
        if s.status is SeqStatus.FINISHED:
            return
        s.status, s.retired = SeqStatus.FINISHED, reason
        if s in self.live:
            self.live.remove(s)
        for b in s.block_table:
            self.blocks.decref(b)
        s.block_table = []
        if s.slot is not None:
            self.slots.give_live(s.slot)
            s.slot = None
        self._event(s).retired = reason
        self.stats.retired(reason)

    # ---- admission ----------------------------------------------------------------------------
    def _admit(self) -> None:
        for s in list(self.waiting):
            if len(self.live) >= self.config.max_concurrency:
                return
            if self._follows_unfinished_prefill(s):
                continue
            if self._try_admit(s):
                self._unqueue(s)

    def _unqueue(self, s: Sequence) -> None:
        self.waiting.remove(s)
        self._waiting_requests -= s.leader is None

    def _follows_unfinished_prefill(self, s: Sequence) -> bool:
        leader = s.leader
        return (
            leader is not None
            and s.use_prefix_cache
            and self.prefix_cache.enabled
            and leader.status in (SeqStatus.WAITING, SeqStatus.PREFILL)
        )

    def _try_admit(self, s: Sequence) -> bool:
        match = None
        if s.use_prefix_cache and self.prefix_cache.enabled:
            if s.block_keys is None:
                s.block_keys = self.prefix_cache.block_keys(s.cache_tokens)
            match = self.prefix_cache.match(s.cache_tokens, s.block_keys)
        cached = match.blocks if match else []
        reserve = s.max_total_tokens
        if self.config.admission == "grow":
            reserve = min(reserve, s.prompt_len + self.config.admission_window)
        need = self.blocks.blocks_for_tokens(reserve) - len(cached)
        self.prefix_cache.evict_blocks(need)
        if need > self.blocks.num_free:
            if match is not None:  # give back what the match took; try again next tick
                self.prefix_cache.release(match)
            return False
        slot = self.slots.take_live()
        assert slot is not None, "a live slot must exist below max_concurrency"
        s.slot = slot
        s.block_table = cached + self.blocks.allocate(need)
        s.computed = s.cached_tokens = match.position if match else 0
        if match is not None:
            self.prefix_cache.attach(match, slot)
        s.status = SeqStatus.PREFILL
        s.admitted_at = time.monotonic()
        self.live.append(s)
        self.stats.admitted(s)
        return True

    def _grow(self, decoding: list[Sequence]) -> list[Sequence]:
        """Grow admission: give each decoding sequence room for its next token, shedding the youngest
        live sequence (no preemption) when the pool is exhausted."""
        for s in list(decoding):
            while (
                s.status is SeqStatus.DECODE and len(s.block_table) * self.blocks.block_size < s.computed + 1
            ):
                window = self.blocks.blocks_for_tokens(self.config.admission_window)
                want = min(window, self.blocks.blocks_for_tokens(s.max_total_tokens) - len(s.block_table))
                self.prefix_cache.evict_blocks(want)
                try:
                    s.block_table += self.blocks.allocate(min(want, self.blocks.num_free) or 1)
                    self.stats.reservations_grown += 1
                except OutOfBlocks:
                    self._retire(max(self.live, key=lambda x: x.seq_id), RetireReason.POOL_EXHAUSTED)
        return [s for s in decoding if s.status is SeqStatus.DECODE]

    # ---- model steps --------------------------------------------------------------------------
    def _chunk_end(self, s: Sequence) -> int:
        """Where ``s``'s next prefill chunk ends: the next multiple of the chunk size, or the prompt's end."""
        return min(s.prompt_len, (s.computed // self.config.chunk_tokens + 1) * self.config.chunk_tokens)

    def _run_round(self, prefills: list[Sequence], decodes: list[Sequence]) -> None:
        works: list[SeqWork] = []
        sampled: list[Sequence] = []
        chunk_ends: list[tuple[Sequence, int]] = []
        for s in prefills:
            end = self._chunk_end(s)
            last = end == s.prompt_len
            works.append(
                SeqWork(
                    s.slot,
                    s.block_table,
                    s.computed,
                    s.prompt[s.computed : end],
                    want_logits=last,
                    media=s.media,
                )  # type: ignore[arg-type]
            )
            chunk_ends.append((s, end))
            if last:
                sampled.append(s)
        for s in decodes:
            works.append(SeqWork(s.slot, s.block_table, s.computed, [s.output[-1]], media=s.media))  # type: ignore[arg-type]
            sampled.append(s)
        # asked only of a runner that overlaps (CUDA): elsewhere the overlap code never runs
        if not prefills and self.overlap_steps and self._overlaps(decodes):
            self._launch(works, decodes)
            for s in decodes:
                s.computed += 1
            return
        t0 = time.monotonic()
        logits = self.runner.step(works)
        elapsed = time.monotonic() - t0
        self._flush_ready()  # the step is queued on the device: the previous tick's events go out meanwhile
        if self.speculative is not None and chunk_ends:  # the drafter follows the prompt rows
            self.speculative.after_prefill([(s, s.computed, end) for s, end in chunk_ends])
        self.stats.stepped(
            prefill_tokens=sum(e - s.computed for s, e in chunk_ends),
            decode_rows=len(decodes),
            seconds=elapsed,
        )
        for s, end in chunk_ends:
            s.computed = end
            self._maybe_cache(s)
        for s in decodes:
            s.computed += 1
        # rows come back in the order of the works that wanted logits: prefill tails first, then decodes;
        # the whole batch samples in one call (one device->host copy of the chosen ids)
        results = sample_batch(logits, [s.sampler for s in sampled]) if sampled else []
        done_at = time.monotonic()
        for s, r in zip(sampled, results, strict=True):
            if s.status is SeqStatus.PREFILL:
                s.status = SeqStatus.DECODE
                self.stats.prompts_prefilled += 1
                self.stats.prefill_done(s.admitted_at, done_at)
            if isinstance(r, Exception):  # one request's sampling (e.g. its grammar) failed: only it ends
                self._sampling_failed(s, r)
                continue
            try:
                self._emit(s, r)
            except Exception as exc:  # its grammar refused the token: only this request ends
                self._sampling_failed(s, exc)

    def _sampling_failed(self, s: Sequence, exc: Exception) -> None:
        log.error("sampling failed", request_id=s.request_id, exc_info=exc)  # the HTTP side logs its 500 too
        self._event(s).error = f"sampling failed: {type(exc).__name__}: {exc}"
        self._retire(s, RetireReason.FAILED)

    def _run_speculative(self, decoding: list[Sequence]) -> None:
        """The decode pass with ``engine.mtp``: draft, one verify forward, per-token commit (a step may retire
        a request mid-list)."""
        seqs = [s for s in decoding if s.status is SeqStatus.DECODE]
        if not seqs:
            return
        t0 = time.monotonic()
        verify_rows = self.speculative.decode(seqs, self._emit, self._sampling_failed)
        self.stats.stepped(
            prefill_tokens=0, decode_rows=len(seqs), seconds=time.monotonic() - t0, batch_rows=verify_rows
        )

    def _maybe_cache(self, s: Sequence) -> None:
        if not s.use_prefix_cache:
            return
        chunk = self.config.chunk_tokens
        if s.computed == s.prompt_len:  # prefill done: its full blocks, where the cache attaches at blocks
            every = self.prefix_cache.attach_every
            if every < chunk:
                self.prefix_cache.insert(s.cache_tokens, s.block_table, s.computed // every * every)
            return
        if s.computed % chunk:
            return
        deepest = (s.prompt_len - 1) // chunk * chunk
        # hybrid snapshots: the deepest cut, plus a "body" cut two chunks earlier for prompts of 4+ chunks,
        # so a changed question after a long shared document still finds a snapshot to attach to
        body = deepest - 2 * chunk if deepest >= 4 * chunk else -1
        snapshot_slot = s.slot if s.computed in (deepest, body) else None
        self.prefix_cache.insert(s.cache_tokens, s.block_table, s.computed, snapshot_slot)

    def _emit(self, s: Sequence, r: SampleResult) -> None:
        now = time.monotonic()
        if s.first_token_at is None:
            s.first_token_at = now
            self.prefix_cache.stats.first_token(s.cached_tokens > 0, (now - s.arrival) * 1000.0)
        s.last_token_at = now
        s.output.append(r.token)
        s.sampler.accept(r.token)
        ev = self._event(s)
        ev.tokens.append(r.token)
        ev.samples.append(r)
        self.stats.tokens_generated += 1
        if r.token in self.eos_token_ids and not (s.params.ignore_eos or self.config.no_eos):
            self._retire(s, RetireReason.EOS)
        elif len(s.output) >= s.params.max_tokens or s.computed + 1 >= self.config.max_position:
            self._retire(s, RetireReason.LENGTH)

    def _event(self, s: Sequence) -> SeqEvent:
        ev = self._events.get(s)
        if ev is None:
            ev = self._events[s] = SeqEvent(tokens=[], samples=[], cached_tokens=s.cached_tokens)
        return ev

    def _flush_ready(self) -> None:
        ready, self._ready = self._ready, {}
        for s, ev in ready.items():
            s.sink(s, ev)

    def _flush_events(self) -> None:
        self._flush_ready()
        events, self._events = self._events, {}
        _stamp(events)
        for s, ev in events.items():
            s.sink(s, ev)

    def fail_all(self, message: str) -> None:
        """The runner failed: retire every sequence with an error event (the engine is marked failed)."""
        self._inflight = None
        for s in list(self.live) + list(self.waiting):
            self._retire(s, RetireReason.FAILED)
            self._event(s).error = message
        self.waiting.clear()
        self._waiting_requests = 0
        self._flush_events()


def _stamp(events: dict[Sequence, SeqEvent]) -> None:
    """Each event carries its choice's timing as of this tick (the HTTP side reads no ``Sequence``)."""
    for s, ev in events.items():
        ev.timing = s.timing()
