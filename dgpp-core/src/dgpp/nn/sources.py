"""Where a parameter's values come from in a checkpoint.

By default parameter ``a.b.weight`` is filled from the tensor of the same name. A module that stores
weights differently from the checkpoint (fused experts, stacked projections) defines
``checkpoint_sources() -> {local_param_name: [alternative, ...]}``; each alternative is a list of
``Source`` (tensor name relative to the module, plus the ``shard`` key its ``weight_loader`` gets).
The first alternative whose first tensor exists in the checkpoint is used, and all of its tensors
must then exist.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any


@dataclass(frozen=True)
class Source:
    """One checkpoint tensor (name relative to the owning module) and its shard key."""

    name: str
    shard: Any = None


Alternatives = list[list[Source]]
