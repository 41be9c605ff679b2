"""The memory plan: itemized bytes per rank, checked before anything is allocated.

Core owns the plan. What only a family knows is its ``ModelMemory``: bytes of the model as it would be built
(weights, drafter, KV per token, state per request, activations per prefill row). ``plan_memory`` sizes the
deployment's items from it (pools, request state, prefill scratch, prefix snapshots, logits) with one set of
formulas for every family. A plugin answers ``dgpp_memory_plan(ctx)`` with its ``ModelMemory``; otherwise
``dgpp.startup.memory_estimate`` derives one from config.json and the safetensors headers
(``dgpp.startup.memory_plan.plan_for`` picks). The engine refuses to start when ``total + headroom`` exceeds
free memory, naming the largest items and the largest ``kv_capacity`` that would fit.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

from dgpp.prefill_budget import largest_prefill_tokens
from dgpp.step.cache_spec import CacheSpec, PagedKV, StateSpec

if TYPE_CHECKING:
    from dgpp.config_schema import EngineConfig

GiB = 1 << 30
DEFAULT_HEADROOM = 4 * GiB  # what the original engine keeps free for the allocator, graphs and the driver


def format_bytes(n: float) -> str:
    for unit, size in (("GiB", GiB), ("MiB", 1 << 20), ("KiB", 1 << 10)):
        if abs(n) >= size:
            return f"{n / size:.2f} {unit}"
    return f"{int(n)} B"


def cache_rates(spec: dict[str, CacheSpec]) -> tuple[int, int]:
    """(KV bytes per token over the paged entries, state bytes per request over the state entries)."""
    kv = sum(s.bytes_per_token() for s in spec.values() if isinstance(s, PagedKV))
    state = sum(s.bytes_per_request() for s in spec.values() if isinstance(s, StateSpec))
    return kv, state


@dataclass(frozen=True)
class MemoryPlan:
    """Bytes one rank needs: per-model items and per-token / per-request rates times the deployment's sizes.

    ``weights`` excludes the drafter (its own item). ``kv_per_token`` counts every paged layer (K and V),
    ``state_per_request`` every recurrent/conv/ring state, ``activations_per_token`` the scratch of one
    prefill row. ``extra`` holds family-specific items (vision encoder, logits buffers, ...).
    """

    weights: int
    kv_per_token: int
    state_per_request: int
    activations_per_token: int
    drafter: int = 0
    kv_capacity: int = 0
    max_concurrency: int = 1
    prefill_tokens: int = 0
    prefix_cache: int = 0
    extra: dict[str, int] = field(default_factory=dict)
    notes: tuple[str, ...] = ()

    @classmethod
    def from_cache_spec(
        cls, spec: dict[str, CacheSpec], weights: int, activations_per_token: int, **sizes: Any
    ) -> MemoryPlan:
        """A plan whose KV and state rates come from a model's ``cache_spec()``."""
        kv, state = cache_rates(spec)
        return cls(
            weights=weights,
            kv_per_token=kv,
            state_per_request=state,
            activations_per_token=activations_per_token,
            **sizes,
        )

    def items(self) -> dict[str, int]:
        """Every item in bytes, largest first."""
        items = {
            "weights": self.weights,
            "drafter": self.drafter,
            "kv_pool": self.kv_per_token * self.kv_capacity,
            "request_state": self.state_per_request * self.max_concurrency,
            "activations": self.activations_per_token * self.prefill_tokens,
            "prefix_cache": self.prefix_cache,
            **self.extra,
        }
        return dict(sorted(items.items(), key=lambda kv: -kv[1]))

    def total(self) -> int:
        return sum(self.items().values())

    def fits(self, free_bytes: int, headroom: int = DEFAULT_HEADROOM) -> bool:
        return self.total() + headroom <= free_bytes

    def max_kv_capacity(self, free_bytes: int, headroom: int = DEFAULT_HEADROOM, block_size: int = 1) -> int:
        """The largest ``kv_capacity`` (a multiple of ``block_size``) that fits with everything else unchanged."""
        if self.kv_per_token <= 0:
            return 0
        rest = self.total() - self.kv_per_token * self.kv_capacity
        tokens = max(0, free_bytes - headroom - rest) // self.kv_per_token
        return tokens - tokens % block_size

    def describe(self) -> list[str]:
        lines = [f"{name:<14} {format_bytes(n):>12}" for name, n in self.items().items() if n]
        lines.append(f"{'total':<14} {format_bytes(self.total()):>12}")
        rates = (
            f"kv {format_bytes(self.kv_per_token)}/token x {self.kv_capacity}, "
            f"state {format_bytes(self.state_per_request)}/request x {self.max_concurrency}, "
            f"activations {format_bytes(self.activations_per_token)}/token x {self.prefill_tokens}"
        )
        return [*lines, rates, *self.notes]

    def refusal(self, free_bytes: int, headroom: int = DEFAULT_HEADROOM, block_size: int = 1) -> str:
        """Why the plan does not fit: the need, what is free, the largest items and the kv_capacity that would fit."""
        top = ", ".join(f"{k} {format_bytes(v)}" for k, v in list(self.items().items())[:3] if v)
        cap = self.max_kv_capacity(free_bytes, headroom, block_size)
        hint = (
            f"largest engine.kv_capacity that fits: {cap}"
            if cap
            else "no kv_capacity fits (the rest alone is too large)"
        )
        return (
            f"memory plan does not fit: needs {format_bytes(self.total())} + {format_bytes(headroom)} headroom, "
            f"{format_bytes(free_bytes)} free; largest items: {top}; {hint}"
        )


