"""Per-parameter weight loaders: how one checkpoint tensor lands in one (possibly sliced) parameter.

A parameter may carry ``weight_loader(param, loaded, shard)``; the checkpoint loader calls it with the
full tensor as stored. ``shard`` is ``None`` for a one-to-one tensor, or a loader-specific key when
several checkpoint tensors fill one parameter (e.g. ``(expert, "gate")`` for fused experts).
Loaders raise ``WeightShapeError``; the checkpoint loader turns that into a ``CheckpointError``
naming the tensor and its file.
"""

from __future__ import annotations

from typing import Any

import torch

from dgpp.family import World


class WeightShapeError(ValueError):
    """A checkpoint tensor does not have the shape (or kind of dtype) its parameter expects."""


def set_weight_attrs(param: torch.Tensor, **attrs: Any) -> None:
    """Attach loader metadata (``tp_dim``, ``world``, ``weight_loader``) to a parameter."""
    for key, value in attrs.items():
        setattr(param, key, value)


def narrow_for_rank(loaded: torch.Tensor, tp_dim: int | None, world: World | None) -> torch.Tensor:
    """This rank's contiguous slice of ``loaded`` along ``tp_dim`` (the whole tensor at world 1)."""
    if tp_dim is None or world is None or world.size == 1:
        return loaded
    full = loaded.shape[tp_dim]
    if full % world.size:
        raise WeightShapeError(f"dim {tp_dim} of size {full} is not divisible by TP world {world.size}")
    part = full // world.size
    return loaded.narrow(tp_dim, world.rank * part, part)


def check_dtype_kind(param: torch.Tensor, loaded: torch.Tensor) -> None:
    """Float tensors may be cast to the compute dtype; anything else (packed ints, fp8 codes) must match."""
    if loaded.dtype == param.dtype:
        return
    if loaded.dtype.is_floating_point and param.dtype.is_floating_point and loaded.element_size() > 1:
        return
    raise WeightShapeError(f"dtype {loaded.dtype} cannot be loaded into a {param.dtype} parameter")


def copy_checked(dst: torch.Tensor, src: torch.Tensor) -> None:
    """Copy ``src`` into ``dst`` after checking shape and dtype kind."""
    if tuple(dst.shape) != tuple(src.shape):
        raise WeightShapeError(f"shape {list(src.shape)} does not match the expected {list(dst.shape)}")
    check_dtype_kind(dst, src)
    with torch.no_grad():
        dst.copy_(src)


def default_weight_loader(param: torch.Tensor, loaded: torch.Tensor, shard: Any = None) -> None:
    """One tensor -> one parameter: slice for this rank (``param.tp_dim``), check, copy."""
    if shard is not None:
        raise WeightShapeError(f"unexpected shard {shard!r} for a one-to-one parameter")
    tp_dim = getattr(param, "tp_dim", None)
    world = getattr(param, "world", None)
    if tp_dim is not None and world is not None and world.size > 1:
        expected_full = list(param.shape)
        expected_full[tp_dim] *= world.size
        if list(loaded.shape) != expected_full:
            raise WeightShapeError(f"shape {list(loaded.shape)} does not match the expected {expected_full}")
    copy_checked(param, narrow_for_rank(loaded, tp_dim, world))
