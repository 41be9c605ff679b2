"""Scheduler settings, resolved from the deployment's ``engine.*`` keys."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

AUTO_CHUNK_TOKENS = 256


@dataclass(frozen=True)
class SchedulerConfig:
    """``chunk_tokens`` is the prefill chunk (aligned to the block size); ``busy_chunks`` / ``idle_chunks`` are
    how many chunks may run per tick while something decodes / when nothing does."""

    max_concurrency: int = 8
    queue_limit: int = 64
    admission: str = "full"
    admission_window: int = 256
    block_size: int = 16
    chunk_tokens: int = AUTO_CHUNK_TOKENS
    busy_chunks: int = 1
    idle_chunks: int = 1
    max_position: int = 1 << 30
    no_eos: bool = False
    prefix_cache: bool = True
    prefix_min_tokens: int = 0

    @classmethod
    def from_engine(cls, engine: Any, block_size: int, max_position: int) -> SchedulerConfig:
        """Map ``engine.prefill_budget_tokens`` (-1 auto, 0 monolithic) and friends onto chunks.

        A monolithic prefill (budget 0) computes a prompt in one forward, so no cut inside it could be
        repeated by a suffix prefill: the prefix cache is then off, to stay exact.
        """
        budget = int(getattr(engine, "prefill_budget_tokens", -1))
        idle = int(getattr(engine, "prefill_idle_budget_tokens", 0))
        monolithic = budget == 0
        if budget < 0:
            budget = AUTO_CHUNK_TOKENS
        chunk = max_position if monolithic else _align_up(budget, block_size)
        idle_chunks = max(1, idle // chunk) if not monolithic else 1
        cache_gib = float(getattr(engine, "prefix_cache_gib", 1.5))
        return cls(
            max_concurrency=int(getattr(engine, "max_concurrency", 8)),
            queue_limit=int(getattr(engine, "queue_limit", 64)),
            admission=str(getattr(engine, "admission", "full")),
            admission_window=int(getattr(engine, "admission_window", 256)),
            block_size=block_size,
            chunk_tokens=chunk,
            busy_chunks=1,
            idle_chunks=idle_chunks,
            max_position=max_position,
            no_eos=bool(getattr(engine, "no_eos", False)),
            prefix_cache=cache_gib > 0 and not monolithic,
            prefix_min_tokens=int(getattr(engine, "prefix_min_tokens", 0)),
        )


def _align_up(n: int, a: int) -> int:
    return -(-n // a) * a
