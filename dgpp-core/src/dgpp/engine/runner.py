"""The model runner: several sequences' work for one step -> one ``ForwardBatch`` -> logits rows.

Each ``SeqWork`` is a prefill chunk or a decode token of one sequence; they are flattened into one
varlen batch, so prefill and decode rows run in the same forward. The runner validates the block
tables, computes positions and slot mappings, and zeroes a hybrid model's state slot when a
sequence starts (``context_len == 0``).
"""

from __future__ import annotations

import torch

from dgpp.engine.batch import ForwardBatch
from dgpp.engine.model import Model
from dgpp.engine.pools import CachePools
from dgpp.sched.work import SeqWork  # one definition shared with the scheduler

__all__ = ["ModelRunner", "SeqWork", "build_batch"]


def build_batch(work: list[SeqWork], pools: CachePools, device: torch.device | str = "cpu") -> ForwardBatch:
    """Flatten ``work`` into a ``ForwardBatch`` over ``pools`` (raises ValueError on a short block table)."""
    bs = pools.block_size
    ids: list[int] = []
    positions: list[int] = []
    slots: list[int] = []
    starts = [0]
    logits_rows: list[int] = []
    for i, w in enumerate(work):
        n = len(w.token_ids)
        end = w.context_len + n
        if n == 0:
            raise ValueError(f"work item {i} has no tokens")
        if len(w.block_table) * bs < end:
            raise ValueError(
                f"work item {i}: block table of {len(w.block_table)} blocks covers {len(w.block_table) * bs} "
                f"tokens, needs {end}"
            )
        if w.block_table and not 0 <= min(w.block_table) <= max(w.block_table) < pools.num_blocks:
            raise ValueError(f"work item {i}: block ids {w.block_table} outside the pool's 0..{pools.num_blocks - 1}")
        for pos in range(w.context_len, end):
            positions.append(pos)
            slots.append(w.block_table[pos // bs] * bs + pos % bs)
        ids.extend(w.token_ids)
        starts.append(starts[-1] + n)
        if w.want_logits:
            logits_rows.append(starts[-1] - 1)
    width = max(len(w.block_table) for w in work)
    tables = torch.full((len(work), width), -1, dtype=torch.int32)
    for i, w in enumerate(work):
        tables[i, : len(w.block_table)] = torch.tensor(w.block_table, dtype=torch.int32)
    q_lens = [len(w.token_ids) for w in work]
    ctx = [w.context_len for w in work]
    seq = [c + q for c, q in zip(ctx, q_lens, strict=True)]

    def t(values: list[int], dtype: torch.dtype) -> torch.Tensor:
        return torch.tensor(values, dtype=dtype, device=device)

    return ForwardBatch(
        input_ids=t(ids, torch.int64),
        positions=t(positions, torch.int64),
        query_start_loc=t(starts, torch.int32),
        seq_lens=t(seq, torch.int32),
        context_lens=t(ctx, torch.int32),
        block_tables=tables.to(device),
        slot_mapping=t(slots, torch.int64),
        state_slots=t([w.state_slot for w in work], torch.int64),
        logits_indices=t(logits_rows, torch.int64),
        cache=pools,
        q_lens_cpu=q_lens,
        seq_lens_cpu=seq,
        context_lens_cpu=ctx,
    )


class ModelRunner:
    """Runs ``Model`` steps over engine-owned ``CachePools``: eager, or a CUDA-graph replay for
    decode-only steps when ``decode_graph`` is on."""

    def __init__(
        self, model: Model, pools: CachePools, *, decode_graph: bool = False, max_batch: int = 64,
        max_blocks: int | None = None,
    ) -> None:
        self.model = model
        self.pools = pools
        self.device = next(model.parameters()).device
        # engine.decode_graph: decode-only steps replay CUDA graphs (dgpp.engine.graphs); prefill stays eager
        self.graphs = None
        if decode_graph and self.device.type == "cuda":
            from dgpp.engine.graphs import DecodeGraphs

            self.graphs = DecodeGraphs(model, pools, max_batch, max_blocks or pools.num_blocks)

    @torch.inference_mode()
    def step(self, work: list[SeqWork]) -> torch.Tensor:
        """fp32 logits ``[n_want, vocab]``, in order of the work items with ``want_logits``."""
        if not work:
            raise ValueError("step() needs at least one work item")
        if self.model.info.hybrid:
            for w in work:
                if w.context_len == 0:
                    self.pools.zero_state(w.state_slot)
        batch = build_batch(work, self.pools, self.device)
        if self.graphs is not None and self.graphs.can_run(batch):
            return self.graphs.run(batch)
        hidden = self.model(batch)
        return self.model.compute_logits(hidden).float()
