"""The decode graphs' static inputs, filled from the scheduler's work list with one host->device copy per dtype.

A replayed decode step reads fixed device buffers. Building a ``ForwardBatch`` first (a dozen small host
tensors, each copied to the device) and then copying every field into those buffers cost about as much
host time per step as the batch-1 model's GEMVs save in a graph. Here the buffers are typed views of one
device byte buffer: int64 token ids, positions, slot mapping and state slots, then int32 seq lens, context
lens and block tables, in that order, so a step's live part is one contiguous prefix. Its pinned host
mirror is written straight from the ``SeqWork`` lists with numpy, and a step is one asynchronous copy.

Padding rows (past the live ones) get ``slot_mapping = -1``, ``seq_len = 0``, ``state_slot = -1``: they
write nothing and attend to nothing. Their block-table rows, and table columns past a row's own blocks,
may hold stale ids from earlier steps; no kernel reads a table entry past ``seq_len``.
"""

from __future__ import annotations

import itertools

import numpy as np
import torch

from dgpp.engine.work import SeqWork


class DecodeInputs:
    """Static decode inputs for up to ``max_batch`` rows and ``max_blocks``-wide block tables on ``device``."""

    def __init__(
        self, max_batch: int, max_blocks: int, block_size: int, num_blocks: int, device: torch.device
    ) -> None:
        n = self.max_batch = max_batch
        self.max_blocks, self.block_size, self.num_blocks = max_blocks, block_size, num_blocks
        self.device = device
        pin = device.type == "cuda"
        # one byte buffer: int64 [4, n] (ids, positions, slots, state slots), then int32 seq lens, context lens
        # and tables; the step's live part is one prefix of it, so one copy moves it
        self._split = 4 * n * 8
        nbytes = self._split + (2 * n + n * max_blocks) * 4
        self.dev_bytes = torch.zeros(nbytes, dtype=torch.uint8, device=device)
        self.host_bytes = torch.zeros(nbytes, dtype=torch.uint8, pin_memory=pin)
        dev64, dev32 = self._typed(self.dev_bytes)
        self.input_ids, self.positions, self.slot_mapping, self.state_slots = dev64.unbind(0)
        self.seq_lens, self.context_lens = dev32[:n], dev32[n : 2 * n]
        self.block_tables = dev32[2 * n :].view(n, max_blocks)
        host64, host32 = self._typed(self.host_bytes)
        self.block_tables.fill_(-1)
        host32[2 * n :].fill_(-1)
        self._np64, self._np32 = host64.numpy(), host32.numpy()
        self._host_table = self._np32[2 * n :].reshape(n, max_blocks)
        self._copied = torch.cuda.Event() if pin else None

    def _typed(self, raw: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """The int64 [4, n] and flat int32 views of a byte buffer laid out as above."""
        return raw[: self._split].view(torch.int64).view(4, self.max_batch), raw[self._split :].view(
            torch.int32
        )

    def fits(self, work: list[SeqWork]) -> bool:
        """True for a decode-only step the graphs can take (one token per row, every row wants logits, no row of a
        prompt with images: its rotary positions are not the graphs' static ones)."""
        return 0 < len(work) <= self.max_batch and all(
            len(w.token_ids) == 1
            and w.want_logits
            and w.media is None
            and len(w.block_table) <= self.max_blocks
            for w in work
        )

    def stage(self, work: list[SeqWork]) -> list[int]:
        """Write ``work`` (``fits`` must hold) into the static buffers; returns the host seq lens. Raises
        ValueError naming the first row whose block table is too short or holds an id outside the pool."""
        rows, bs, n = len(work), self.block_size, self.max_batch
        ctx = [w.context_len for w in work]
        for i, (w, c) in enumerate(zip(work, ctx, strict=True)):
            if len(w.block_table) * bs <= c:
                raise ValueError(
                    f"work item {i}: block table of {len(w.block_table)} blocks covers "
                    f"{len(w.block_table) * bs} tokens, needs {c + 1}"
                )
        lens = [len(w.block_table) for w in work]
        width = max(lens)
        flat = np.fromiter(
            itertools.chain.from_iterable(w.block_table for w in work), dtype=np.int64, count=sum(lens)
        )
        if flat.size and (int(flat.min()) < 0 or int(flat.max()) >= self.num_blocks):
            lo = np.cumsum([0, *lens])
            i = next(
                i
                for i in range(rows)
                if ((flat[lo[i] : lo[i + 1]] < 0) | (flat[lo[i] : lo[i + 1]] >= self.num_blocks)).any()
            )
            raise ValueError(
                f"work item {i}: block ids {work[i].block_table} outside the pool's 0..{self.num_blocks - 1}"
            )
        if self._copied is not None:
            self._copied.synchronize()  # the previous step's copy has left the pinned mirror
        used = np.arange(width)[None, :] < np.asarray(lens)[:, None]
        region = np.full((rows, width), -1, dtype=np.int32)
        region[used] = flat
        self._host_table[:rows, :width] = region
        slots = [w.block_table[c // bs] * bs + c % bs for w, c in zip(work, ctx, strict=True)]
        h64 = self._np64
        h64[0, :rows] = [w.token_ids[0] for w in work]
        h64[1, :rows] = ctx
        h64[2, :rows] = slots
        h64[3, :rows] = [w.state_slot for w in work]
        h64[:2, rows:] = 0
        h64[2:, rows:] = -1
        seq = [c + 1 for c in ctx]
        h32 = self._np32
        h32[:rows] = seq
        h32[n : n + rows] = ctx
        h32[rows:n] = 0
        h32[n + rows : 2 * n] = 0
        # everything up to the last live row's last table column, in one copy
        live = self._split + (2 * n + (rows - 1) * self.max_blocks + width) * 4
        self.dev_bytes[:live].copy_(self.host_bytes[:live], non_blocking=True)
        if self._copied is not None:
            self._copied.record()
        return seq
