"""Fill a module's parameters from a checkpoint: each parameter is pulled from its source tensors
(see ``sources.py``), each tensor is read once and handed to the parameter's ``weight_loader``.

Every parameter must be filled: a missing tensor or a wrong shape is a ``CheckpointError`` naming
the tensor and the file. Checkpoint tensors nothing asked for (MTP layers, vision towers) are
reported back, not loaded.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field

import torch
from torch import nn

from dgpp.checkpoint.reader import CheckpointReader
from dgpp.errors import CheckpointError
from dgpp.log import get_logger
from dgpp.nn.sources import Alternatives, Source
from dgpp.nn.weights import WeightShapeError, copy_checked, default_weight_loader

log = get_logger("dgpp.checkpoint")


@dataclass
class LoadReport:
    """What a load did: the tensors it used and the ones it left alone."""

    loaded: list[str] = field(default_factory=list)
    unused: list[str] = field(default_factory=list)


def _sources_of(model: nn.Module) -> dict[str, Alternatives]:
    """Full parameter name -> alternatives, from modules that define ``checkpoint_sources``."""
    out: dict[str, Alternatives] = {}
    for prefix, module in model.named_modules():
        fn = getattr(module, "checkpoint_sources", None)
        if fn is None:
            continue
        base = f"{prefix}." if prefix else ""
        for local, alternatives in fn().items():
            out[base + local] = [[Source(base + s.name, s.shard) for s in alt] for alt in alternatives]
    return out


def _is_sliced(param: torch.Tensor) -> bool:
    world = getattr(param, "world", None)
    return getattr(param, "tp_dim", None) is not None and world is not None and world.size > 1


def _load_rank_slice(param: torch.Tensor, reader: CheckpointReader, name: str) -> None:
    """The default loader's work for a TP-split parameter, reading only this rank's part from disk."""
    dim, world = param.tp_dim, param.world
    expected = list(param.shape)
    expected[dim] *= world.size
    if list(reader.shape(name)) != expected:
        raise WeightShapeError(f"shape {list(reader.shape(name))} does not match the expected {expected}")
    part = param.shape[dim]
    copy_checked(param, reader.get_part(name, dim, world.rank * part, part))


def load_weights(
    model: nn.Module,
    reader: CheckpointReader,
    *,
    rename: Callable[[str], str] = lambda name: name,
) -> LoadReport:
    """Load every parameter of ``model``. ``rename`` maps a module-side tensor name to the checkpoint's
    (e.g. a ``model.language_model.`` prefix for multimodal wrappers)."""
    special = _sources_of(model)
    report = LoadReport()
    with torch.no_grad():
        for pname, param in model.named_parameters():
            alternatives = special.get(pname, [[Source(pname)]])
            chosen = next((alt for alt in alternatives if rename(alt[0].name) in reader), alternatives[-1])
            loader = getattr(param, "weight_loader", default_weight_loader)
            for src in chosen:
                name = rename(src.name)
                if name not in reader:
                    tried = " or ".join(repr(rename(alt[0].name)) for alt in alternatives)
                    raise CheckpointError(
                        f"tensor {name!r} (for parameter {pname}) is missing from {reader.searched()}"
                        + (f"; looked for {tried}" if len(alternatives) > 1 else "")
                    )
                try:
                    if loader is default_weight_loader and src.shard is None and _is_sliced(param):
                        _load_rank_slice(param, reader, name)
                    else:
                        loader(param, reader.get(name), src.shard)
                except WeightShapeError as e:
                    raise CheckpointError(f"tensor {name!r} in {reader.where(name)}: {e}") from e
                report.loaded.append(name)
    used = set(report.loaded)
    report.unused = [n for n in reader.names() if n not in used]
    log.info(
        "weights loaded",
        checkpoint=str(reader.dir),
        tensors=len(used),
        unused=len(report.unused),
        unused_first=report.unused[:4],
    )
    return report
