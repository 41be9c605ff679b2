"""Scheduler settings for tests that drive ``Scheduler`` directly (no deployment template).

A deployment's ``SchedulerConfig`` comes from ``EngineConfig`` (``SchedulerConfig.from_engine``), whose schema
holds the only default of each key. These are the tests' own values, stated here once: small pools, and a
prefix cache that indexes prompts of any length (``prefix_min_tokens`` 0, where a deployment's default is 1024).
"""

from __future__ import annotations

from typing import Any

from dgpp.sched.config import AUTO_CHUNK_TOKENS, SchedulerConfig

TEST_SCHEDULER = {
    "max_concurrency": 8,
    "queue_limit": 64,
    "admission": "full",
    "admission_window": 256,
    "block_size": 16,
    "chunk_tokens": AUTO_CHUNK_TOKENS,
    "busy_chunks": 1,
    "idle_chunks": 1,
    "max_position": 1 << 30,
    "no_eos": False,
    "prefix_cache": True,
    "prefix_min_tokens": 0,
}


def scheduler_config(**overrides: Any) -> SchedulerConfig:
    """``SchedulerConfig`` with the test values above, ``overrides`` applied (unknown names are a TypeError)."""
    return SchedulerConfig(**{**TEST_SCHEDULER, **overrides})
