"""Scheduler settings, resolved from the deployment's ``engine.*`` keys.

The fields have no defaults: a deployment's values come from ``EngineConfig`` (whose schema holds the only
default of each key) through ``from_engine``; tests state theirs (``dgpp.testing.scheduler``).
"""

from __future__ import annotations

from dataclasses import dataclass

from dgpp.config_schema import EngineConfig
from dgpp.prefill_budget import AUTO_CHUNK_TOKENS, busy_budget_tokens

__all__ = ["AUTO_CHUNK_TOKENS", "SchedulerConfig"]


@dataclass(frozen=True)
class SchedulerConfig:
    """``chunk_tokens`` is the prefill chunk (aligned to the block size); a tick may prefill ``busy_chunks`` /
    ``idle_chunks`` chunks' worth of tokens while something decodes / when nothing does, packed from as many
    prompts as fit (a burst of short prompts shares a forward)."""

    max_concurrency: int
    queue_limit: int
    admission: str
    admission_window: int
    block_size: int
    chunk_tokens: int
    busy_chunks: int
    idle_chunks: int
    max_position: int
    no_eos: bool
    prefix_cache: bool
    prefix_min_tokens: int

    @classmethod
    def from_engine(cls, engine: EngineConfig, block_size: int, max_position: int) -> SchedulerConfig:
        """Map ``engine.prefill_budget_tokens`` (-1 auto, 0 monolithic) and friends onto chunks.

        A monolithic prefill (budget 0) computes a prompt in one forward, so no cut inside it could be
        repeated by a suffix prefill: the prefix cache is then off, to stay exact.
        """
        budget = engine.prefill_budget_tokens
        idle = engine.prefill_idle_budget_tokens
        monolithic = budget == 0
        if budget < 0:
            budget = AUTO_CHUNK_TOKENS
        chunk = max_position if monolithic else _align_up(budget, block_size)
        # the auto budget keeps 256-token chunks but packs several of them per tick (dgpp.prefill_budget)
        busy_chunks = max(1, busy_budget_tokens(engine) // chunk) if not monolithic else 1
        idle_chunks = max(busy_chunks, idle // chunk) if not monolithic else 1
        return cls(
            max_concurrency=engine.max_concurrency,
            queue_limit=engine.queue_limit,
            admission=engine.admission,
            admission_window=engine.admission_window,
            block_size=block_size,
            chunk_tokens=chunk,
            busy_chunks=busy_chunks,
            idle_chunks=idle_chunks,
            max_position=max_position,
            no_eos=engine.no_eos,
            prefix_cache=engine.prefix_cache_gib > 0 and not monolithic,
            prefix_min_tokens=engine.prefix_min_tokens,
        )


def _align_up(n: int, a: int) -> int:
    return -(-n // a) * a
