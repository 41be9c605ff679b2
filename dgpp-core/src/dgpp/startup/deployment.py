"""A deployment resolved once: the checkpoint directory, its config.json and the family that serves it.

``resolve_deployment`` is what ``dgpp check``, ``dgpp serve`` and every TP rank do first; the ``Deployment`` it
returns is handed on, so the model and the drafter load from its ``LoadContext`` instead of finding the
checkpoint and the family again.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pluggy

from dgpp.config import DeployConfig
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
    from dgpp.plugins import manager, resolve
    from dgpp.startup.loading import read_hf_config

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
