"""The model runner: several sequences' work for one step -> one ``ForwardBatch`` -> logits rows.

Each ``SeqWork`` is a prefill chunk or a decode token of one sequence; they are flattened into one
varlen batch, so prefill and decode rows run in the same forward. The runner validates the block
tables, computes positions and slot mappings, and zeroes a hybrid model's state slot when a
sequence starts (``context_len == 0``).
"""

from __future__ import annotations

import itertools

import torch

from dgpp.engine.work import SeqWork  # one definition shared with the scheduler
from dgpp.step.batch import ForwardBatch
from dgpp.step.model import Model
from dgpp.step.pools import CachePools
from dgpp.step.route import in_flight, step_route

__all__ = ["ModelRunner", "build_batch"]


def _check_work(
    work: list[SeqWork], tables: torch.Tensor, table_lens: torch.Tensor, num_blocks: int, bs: int
) -> None:
    """Raise ValueError naming the first work item with no tokens, a short block table or a block id outside
    the pool. The range check runs on the padded table tensor; the loop only runs to name the culprit."""
    for i, w in enumerate(work):
        end = w.context_len + len(w.token_ids)
        if not w.token_ids:
            raise ValueError(f"work item {i} has no tokens")
        if len(w.block_table) * bs < end:
            raise ValueError(
                f"work item {i}: block table of {len(w.block_table)} blocks covers {len(w.block_table) * bs} "
                f"tokens, needs {end}"
            )
    valid = torch.arange(tables.shape[1]) < table_lens[:, None]
    bad = valid & ((tables < 0) | (tables >= num_blocks))
    if bool(bad.any()):
        i = int(bad.any(dim=1).nonzero()[0])
        raise ValueError(
            f"work item {i}: block ids {work[i].block_table} outside the pool's 0..{num_blocks - 1}"
        )


