"""Preflight: everything startup refuses, decided before a weight is read or a pool allocated.

A validated ``DeployConfig`` -> the checkpoint directory -> its config.json -> its family (through the
plugins) -> the memory plan against free memory. ``dgpp check`` prints the result; ``dgpp serve`` runs the
same steps and refuses to start (exit 1) when the plan does not fit, naming the largest items (anchor §4.5).
The resolution (``Deployment``) is made once and handed on: ``dgpp.serve.build`` loads the model and the
drafter from its ``LoadContext`` instead of finding the checkpoint and the family again.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pluggy

from dgpp.config import DeployConfig
from dgpp.engine.memory import DEFAULT_HEADROOM, MemoryPlan, free_memory_bytes, plan_for
from dgpp.errors import DgppError
from dgpp.family import LoadContext, World
from dgpp.plugins import Resolution


@dataclass(frozen=True)
class Deployment:
    """A template resolved once: the checkpoint, its config.json, the family serving it and the plugin manager.

    ``context`` is the ``LoadContext`` of rank 0 of the deployment's world on ``device``; ``for_rank`` gives a
    rank's own (its world slot, device and process group), the same checkpoint and family.
    """

    cfg: DeployConfig
    checkpoint: Path
    hf_config: dict[str, Any]
    resolution: Resolution
    pm: pluggy.PluginManager
    context: LoadContext

    def for_rank(self, world: World | None = None, device: Any = None, group: Any = None) -> LoadContext:
        """This rank's ``LoadContext`` (``world`` None: one process serving the whole model)."""
        return dataclasses.replace(
            self.context, world=world or World(), device=device or self.context.device, group=group
        )


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


def default_device() -> str:
    import torch

    return "cuda" if torch.cuda.is_available() else "cpu"


def compute_dtype(cfg: DeployConfig) -> Any:
    """``engine.dtype`` as a torch dtype; None for ``auto`` (the checkpoint's own)."""
    import torch

    return None if cfg.engine.dtype == "auto" else getattr(torch, cfg.engine.dtype)


def resolve_deployment(cfg: DeployConfig, device: str | None = None) -> Deployment:
    """Find the checkpoint, read its config.json and pick its family (raises DgppError naming what is wrong)."""
    from dgpp.checkpoint.resolve import resolve_checkpoint
    from dgpp.engine.loading import read_hf_config
    from dgpp.plugins import manager, resolve
    from dgpp.serve.engine_keys import refuse_unstored_kv

    refuse_unstored_kv(cfg.engine)  # before the checkpoint is even looked for: check and serve agree
    checkpoint = resolve_checkpoint(cfg.model)
    hf_config = read_hf_config(checkpoint)
    pm = manager()
    res = resolve(pm, hf_config)
    ctx = LoadContext(
        checkpoint_dir=checkpoint,
        hf_config=hf_config,
        family=res.family.name,
        architecture=res.matched,
        engine=cfg.engine,
        world=World(0, cfg.world),
        device=device or default_device(),
        dtype=compute_dtype(cfg),
    )
    return Deployment(cfg, checkpoint, hf_config, res, pm, ctx)


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
