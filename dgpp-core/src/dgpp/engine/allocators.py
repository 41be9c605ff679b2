"""Allocators for the engine's pools: KV blocks (refcounted, free list) and state slots.

``BlockAllocator`` is the scheduler's refcounted ``BlockPool`` (one implementation for both) with a
``free`` that drops one reference per block; prefix-cache hashing is built on top, elsewhere.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Iterable

from dgpp.sched.block_pool import BlockPool, OutOfBlocks

__all__ = ["BlockAllocator", "OutOfBlocks", "OutOfSlots", "SlotAllocator"]


class OutOfSlots(RuntimeError):
    """Every state slot is in use."""


class BlockAllocator(BlockPool):
    """Free list of KV block ids with refcounts: ``allocate(n)`` (refcount 1), ``incref``, ``free``."""

    def free(self, blocks: Iterable[int]) -> None:
        """Drop one reference to each block; a block whose count reaches 0 returns to the free list."""
        for block in blocks:
            self.decref(block)


class SlotAllocator:
    """State-pool slot ids ``0..num_slots-1``, each held by at most one live sequence."""

    def __init__(self, num_slots: int) -> None:
        self.num_slots = num_slots
        self._free: deque[int] = deque(range(num_slots))
        self._used: set[int] = set()

    @property
    def num_free(self) -> int:
        return len(self._free)

    def allocate(self) -> int:
        if not self._free:
            raise OutOfSlots(f"all {self.num_slots} state slots are in use")
        slot = self._free.popleft()
        self._used.add(slot)
        return slot

    def free(self, slot: int) -> None:
        if slot not in self._used:
            raise RuntimeError(f"state slot {slot} is not allocated")
        self._used.remove(slot)
        self._free.append(slot)
