"""The automatic prefill budgets: one reading of ``engine.prefill_budget_tokens`` shared by the scheduler
(``dgpp.sched.config``) and the memory plans (``dgpp.startup.memory_estimate``, the plugins' plans), so the
activations a plan reserves are the tokens a tick may really prefill."""

from __future__ import annotations

from dgpp.config_schema import EngineConfig

#: the prefill chunk of ``prefill_budget_tokens: -1`` (prefix-cache cuts sit at its multiples)
AUTO_CHUNK_TOKENS = 256
#: prompt tokens a tick may prefill under ``prefill_budget_tokens: -1``, packed from several prompts: bursts
#: of short prompts are prefilled in a few forwards instead of one prompt per tick
AUTO_BUSY_TOKENS = 8192


def busy_budget_tokens(engine: EngineConfig) -> int:
    """Prompt tokens per tick while something decodes (0 for a monolithic prefill)."""
    return AUTO_BUSY_TOKENS if engine.prefill_budget_tokens < 0 else engine.prefill_budget_tokens


def largest_prefill_tokens(engine: EngineConfig) -> int:
    """The most prompt tokens one tick may prefill (busy or idle), for activation memory; callers handle the
    monolithic case (``prefill_budget_tokens: 0``) themselves."""
    return max(busy_budget_tokens(engine), engine.prefill_idle_budget_tokens)
