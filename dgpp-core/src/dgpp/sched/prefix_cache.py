"""Exact prefix cache: full KV blocks shared by reference, plus state snapshots for hybrid models.

Keys are hash-chained over token ids (block i's key covers every token up to its end), and a hit is
confirmed by comparing the block's tokens. Exactness comes from *where* a request may attach:

* at multiples of ``attach``. By default that is ``cut``, the prefill chunk size: a cold run computes its
  KV in chunks cut at those same positions, so the suffix prefill repeats the cold chunk sequence, which
  is what keeps a hit exact when a row's bits depend on the chunk it was computed in (CUDA's prefill
  kernels). Where every prompt row is computed the same however the prompt is chunked (the CPU paths,
  and ``engine.batch_invariant``), ``attach`` is the KV block size: any full block can be reused;
* only prefill-written blocks are indexed (never decode-written KV);
* never at the last prompt token, whose logits the request needs;
* for hybrid models (recurrent / conv state) only where a state snapshot was taken at that cut
  (``attach`` stays ``cut``: a snapshot exists only where a chunk ended).

The cache holds one reference on each indexed block; an entry whose block nobody else references is
evictable, least recently used first (deeper blocks before their parents on equal age).
"""

from __future__ import annotations

import hashlib
import time
from collections import OrderedDict
from collections.abc import Callable
from dataclasses import dataclass, field

from dgpp.sched.block_pool import BlockPool, SlotPool

ROOT_KEY = b"dgpp-prefix-root"


def chain_key(parent: bytes, tokens: list[int] | tuple[int, ...]) -> bytes:
    """Key of a block given its parent's key and its own token ids."""
    h = hashlib.blake2b(parent, digest_size=16)
    h.update(b"".join(int(t).to_bytes(8, "little", signed=True) for t in tokens))
    return h.digest()


@dataclass
class _BlockEntry:
    block: int
    tokens: tuple[int, ...]


@dataclass
class _SnapshotEntry:
    slot: int
    position: int
    blocks: list[int]  # the blocks before the cut, pinned while the snapshot lives


@dataclass
class PrefixMatch:
    """Where a new request attaches: ``position`` tokens are cached in ``blocks`` (and ``snapshot_slot``)."""

    position: int = 0
    blocks: list[int] = field(default_factory=list)
    snapshot_slot: int | None = None


@dataclass
class PrefixCacheStats:
    hits: int = 0
    misses: int = 0
    tokens_saved: int = 0
    snapshots: int = 0
    evictions: int = 0
    duplicates: int = 0
    skipped_no_slot: int = 0
    snapshot_ms: float = 0.0  # total time copying state into snapshot slots
    attaches: int = 0  # hits that restored a snapshot
    attach_ms: float = 0.0
    ttft_hit_count: int = 0
    ttft_hit_ms: float = 0.0
    ttft_miss_count: int = 0
    ttft_miss_ms: float = 0.0

    def first_token(self, hit: bool, ms: float) -> None:
        """Time to first token of a sequence, booked by whether it attached to the cache."""
        if hit:
            self.ttft_hit_count += 1
            self.ttft_hit_ms += ms
        else:
            self.ttft_miss_count += 1
            self.ttft_miss_ms += ms


