"""Refcounted KV blocks and state slots handed out by the scheduler.

A block is shared by every holder of a reference: the requests whose ``block_table`` names it and
the prefix cache that indexes it. It returns to the free list when the last reference drops.
"""

from __future__ import annotations

from collections import deque


class OutOfBlocks(RuntimeError):
    """The KV pool cannot give the blocks asked for, even after evicting unreferenced cache entries."""


class BlockPool:
    """``num_blocks`` KV blocks of ``block_size`` tokens; ids are row indices into ``CachePools.kv``."""

    def __init__(self, num_blocks: int, block_size: int) -> None:
        if num_blocks < 1 or block_size < 1:
            raise ValueError(
                f"a block pool needs num_blocks >= 1 and block_size >= 1 (got {num_blocks}, {block_size})"
            )
        self.num_blocks = num_blocks
        self.block_size = block_size
        self.refcount = [0] * num_blocks
        self._free: deque[int] = deque(range(num_blocks))

    @property
    def num_free(self) -> int:
        return len(self._free)

    @property
    def num_in_use(self) -> int:
        return self.num_blocks - len(self._free)

    def blocks_for_tokens(self, tokens: int) -> int:
        return -(-tokens // self.block_size)

    def allocate(self, n: int) -> list[int]:
        if n > len(self._free):
            raise OutOfBlocks(f"asked for {n} KV blocks, {len(self._free)} free of {self.num_blocks}")
        ids = [self._free.popleft() for _ in range(n)]
        for b in ids:
            self.refcount[b] = 1
        return ids

    def incref(self, block: int) -> None:
        if self.refcount[block] <= 0:
            raise RuntimeError(f"incref of free KV block {block}")
        self.refcount[block] += 1

    def decref(self, block: int) -> None:
        if self.refcount[block] <= 0:
            raise RuntimeError(f"decref of free KV block {block}")
        self.refcount[block] -= 1
        if self.refcount[block] == 0:
            self._free.append(block)


class SlotPool:
    """State-pool slots: the first ``live`` serve running requests, the rest hold prefix-cache snapshots."""

    def __init__(self, live: int, snapshots: int) -> None:
        self.live_free: deque[int] = deque(range(live))
        self.snapshot_free: deque[int] = deque(range(live, live + snapshots))
        self.num_live = live
        self.num_snapshots = snapshots

    def take_live(self) -> int | None:
        return self.live_free.popleft() if self.live_free else None

    def give_live(self, slot: int) -> None:
        self.live_free.append(slot)

    def take_snapshot(self) -> int | None:
        return self.snapshot_free.popleft() if self.snapshot_free else None

    def give_snapshot(self, slot: int) -> None:
        self.snapshot_free.append(slot)
