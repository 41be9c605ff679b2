"""CUDA-graph decode: one captured decode step per padded batch size, replayed for every decode step.

Decode at small batch is bound by launch overhead as much as by memory: a step is a few hundred
small kernels. Capturing the step once per batch size and replaying it removes the per-kernel CPU
cost. Sizes are 1, 2, 4, 8, then steps of 8 up to ``max_batch``; a batch of ``n`` rows runs in the
smallest captured size ``>= n``, its extra rows padded so they write nothing (``slot_mapping = -1``,
``seq_len = 0``, ``state_slot = -1``) and read nothing that matters. All graphs share one memory
pool and one set of static input buffers (views of the largest size), so memory is paid once.

Before each replay (and each warm-up and capture) the model's ``stage_decode`` runs eagerly on the static batch:
work that needs the host (a table gathered by the step's token ids) fills buffers the graph reads.

Prefill and mixed steps stay eager. The captured model code must not sync with the host: on CUDA
the ``dgpp.nn`` layers dispatch to ``dgpp.kernels`` for exactly that reason. Hybrid models run too: their
decode-only conv and gated-delta steps read device tensors alone and skip padding rows (state slot -1).

The runner feeds a step with ``run_work`` straight from its ``SeqWork`` list: the static buffers are views
of one device buffer whose pinned host mirror is written with numpy and sent in one async copy
(``dgpp.engine.graph_inputs``); ``run(batch)`` takes an already built ``ForwardBatch`` (speculative and
test callers).

Speculative verify steps replay the same graphs, each verify row as its own decode row (``takes_verify``,
``dgpp.engine.verify_graphs``); with ``Model.keep_hidden`` on, a replay also hands every row's hidden to the
drafter (``Model.last_hidden``) from the graph's static output.

``DecodeGraphs(..., capture=False)`` runs the same padded static batch eagerly, which is how the
padding and size-selection logic is tested on a CPU.
"""

from __future__ import annotations

import bisect
from collections import Counter
from dataclasses import dataclass, field

import torch

from dgpp.engine.graph_inputs import DecodeInputs
from dgpp.engine.verify_graphs import as_decode_rows, verify_rows_independent
from dgpp.engine.work import SeqWork
from dgpp.step.batch import ForwardBatch
from dgpp.step.model import Model
from dgpp.step.pools import CachePools


def capture_sizes(max_batch: int, step: int = 8) -> list[int]:
    """1, 2, 4, 8, then every ``step`` rows, always ending at ``max_batch``."""
    if max_batch < 1:
        raise ValueError(f"decode graphs need max_batch >= 1, got {max_batch}")
    sizes = [s for s in (1, 2, 4, 8) if s < max_batch]
    size = 8 + step
    while size < max_batch:
        sizes.append(size)
        size += step
    sizes.append(max_batch)
    return sizes


def pick_size(sizes: list[int], rows: int) -> int | None:
    """The smallest captured size that holds ``rows`` rows, or None when none does."""
    i = bisect.bisect_left(sizes, rows)
    return sizes[i] if i < len(sizes) else None


#: ``/metrics`` ``decode_batch.replays_by_slots`` always carries these keys, larger sizes are added
REPLAY_SLOT_KEYS = [str(i) for i in range(1, 17)]


@dataclass
class ReplayStats:
    """Decode steps that went through the graph path: replays, the padding rows they carried, and replays per
    captured size (the padded row count). Off CUDA (``capture=False``) the padded eager step counts the same."""

    replays: int = 0
    padded_rows: int = 0
    by_size: Counter = field(default_factory=Counter)

    def record(self, size: int, rows: int) -> None:
        self.replays += 1
        self.padded_rows += size - rows
        self.by_size[size] += 1

    def as_metrics(self) -> dict:
        by_slots = dict.fromkeys(REPLAY_SLOT_KEYS, 0)
        by_slots.update({str(size): n for size, n in sorted(self.by_size.items())})
        return {"replays": self.replays, "padded_rows": self.padded_rows, "replays_by_slots": by_slots}


