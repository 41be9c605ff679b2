"""Load a model from a checkpoint directory: read config.json, resolve the family's plugin, and call
its ``dgpp_load_model`` hook.

A deployment resolves its checkpoint, config.json and family once (``dgpp.startup.deployment.resolve_deployment``)
and loads through ``model_for`` with that context; ``load_model`` / ``load_context`` resolve a bare
checkpoint directory (tests, the bench, the demo).
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pluggy
import torch

from dgpp.config_schema import EngineConfig
from dgpp.errors import CheckpointError, UnsupportedModelError
from dgpp.family import LoadContext, World
from dgpp.plugins import manager, resolve
from dgpp.step.model import Model


def read_hf_config(checkpoint_dir: Path) -> dict[str, Any]:
    path = checkpoint_dir / "config.json"
    if not path.exists():
        raise CheckpointError(f"{path} is missing")
    try:
        return json.loads(path.read_text())
    except ValueError as e:
        raise CheckpointError(f"{path}: not valid JSON ({e})") from e


def model_for(ctx: LoadContext, pm: pluggy.PluginManager) -> Model:
    """The family's loaded ``Model`` for ``ctx`` (its ``dgpp_load_model`` hook); a plugin that answers None is an error."""
    model = pm.hook.dgpp_load_model(ctx=ctx)
    if model is None:
        res = resolve(pm, ctx.hf_config)  # only to name the plugin in the error
        raise UnsupportedModelError(f"plugin {res.family.plugin} returned no model for {res.matched!r}")
    return model


def load_model(
    checkpoint_dir: str | Path,
    engine_cfg: EngineConfig | None = None,
    dtype: torch.dtype | None = None,
    device: torch.device | str = "cpu",
    *,
    world: World | None = None,
    group: Any = None,
    pm: pluggy.PluginManager | None = None,
) -> Model:
    """The loaded ``Model`` for ``checkpoint_dir`` (weights in ``dtype``, else the checkpoint's), sliced
    for ``world`` (``group``: the torch.distributed TP group when ``world.size > 1``)."""
    pm = pm or manager()
    return model_for(
        load_context(checkpoint_dir, engine_cfg, dtype, device, world=world, group=group, pm=pm), pm
    )


def load_context(
    checkpoint_dir: str | Path,
    engine_cfg: EngineConfig | None = None,
    dtype: torch.dtype | None = None,
    device: torch.device | str = "cpu",
    *,
    world: World | None = None,
    group: Any = None,
    pm: pluggy.PluginManager | None = None,
) -> LoadContext:
    """The ``LoadContext`` plugin hooks get for ``checkpoint_dir`` (``engine_cfg`` None: the schema's defaults)."""
    checkpoint_dir = Path(checkpoint_dir)
    hf_config = read_hf_config(checkpoint_dir)
    res = resolve(pm or manager(), hf_config)
    return LoadContext(
        checkpoint_dir=checkpoint_dir,
        hf_config=hf_config,
        family=res.family.name,
        architecture=res.matched,
        engine=engine_cfg or EngineConfig(),
        world=world or World(),
        device=device,
        dtype=dtype,
        group=group,
    )