def build_batch(work: list[SeqWork], pools: CachePools, device: torch.device | str = "cpu") -> ForwardBatch:
    """Flatten ``work`` into a ``ForwardBatch`` over ``pools`` (raises ValueError on a short block table).

    Positions and slots are computed with tensor ops on the host (no per-token Python loop: an 8K-token
    prefill chunk is one arange and one gather), then moved to ``device``."""
    if not work:
        raise ValueError("build_batch needs at least one work item")
    bs = pools.block_size
    q_lens = [len(w.token_ids) for w in work]
    ctx = [w.context_len for w in work]
    seq = [c + q for c, q in zip(ctx, q_lens, strict=True)]
    table_lens = torch.tensor([len(w.block_table) for w in work], dtype=torch.int64)
    width = max(int(table_lens.max()), 1)
    # -1 padded block tables: every row's ids scattered into the mask of its valid columns, row-major
    # (int64 until checked, so an absurd id is named by the range check, not an int32 overflow)
    tables = torch.full((len(work), width), -1, dtype=torch.int64)
    tables[torch.arange(width) < table_lens[:, None]] = torch.tensor(
        list(itertools.chain.from_iterable(w.block_table for w in work)), dtype=torch.int64
    )
    _check_work(work, tables, table_lens, pools.num_blocks, bs)
    tables = tables.to(torch.int32)

    q = torch.tensor(q_lens, dtype=torch.int64)
    starts = torch.zeros(len(work) + 1, dtype=torch.int64)
    torch.cumsum(q, 0, out=starts[1:])
    row_seq = torch.repeat_interleave(torch.arange(len(work)), q)  # owning work item of each token row
    offsets = torch.arange(int(starts[-1]), dtype=torch.int64) - starts[:-1][row_seq]
    positions = torch.tensor(ctx, dtype=torch.int64)[row_seq] + offsets
    slots = tables[row_seq, positions // bs].to(torch.int64) * bs + positions % bs
    want = torch.tensor([w.want_logits for w in work], dtype=torch.bool)
    every = torch.tensor([w.every_row_logits for w in work], dtype=torch.bool)
    if bool(every.any()):  # a verify: the items' every row, in row order, beside other items' last rows
        last = offsets == q[row_seq] - 1
        logits_rows = torch.nonzero(every[row_seq] | (last & want[row_seq])).flatten()
    else:
        logits_rows = starts[1:][want] - 1

    def t(values: list[int], dtype: torch.dtype) -> torch.Tensor:
        return torch.tensor(values, dtype=dtype, device=device)

    media = [w.media for w in work]
    rope_positions = None
    if any(m is not None for m in media):  # multimodal rotary positions, text rows on every axis
        axes = next(m for m in media if m is not None).rope_positions.shape[0]
        rope_positions = torch.cat(
            [
                positions[starts[i] : starts[i + 1]].expand(axes, -1) if m is None else m.positions(c, s)
                for i, (m, c, s) in enumerate(zip(media, ctx, seq, strict=True))
            ],
            dim=1,
        ).to(device)
    return ForwardBatch(
        input_ids=t(list(itertools.chain.from_iterable(w.token_ids for w in work)), torch.int64),
        positions=positions.to(device),
        query_start_loc=starts.to(device=device, dtype=torch.int32),
        seq_lens=t(seq, torch.int32),
        context_lens=t(ctx, torch.int32),
        block_tables=tables.to(device),
        slot_mapping=slots.to(device),
        state_slots=t([w.state_slot for w in work], torch.int64),
        logits_indices=logits_rows.to(device),
        cache=pools,
        q_lens_cpu=q_lens,
        seq_lens_cpu=seq,
        context_lens_cpu=ctx,
        media=media if rope_positions is not None else None,
        rope_positions=rope_positions,
    )


class ModelRunner:
    """Runs ``Model`` steps over engine-owned ``CachePools``: eager, or a CUDA-graph replay for
    decode-only steps when ``decode_graph`` is on."""

    def __init__(
        self,
        model: Model,
        pools: CachePools,
        *,
        decode_graph: bool = False,
        max_batch: int = 64,
        max_blocks: int | None = None,
    ) -> None:
        self.model = model
        self.pools = pools
        self.device = next(model.parameters()).device
        # engine.decode_graph: decode-only steps replay CUDA graphs (dgpp.engine.graphs); prefill stays eager
        self.graphs = None
        if decode_graph and self.device.type == "cuda" and getattr(model, "decode_graph_safe", True):
            from dgpp.engine.graphs import DecodeGraphs

            self.graphs = DecodeGraphs(model, pools, max_batch, max_blocks or pools.num_blocks)

    @property
    def overlaps_decode(self) -> bool:
        """Whether overlapped decode steps pay here (dgpp.sched.overlap): on a GPU, where launching is asynchronous."""
        return self.device.type == "cuda"

    @torch.inference_mode()
    def step(
        self, work: list[SeqWork], *, verify: bool = False, input_ids: torch.Tensor | None = None
    ) -> torch.Tensor:
        """fp32 logits ``[n_want, vocab]``, in order of the work items with ``want_logits``; ``verify``: a
        speculative verify, whose every row computes what plain decode would (``dgpp.step.route``).
        ``input_ids``: the step's token ids on the device, one per row, fed instead of the items' ``token_ids``
        (an overlapped step's inputs are the previous step's sampled ids, dgpp.sched.overlap; a verify's drafts
        are the drafter's picks, dgpp.engine.speculative)."""
        if not work:
            raise ValueError("step() needs at least one work item")
        rows = sum(len(w.token_ids) for w in work)
        if input_ids is not None and input_ids.shape != (rows,):
            raise ValueError(f"input_ids {tuple(input_ids.shape)} must give one token to each of {rows} rows")
        if self.model.info.hybrid:
            for w in work:
                if w.context_len == 0:
                    self.pools.zero_state(w.state_slot)
        if self.graphs is not None:
            # decode-only: straight into the graphs' static inputs, no ForwardBatch of small host tensors
            logits = self.graphs.run_work(work, input_ids)
            if logits is not None:
                return logits
        batch = build_batch(work, self.pools, self.device)
        if input_ids is not None:
            batch.input_ids = input_ids.to(batch.input_ids.dtype)
        # which CUDA kernel each row takes (a function of the row alone), on the batch for the step's layers
        batch.route = step_route(batch.input_ids, batch.q_lens_cpu, verify=verify)
        with in_flight(batch.route):
            hidden = self.model(batch)
        return self.model.compute_logits(hidden).float()