class DecodeGraphs:
    """Captured decode steps of ``model`` over ``pools`` for batches up to ``max_batch`` rows whose
    block tables are at most ``max_blocks`` wide. ``run(batch)`` returns fp32 logits ``[rows, vocab]``."""

    def __init__(
        self,
        model: Model,
        pools: CachePools,
        max_batch: int,
        max_blocks: int,
        *,
        capture: bool = True,
    ) -> None:
        self.model = model
        self.pools = pools
        self.sizes = capture_sizes(max_batch)
        self.max_batch = max_batch
        self.max_blocks = max_blocks
        self.device = next(model.parameters()).device
        self.capture_requested = capture
        self.use_graphs = capture and self.device.type == "cuda"
        # a speculative verify's rows replay as decode rows (dgpp.engine.verify_graphs)
        self.takes_verify = False
        n, dev = max_batch, self.device
        # the static buffers are views of one device buffer with a pinned host mirror (dgpp.engine.graph_inputs)
        self.inputs = DecodeInputs(n, max_blocks, pools.block_size, pools.num_blocks, dev)
        self.input_ids, self.positions = self.inputs.input_ids, self.inputs.positions
        self.seq_lens, self.context_lens = self.inputs.seq_lens, self.inputs.context_lens
        self.block_tables, self.slot_mapping = self.inputs.block_tables, self.inputs.slot_mapping
        self.state_slots = self.inputs.state_slots
        self.query_start_loc = torch.arange(n + 1, dtype=torch.int32, device=dev)
        self.logits_indices = torch.arange(n, dtype=torch.int64, device=dev)
        self._fill_padding(0)
        self.graphs: dict[int, torch.cuda.CUDAGraph] = {}
        self.outputs: dict[int, torch.Tensor] = {}
        # every row's hidden (Model.last_hidden) per captured size, when the model keeps it for a drafter
        self.hidden: dict[int, torch.Tensor] = {}
        self.pool = None
        self.captured = False
        self.stats = ReplayStats()

    def can_run(self, batch: ForwardBatch) -> bool:
        return (
            batch.is_decode_only
            and batch.num_seqs <= self.max_batch
            and batch.block_tables.shape[1] <= self.max_blocks
            and batch.logits_indices.shape[0] == batch.num_seqs
        )

    def _static_batch(
        self, size: int, seq_lens: list[int] | None = None, ctx: list[int] | None = None
    ) -> ForwardBatch:
        """Views of the static buffers for ``size`` rows. The host lists only serve the eager (CPU) path;
        a captured graph reads the device buffers alone."""
        seq_lens = seq_lens if seq_lens is not None else [0] * size
        ctx = ctx if ctx is not None else [0] * size
        return ForwardBatch(
            input_ids=self.input_ids[:size],
            positions=self.positions[:size],
            query_start_loc=self.query_start_loc[: size + 1],
            seq_lens=self.seq_lens[:size],
            context_lens=self.context_lens[:size],
            block_tables=self.block_tables[:size],
            slot_mapping=self.slot_mapping[:size],
            state_slots=self.state_slots[:size],
            logits_indices=self.logits_indices[:size],
            cache=self.pools,
            q_lens_cpu=[1] * size,
            seq_lens_cpu=seq_lens,
            context_lens_cpu=ctx,
        )

    def _forward(self, batch: ForwardBatch) -> torch.Tensor:
        from dgpp.step.route import in_flight, step_route

        batch.route = step_route(batch.input_ids, batch.q_lens_cpu)  # decode rows: the canonical kernels
        with in_flight(batch.route):  # captured or eager
            return self.model.compute_logits(self.model(batch)).float()

    @torch.inference_mode()
    def capture(self) -> None:
        """Capture every size, largest first (later, smaller graphs reuse the pool's blocks)."""
        if not self.use_graphs or self.captured:
            self.captured = True
            return
        self._fill_padding(0)  # every row padding: the warm-up and capture write nothing to the pools
        logits_out: torch.Tensor | None = None
        hidden_out: torch.Tensor | None = None
        for size in reversed(self.sizes):
            # each size may need its own Triton specialisations: compile them outside the capture
            stream = torch.cuda.Stream(self.device)
            stream.wait_stream(torch.cuda.current_stream(self.device))
            with torch.cuda.stream(stream):
                for _ in range(2):
                    self.model.stage_decode(self._static_batch(size))
                    warm = self._forward(self._static_batch(size))
            torch.cuda.current_stream(self.device).wait_stream(stream)
            torch.cuda.synchronize(self.device)
            if logits_out is None:
                # one output buffer (and one for the hidden rows a drafter reads) that every size writes a prefix
                # of: outputs kept per size would each hold their own pool blocks, sizes x vocab in all (GiBs for
                # a verify set of hundreds of rows), where one buffer is the largest size's alone
                logits_out = torch.empty(
                    (self.max_batch, warm.shape[1]), dtype=warm.dtype, device=self.device
                )
                kept = self.model.last_hidden if self.model.keep_hidden else None
                if kept is not None:
                    hidden_out = kept.new_empty((self.max_batch, *kept.shape[1:]))
            graph = torch.cuda.CUDAGraph()
            self.model.stage_decode(self._static_batch(size))  # its buffers are what the graph reads
            with torch.cuda.graph(graph, pool=self.pool):
                logits_out[:size].copy_(self._forward(self._static_batch(size)))
                if hidden_out is not None and self.model.last_hidden is not None:
                    hidden_out[:size].copy_(self.model.last_hidden)
            self.outputs[size] = logits_out[:size]
            if hidden_out is not None:
                self.hidden[size] = hidden_out[:size]
            if self.pool is None:
                self.pool = graph.pool()
            self.graphs[size] = graph
        torch.cuda.synchronize(self.device)
        self.captured = True

    def _fill_padding(self, start: int) -> None:
        self.input_ids[start:].zero_()
        self.positions[start:].zero_()
        self.seq_lens[start:].zero_()
        self.context_lens[start:].zero_()
        self.slot_mapping[start:].fill_(-1)
        self.state_slots[start:].fill_(-1)
        self.block_tables[start:].fill_(-1)

    def load(self, batch: ForwardBatch) -> int:
        """Copy ``batch`` into the static buffers, pad to the chosen size; returns that size."""
        rows = batch.num_seqs
        size = pick_size(self.sizes, rows)
        if size is None or not self.can_run(batch):
            raise ValueError(
                f"decode graphs cannot run this batch ({rows} rows, {batch.block_tables.shape[1]} blocks)"
            )
        width = batch.block_tables.shape[1]
        self.input_ids[:rows].copy_(batch.input_ids)
        self.positions[:rows].copy_(batch.positions)
        self.seq_lens[:rows].copy_(batch.seq_lens)
        self.context_lens[:rows].copy_(batch.context_lens)
        self.block_tables[:rows, :width].copy_(batch.block_tables)
        self.block_tables[:rows, width:].fill_(-1)
        self.slot_mapping[:rows].copy_(batch.slot_mapping)
        self.state_slots[:rows].copy_(batch.state_slots)
        self._fill_padding(rows)
        return size

    @torch.inference_mode()
    def run(self, batch: ForwardBatch) -> torch.Tensor:
        """Logits ``[rows, vocab]`` for a decode-only batch (replay, or the eager padded step off CUDA)."""
        if not self.captured:
            self.capture()
        size = self.load(batch)
        return self._replay(size, batch.num_seqs, batch.seq_lens_cpu, batch.context_lens_cpu)

    def can_run_work(self, work: list[SeqWork]) -> bool:
        """``can_run`` on the scheduler's work list itself (no ``ForwardBatch`` built)."""
        return self.inputs.fits(work)

    @torch.inference_mode()
    def run_work(self, work: list[SeqWork], input_ids: torch.Tensor | None = None) -> torch.Tensor | None:
        """``run`` straight from the work list (the inputs go to the device in one copy, see graph_inputs),
        or None when this is not a step the graphs take (prefill rows, too many rows, too wide a table).
        ``input_ids``: the rows' token ids on the device (copied over the staged ones, device to device).
        With ``takes_verify``, a verify's items run as their rows, one decode row each (logits of every row)."""
        if self.takes_verify:
            expanded = as_decode_rows(work)
            if expanded is None:
                return None
            work = expanded
        if not self.inputs.fits(work):
            return None
        if not self.captured:
            self.capture()
        rows = len(work)
        size = pick_size(self.sizes, rows)
        seq = self.inputs.stage(work)
        if input_ids is not None:
            self.input_ids[:rows].copy_(input_ids)
        return self._replay(size, rows, seq, [s - 1 for s in seq])

    def _replay(self, size: int, rows: int, seq_lens: list[int], ctx: list[int]) -> torch.Tensor:
        self.stats.record(size, rows)
        pad = size - rows
        step = self._static_batch(size, list(seq_lens) + [0] * pad, list(ctx) + [0] * pad)
        self.model.stage_decode(step)  # Model.stage_decode: eager work before the replay
        if self.use_graphs:
            self.graphs[size].replay()
            if self.model.keep_hidden:
                self.model.last_hidden = self._hidden_rows(size, rows)
            return self.outputs[size][:rows].clone()
        logits = self._forward(step)[:rows]
        if self.model.last_hidden is not None:
            self.model.last_hidden = self.model.last_hidden[:rows]
        return logits

    def _hidden_rows(self, size: int, rows: int) -> torch.Tensor:
        """The live rows of the hidden the size-``size`` graph just wrote, copied out (the next replay overwrites
        its buffer)."""
        if size not in self.hidden:
            raise RuntimeError(
                f"the size-{size} decode graph keeps no hidden rows: {type(self.model).__name__} set no "
                "last_hidden while it was captured (Model.keep_hidden was off then, or the model keeps none)"
            )
        return self.hidden[size][:rows].clone()


def verify_graphs(graphs: DecodeGraphs | None, model: Model, depth: int) -> DecodeGraphs | None:
    """The graph set a speculative decoder at ``depth`` replays: one taking ``depth + 1`` rows for each of the
    decode graphs' ``max_batch`` requests and verify steps (``takes_verify``), or None (every step eager) when
    there are no decode graphs or the model's verify rows are not independent."""
    if graphs is None or not verify_rows_independent(model):
        return None
    rows = graphs.max_batch * (depth + 1)
    verify = DecodeGraphs(model, graphs.pools, rows, graphs.max_blocks, capture=graphs.capture_requested)
    verify.takes_verify = True
    return verify
