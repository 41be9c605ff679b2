"""What a plugin declares about a model family, and what the engine hands it to load one."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from importlib import import_module
from pathlib import Path
from typing import TYPE_CHECKING, Any, ClassVar, Protocol, runtime_checkable

from dgpp.config_schema import EngineConfig
from dgpp.errors import PluginError

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


def split_reference(reference: str) -> tuple[str, str]:
    """``"package.module:name"`` -> ``("package.module", "name")``; any other form is a PluginError naming it."""
    module_name, sep, attr = reference.partition(":")
    if not sep or not module_name or not attr or ":" in attr:
        raise PluginError(f"reference {reference!r} is not of the form 'package.module:name'")
    return module_name, attr


def resolve_reference(reference: str) -> Any:
    """Import the referenced object; a dangling reference is a PluginError naming it."""
    module_name, attr = split_reference(reference)
    target = getattr(import_module(module_name), attr, None)
    if not callable(target):
        raise PluginError(f"reference {reference!r}: module {module_name} has no callable {attr}")
    return target


@dataclass(frozen=True)
class FamilyModel:
    """One model of a family: the config.json values it loads and the classes core builds it from.

    ``config``: a class with ``from_hf_config(hf_config)`` returning a frozen config whose ``dtype`` is the
    checkpoint's. ``model``: a ``Model`` subclass built as ``model(cfg, dtype=, world=, group=)``, whose
    attention modules declare their cache entries and which answers ``activation_bytes_per_token()``.
    ``renames``: ``name -> checkpoint name`` where the checkpoint's tensor names differ from the module's.
    ``drafter``: ``build_draft(ctx, model) -> Drafter | BlockDrafter | None``. ``hooks``: ``{"load_model" |
    "memory_plan": reference}`` for a release core cannot read the plain way.
    """

    claims: tuple[str, ...]
    config: str
    model: str
    renames: str | None = None
    drafter: str | None = None
    hooks: Mapping[str, str] = field(default_factory=dict)

    # the per-model hooks a family may supply itself, for what core cannot know (a release's own tensor layout)
    OWN_HOOKS: ClassVar[tuple[str, ...]] = ("load_model", "memory_plan")

    def references(self) -> list[str]:
        return [r for r in (self.config, self.model, self.renames, self.drafter, *self.hooks.values()) if r]


@runtime_checkable
class FamilyContract(Protocol):
    """What a family plugin's entry point names: one declaration (``dgpp.plugin_api.Family``) that core checks
    at registration and turns into the hooks. Its ``families()`` are the claims; ``model_entry`` finds the
    config class, model class and renames for a claimed value."""

    name: str
    plugin: str

    def families(self) -> list[FamilySpec]: ...

    def check(self) -> None: ...


@runtime_checkable
class FamilyConfig(Protocol):
    """A family's typed config class: ``from_hf_config(config.json as a dict)`` -> a frozen instance whose
    ``dtype`` is the checkpoint's (a ``ConfigError`` names any key it cannot serve)."""

    @property
    def dtype(self) -> Any: ...  # read-only: a frozen dataclass's field satisfies it

    @classmethod
    def from_hf_config(cls, hf_config: Mapping[str, Any]) -> FamilyConfig: ...
