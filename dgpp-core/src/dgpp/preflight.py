"""Preflight: everything startup refuses, decided before a weight is read or a pool allocated.

A validated ``DeployConfig`` -> the checkpoint directory -> its family (through the plugins) -> the
memory plan against free memory. ``dgpp check`` prints the result; ``dgpp serve`` runs the same steps
and refuses to start (exit 1) when the plan does not fit, naming the largest items (anchor §4.5).
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

from dgpp.config import DeployConfig
from dgpp.engine.memory import DEFAULT_HEADROOM, MemoryPlan, free_memory_bytes, plan_for
from dgpp.errors import DgppError
from dgpp.plugins import Resolution


@dataclass(frozen=True)
class Preflight:
    """What startup found: where the weights are, which family serves them, and the memory verdict."""

    checkpoint: Path
    hf_config: dict[str, Any]
    resolution: Resolution
    plan: MemoryPlan
    device: str
    free_bytes: int
    headroom: int

    @property
    def fits(self) -> bool:
        return self.plan.fits(self.free_bytes, self.headroom)

    def refusal(self, block_size: int) -> str:
        return self.plan.refusal(self.free_bytes, self.headroom, block_size)


def default_device() -> str:
    import torch

    return "cuda" if torch.cuda.is_available() else "cpu"


def compute_dtype(cfg: DeployConfig) -> Any:
    """``engine.dtype`` as a torch dtype; None for ``auto`` (the checkpoint's own)."""
    import torch

    return None if cfg.engine.dtype == "auto" else getattr(torch, cfg.engine.dtype)


def preflight(
    cfg: DeployConfig, device: str | None = None, headroom: int | None = None, free_bytes: int | None = None
) -> Preflight:
    """Resolve checkpoint and family and size the memory plan (raises DgppError for what cannot start)."""
    from dgpp.checkpoint.resolve import resolve_checkpoint
    from dgpp.engine.loading import read_hf_config
    from dgpp.family import LoadContext, World
    from dgpp.plugins import manager, resolve
    from dgpp.serve.engine_keys import refuse_unstored_kv

    refuse_unstored_kv(cfg.engine)  # before the checkpoint is even looked for: check and serve agree
    checkpoint = resolve_checkpoint(cfg.model)
    hf_config = read_hf_config(checkpoint)
    pm = manager()
    res = resolve(pm, hf_config)
    device = device or default_device()
    ctx = LoadContext(
        checkpoint_dir=checkpoint,
        hf_config=hf_config,
        family=res.family.name,
        architecture=res.matched,
        engine=cfg.engine,
        world=World(0, cfg.world),
        device=device,
        dtype=compute_dtype(cfg),
    )
    return Preflight(
        checkpoint=checkpoint,
        hf_config=hf_config,
        resolution=res,
        plan=plan_for(pm, ctx),
        device=device,
        free_bytes=free_memory_bytes(device) if free_bytes is None else free_bytes,
        headroom=DEFAULT_HEADROOM if headroom is None else headroom,
    )


def require_fit(cfg: DeployConfig, found: Preflight) -> None:
    if not found.fits:
        raise DgppError(found.refusal(cfg.engine.block_size))
