"""Preflight: everything startup refuses, decided before a weight is read or a pool allocated.

A validated ``DeployConfig`` -> the checkpoint directory -> its config.json -> its family (through the
plugins) -> the memory plan against free memory. ``dgpp check`` prints the result; ``dgpp serve`` runs the
same steps and refuses to start (exit 1) when the plan does not fit, naming the largest items.
The resolution (``Deployment``) is made once and handed on: ``dgpp.server_assembly`` loads the model and the
drafter from its ``LoadContext`` instead of finding the checkpoint and the family again.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

from dgpp.config import DeployConfig
from dgpp.errors import DgppError
from dgpp.plugins import Resolution
from dgpp.startup.deployment import Deployment, resolve_deployment
from dgpp.startup.memory_plan import plan_for
from dgpp.step.memory import DEFAULT_HEADROOM, MemoryPlan, free_memory_bytes


@dataclass(frozen=True)
class Preflight:
    """What startup found: the resolved deployment and the memory verdict."""

    deployment: Deployment
    plan: MemoryPlan
    device: str
    free_bytes: int
    headroom: int

    @property
    def checkpoint(self) -> Path:
        return self.deployment.checkpoint

    @property
    def hf_config(self) -> dict[str, Any]:
        return self.deployment.hf_config

    @property
    def resolution(self) -> Resolution:
        return self.deployment.resolution

    @property
    def fits(self) -> bool:
        return self.plan.fits(self.free_bytes, self.headroom)

    def refusal(self, block_size: int) -> str:
        return self.plan.refusal(self.free_bytes, self.headroom, block_size)


def preflight(
    cfg: DeployConfig, device: str | None = None, headroom: int | None = None, free_bytes: int | None = None
) -> Preflight:
    """Resolve checkpoint and family and size the memory plan (raises DgppError for what cannot start)."""
    found = resolve_deployment(cfg, device)
    device = found.context.device
    return Preflight(
        deployment=found,
        plan=plan_for(found.pm, found.context),
        device=device,
        free_bytes=free_memory_bytes(device) if free_bytes is None else free_bytes,
        headroom=DEFAULT_HEADROOM if headroom is None else headroom,
    )


def require_fit(cfg: DeployConfig, found: Preflight) -> None:
    if not found.fits:
        raise DgppError(found.refusal(cfg.engine.block_size))