@dataclass(frozen=True)
class ModelMemory:
    """A model's own bytes on one rank, as the family would build it: what ``dgpp_memory_plan`` returns.

    ``weights`` excludes the drafter (its own item, counted when ``engine.mtp`` is on); ``kv_per_token`` counts
    every paged layer, the drafter's included when it runs; ``state_per_request`` every recurrent/conv/ring
    state; ``activations_per_token`` the scratch of one prefill row. ``vocab_size`` sizes the fp32 logits
    rows, ``max_position`` a monolithic prefill (``engine.prefill_budget_tokens: 0``).
    """

    weights: int
    kv_per_token: int
    state_per_request: int
    activations_per_token: int
    vocab_size: int
    max_position: int
    drafter: int = 0
    notes: tuple[str, ...] = ()
    extra: dict[str, int] = field(
        default_factory=dict
    )  # the family's own items, e.g. a vision encoder's scratch

    @classmethod
    def from_cache_spec(cls, spec: dict[str, CacheSpec], **bytes_: Any) -> ModelMemory:
        """KV and state rates from a model's (and its drafter's) ``cache_spec()``."""
        kv, state = cache_rates(spec)
        return cls(kv_per_token=kv, state_per_request=state, **bytes_)


def transformer_activation_bytes(hidden: int, mlp_width: int, world: int, itemsize: int) -> int:
    """Scratch of one prefill row in a pre-norm transformer block: the residual, its normed copy and the
    q/k/v/attention rows (8 x hidden), and the widest MLP's gate/up/activation on this rank."""
    return (8 * hidden + 3 * mlp_width // world) * itemsize


def prefill_rows(engine: EngineConfig, max_position: int) -> int:
    """Rows one prefill forward may carry: the tokens a tick may prefill (``dgpp.prefill_budget``), or a whole
    prompt when prefill is monolithic (``prefill_budget_tokens: 0``)."""
    if engine.prefill_budget_tokens == 0:
        return min(engine.kv_capacity, max_position)
    return largest_prefill_tokens(engine)


def plan_memory(model: ModelMemory, engine: EngineConfig) -> MemoryPlan:
    """The deployment's plan for ``model`` under its ``engine.*`` settings (the one place these sizes are set)."""
    mtp, max_conc = engine.mtp, engine.max_concurrency
    depth = engine.drafts_per_step()
    # prefix snapshots need their own arena only when requests carry state; plain KV is shared by reference
    prefix = int(engine.prefix_cache_gib * (1 << 30)) if model.state_per_request else 0
    return MemoryPlan(
        weights=model.weights,
        drafter=model.drafter if mtp else 0,
        kv_per_token=model.kv_per_token,
        state_per_request=model.state_per_request,
        activations_per_token=model.activations_per_token,
        kv_capacity=engine.kv_capacity,
        max_concurrency=max_conc,
        # a verify step's rows take a prefill row's scratch each
        prefill_tokens=max(prefill_rows(engine, model.max_position), max_conc * (1 + depth)),
        prefix_cache=prefix,
        # fp32 logits of every decode row (and each verify row) over the whole vocabulary, gathered on each rank
        extra={**model.extra, "logits": 4 * model.vocab_size * max(max_conc * (1 + depth), 8)},
        notes=model.notes,
    )


def free_memory_bytes(device: str = "cpu") -> int:
    """Free memory where the pools would live: the CUDA device's free bytes, else the host's MemAvailable."""
    if str(device).startswith("cuda"):
        import torch

        free, _total = torch.cuda.mem_get_info(torch.device(device))
        return int(free)
    try:
        for line in Path("/proc/meminfo").read_text().splitlines():
            if line.startswith("MemAvailable:"):
                return int(line.split()[1]) * 1024
    except OSError:
        pass
    import os

    return os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
