"""``engine.mtp``: the drafter from the family's ``dgpp_build_draft`` hook, wrapped in a ``SpeculativeDecoder``."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch

from dgpp.engine.loading import load_context
from dgpp.engine.runner import ModelRunner
from dgpp.engine.speculative import SpeculativeDecoder
from dgpp.errors import ConfigError
from dgpp.log import get_logger

log = get_logger("dgpp.engine")


def build_speculative(
    engine_cfg: Any, checkpoint: Path, runner: ModelRunner, *, pm: Any, dtype: torch.dtype | None = None,
    device: Any = "cpu", world: Any = None, group: Any = None,
) -> SpeculativeDecoder | None:
    """None unless ``engine.mtp`` is on; then the decoder at ``engine.mtp_depth`` (a ``ConfigError`` naming the key
    when the checkpoint has no drafter)."""
    if not bool(getattr(engine_cfg, "mtp", False)):
        return None
    model = runner.model
    ctx = load_context(checkpoint, engine_cfg, dtype, device, world=world, group=group, pm=pm)
    drafter = pm.hook.dgpp_build_draft(ctx=ctx, model=model)
    if drafter is None:
        raise ConfigError(f"engine.mtp: true but {checkpoint} has no MTP drafter ({ctx.family} plugin's dgpp_build_draft "
                          "returned None); set engine.mtp to false")
    if runner.graphs is not None:
        log.warning("engine.decode_graph has no effect with engine.mtp: verify steps run eager")
    decoder = SpeculativeDecoder(runner, drafter, int(getattr(engine_cfg, "mtp_depth", 1)))
    log.info("speculative decoding on", drafter=type(drafter).__name__, depth=decoder.depth)
    return decoder