class PrefixCache:
    """Index of reusable prefill work. ``cut`` is the chunk size (a multiple of the block size); ``attach``
    (default ``cut``) the granularity a request may attach at, a divisor of ``cut`` and a multiple of the
    block size (see the module docstring for when the block size is exact)."""

    def __init__(
        self,
        pool: BlockPool,
        cut: int,
        hybrid: bool = False,
        slots: SlotPool | None = None,
        copy_state: Callable[[int, int], None] | None = None,
        min_tokens: int = 0,
        enabled: bool = True,
        snapshot_bytes: int = 0,
        attach: int | None = None,
    ) -> None:
        if cut % pool.block_size:
            raise ValueError(
                f"prefix cache cut {cut} must be a multiple of the KV block size {pool.block_size}"
            )
        attach = cut if attach is None else attach
        if attach % pool.block_size or cut % attach:
            raise ValueError(
                f"prefix cache attach granularity {attach} must be a multiple of the KV block size "
                f"{pool.block_size} and divide the cut {cut}"
            )
        if hybrid and attach != cut:
            raise ValueError(
                "a hybrid model's prefix cache attaches only at cuts, where its snapshots are taken"
            )
        if hybrid and (slots is None or copy_state is None):
            raise ValueError("a hybrid model's prefix cache needs snapshot slots and copy_state")
        self.pool = pool
        self.cut = cut
        self.attach_every = attach
        self.hybrid = hybrid
        self.slots = slots
        self.copy_state = copy_state
        self.min_tokens = min_tokens
        self.enabled = enabled
        self.snapshot_bytes_each = snapshot_bytes  # state bytes one snapshot holds (for metrics)
        self.stats = PrefixCacheStats()
        # both in least-recently-used-first order; a chain is refreshed deepest block first, so a
        # parent is always more recent than its children and children are evicted first
        self._blocks: OrderedDict[bytes, _BlockEntry] = OrderedDict()
        self._snapshots: OrderedDict[bytes, _SnapshotEntry] = OrderedDict()

    # ---- lookup -------------------------------------------------------------------------------
    def block_keys(self, prompt: list[int]) -> list[bytes]:
        """The chain keys of the prompt's full blocks before its last token (callers may keep them: a
        request waiting for room is looked up again every tick)."""
        bs = self.pool.block_size
        key, keys = ROOT_KEY, []
        for i in range((len(prompt) - 1) // bs):  # never the last prompt token
            key = chain_key(key, prompt[i * bs : (i + 1) * bs])
            keys.append(key)
        return keys

    def match(self, prompt: list[int], block_keys: list[bytes] | None = None) -> PrefixMatch:
        """Longest usable cached prefix of ``prompt``; takes a reference on each returned block."""
        if not self.enabled:
            return PrefixMatch()
        bs = self.pool.block_size
        all_keys = block_keys if block_keys is not None else self.block_keys(prompt)
        chain, keys = [], []
        for i, key in enumerate(all_keys):
            tokens = tuple(prompt[i * bs : (i + 1) * bs])
            entry = self._blocks.get(key)
            if entry is None or entry.tokens != tokens:
                break
            chain.append(entry)
            keys.append(key)
        position = (len(chain) * bs // self.attach_every) * self.attach_every
        snapshot: _SnapshotEntry | None = None
        if self.hybrid:
            position = 0
            for n in range(len(chain), 0, -1):
                snap = self._snapshots.get(keys[n - 1])
                if snap is not None and snap.position == n * bs:
                    snapshot, position = snap, n * bs
                    break
        if position == 0:
            self.stats.misses += 1
            return PrefixMatch()
        used = chain[: position // bs]
        for entry in used:
            self.pool.incref(entry.block)
        self._touch(keys[: len(used)])
        if snapshot is not None:
            self._snapshots.move_to_end(keys[len(used) - 1])
        self.stats.hits += 1
        self.stats.tokens_saved += position
        return PrefixMatch(position, [e.block for e in used], snapshot.slot if snapshot else None)

    def release(self, match: PrefixMatch) -> None:
        """Undo a ``match`` whose request could not be admitted after all (drops its references and counts)."""
        for b in match.blocks:
            self.pool.decref(b)
        if match.position:
            self.stats.hits -= 1
            self.stats.tokens_saved -= match.position
        elif self.enabled:
            self.stats.misses -= 1

    def attach(self, match: PrefixMatch, slot: int) -> None:
        """Restore a hybrid match's snapshot into the request's state slot."""
        if match.snapshot_slot is None or self.copy_state is None:
            return
        started = time.monotonic()
        self.copy_state(match.snapshot_slot, slot)
        self.stats.attaches += 1
        self.stats.attach_ms += (time.monotonic() - started) * 1000.0

    # ---- insertion ----------------------------------------------------------------------------
    def insert(
        self, tokens: list[int], block_table: list[int], position: int, state_slot: int | None = None
    ) -> None:
        """Index the prefill work of a request whose first ``position`` tokens (a multiple of ``attach``) are
        now in its blocks; for hybrid models also snapshot ``state_slot`` at that cut."""
        if not self.enabled or position <= 0 or position % self.attach_every or position < self.min_tokens:
            return
        bs = self.pool.block_size
        key = ROOT_KEY
        keys: list[bytes] = []
        indexed: list[int] = []  # the blocks the index holds for this prefix (maybe another request's)
        for i in range(position // bs):
            block_tokens = tuple(tokens[i * bs : (i + 1) * bs])
            key = chain_key(key, block_tokens)
            entry = self._blocks.get(key)
            if entry is None:
                self.pool.incref(block_table[i])
                entry = self._blocks[key] = _BlockEntry(block_table[i], block_tokens)
            elif entry.block != block_table[i]:
                self.stats.duplicates += 1
            keys.append(key)
            indexed.append(entry.block)
        self._touch(keys)
        if self.hybrid and state_slot is not None and key not in self._snapshots:
            self._snapshot(key, position, indexed, state_slot)

    def _snapshot(self, key: bytes, position: int, blocks: list[int], state_slot: int) -> None:
        assert self.slots is not None and self.copy_state is not None
        slot = self.slots.take_snapshot()
        if slot is None and self._evict_snapshot():
            slot = self.slots.take_snapshot()
        if slot is None:
            self.stats.skipped_no_slot += 1
            return
        started = time.monotonic()
        self.copy_state(state_slot, slot)
        self.stats.snapshot_ms += (time.monotonic() - started) * 1000.0
        for b in blocks:
            self.pool.incref(b)
        self._snapshots[key] = _SnapshotEntry(slot, position, list(blocks))
        self.stats.snapshots += 1

    # ---- eviction -----------------------------------------------------------------------------
    def evict_blocks(self, need_free: int) -> None:
        """Drop least recently used blocks held only by the cache until ``need_free`` blocks are free."""
        while self.pool.num_free < need_free:
            short = need_free - self.pool.num_free
            victims = []
            for key, entry in self._blocks.items():  # oldest first
                if self.pool.refcount[entry.block] == 1:
                    victims.append(key)
                    if len(victims) == short:
                        break
            if not victims:  # everything left is pinned by requests or snapshots: free a snapshot's pins
                if not self._evict_snapshot():
                    return
                continue
            for key in victims:
                self.pool.decref(self._blocks.pop(key).block)
                self.stats.evictions += 1

    def _evict_snapshot(self) -> bool:
        if not self._snapshots:
            return False
        _, snap = self._snapshots.popitem(last=False)
        for b in snap.blocks:
            self.pool.decref(b)
        assert self.slots is not None
        self.slots.give_snapshot(snap.slot)
        self.stats.evictions += 1
        return True

    def _touch(self, keys: list[bytes]) -> None:
        for key in reversed(keys):
            self._blocks.move_to_end(key)

    # ---- introspection ------------------------------------------------------------------------
    @property
    def num_entries(self) -> int:
        return len(self._blocks)

    @property
    def num_snapshots(self) -> int:
        return len(self._snapshots)

    @property
    def blocks_pinned(self) -> int:
        return len(self._blocks)
