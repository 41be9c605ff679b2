"""What a plugin declares about a model family, and what the engine hands it to load one."""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

from dgpp.config_schema import EngineConfig

if TYPE_CHECKING:  # types only: declaring a family must not load torch
    import torch
    from torch.distributed import ProcessGroup


@dataclass(frozen=True)
class FamilySpec:
    """One model family a plugin provides.

    ``architectures`` / ``model_types`` are the HF config.json values the family claims (the first
    ``architectures`` entry is matched first, then ``model_type``). ``implemented`` lists the claimed
    values it can load today; a claimed but unimplemented one is refused with a clear
    "not yet supported" error rather than a crash.
    """

    name: str
    plugin: str
    architectures: tuple[str, ...] = ()
    model_types: tuple[str, ...] = ()
    implemented: tuple[str, ...] = ()
    description: str = ""

    def __post_init__(self) -> None:
        # an implemented value that is not claimed could never be resolved: a plugin-authoring slip
        stray = [v for v in self.implemented if v not in self.architectures and v not in self.model_types]
        if stray:
            from dgpp.errors import PluginError

            raise PluginError(
                f"family {self.name} (plugin {self.plugin}) implements {', '.join(stray)} "
                "without claiming it: add it to architectures or model_types"
            )

    def claims(self, value: str) -> bool:
        return value in self.architectures or value in self.model_types

    def implements(self, value: str) -> bool:
        return value in self.implemented


@dataclass(frozen=True)
class World:
    """This process's place in a tensor-parallel world (rank 0 of 1 when not distributed)."""

    rank: int = 0
    size: int = 1


@dataclass
class LoadContext:
    """Everything a plugin's loader needs: the checkpoint, its parsed HF config, engine settings, world.

    ``hf_config`` is the checkpoint's config.json as a dict; ``engine`` is the deployment's
    ``engine.*`` section (its schema defaults when the caller gives none: a plugin reads every setting
    from it, never with a fallback of its own); ``dtype``/``device`` are what weights are computed in
    (the checkpoint's dtype unless a deployment key says otherwise).
    """

    checkpoint_dir: Path
    hf_config: dict[str, Any]
    family: str
    architecture: str
    engine: EngineConfig = field(default_factory=EngineConfig)
    world: World = field(default_factory=World)
    device: torch.device | str = "cpu"
    dtype: torch.dtype | None = None
    group: ProcessGroup | None = None  # torch.distributed process group for TP collectives, when size > 1
