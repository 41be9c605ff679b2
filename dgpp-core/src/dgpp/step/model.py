"""The model contract: the joint every family bends at (see docs/architecture.md)."""

from __future__ import annotations

from abc import ABC, abstractmethod
from dataclasses import dataclass, field
from typing import Protocol, runtime_checkable

import torch
from torch import nn

from dgpp.step.batch import ForwardBatch
from dgpp.step.cache_spec import CacheSpec


@dataclass(frozen=True)
class ModelInfo:
    """Facts the engine needs about a loaded model, independent of its family."""

    vocab_size: int
    max_position: int
    eos_token_ids: tuple[int, ...] = ()
    bos_token_id: int | None = None
    dtype: torch.dtype = torch.float32
    hybrid: bool = False  # has per-request state (recurrent/conv): prefix cache needs snapshots
    extra: dict = field(default_factory=dict)


class Model(nn.Module, ABC):
    """A loaded model. Families subclass this; the engine only calls these methods."""

    info: ModelInfo
    #: Hidden rows of EVERY token of the last ``forward`` (``[T, hidden]``), for a drafter that reads them
    #: (MTP layers draft from the target's hidden at each position, prompt rows included, not only the
    #: sampled rows ``forward`` returns). Set by families with such a drafter, and only while ``keep_hidden``
    #: is on; which hidden (e.g. GLM's post-final-norm) is the family's convention. None otherwise.
    last_hidden: torch.Tensor | None = None
    #: Whether ``forward`` keeps ``last_hidden``. Off by default so plain serving holds no activations past a
    #: step; the speculative decoder (``engine.mtp``) turns it on for the drafter.
    keep_hidden: bool = False
    #: Whether a decode step can be captured in a CUDA graph (``engine.decode_graph``). False for a model whose
    #: decode still cuts its work from host-side lengths (a replay would reuse the capture's); its decode runs
    #: eager.
    decode_graph_safe: bool = True

    def stage_decode(self, batch: ForwardBatch) -> None:
        """Called before a decode step's forward or CUDA-graph replay (``dgpp.engine.graphs``), outside any capture:
        work whose inputs are the step's token ids and positions alone, which may read device values on the host
        (e.g. rows gathered from a host-side table into a static device buffer the forward reads). The forward
        that follows consumes what it staged. Default: nothing."""

    def keep_last_hidden(self, hidden: torch.Tensor) -> None:
        """Remember every row's hidden for a drafter when ``keep_hidden`` is on (drop the last one otherwise)."""
        self.last_hidden = hidden if self.keep_hidden else None

    def cache_spec(self) -> dict[str, CacheSpec]:
        """Per cache entry name: ``PagedKV``, ``LatentKV`` or a ``StateSpec``. The engine allocates and owns the
        memory. By default, the entries the model's modules declare (``cache_entries``)."""
        return collect_cache_entries(self, self.info.dtype)

    def activation_bytes_per_token(self) -> int:
        """Scratch bytes of one prefill row on this rank, for the memory plan of a declared family."""
        raise NotImplementedError(f"{type(self).__name__} does not say its activation bytes per prefill row")

    @abstractmethod
    def forward(self, batch: ForwardBatch) -> torch.Tensor:
        """Run one step; return hidden rows ``[len(batch.logits_indices), hidden]`` to sample from."""

    @abstractmethod
    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """Hidden rows -> logits ``[R, vocab]`` (vocab-sharded under TP; the engine gathers)."""


def collect_cache_entries(module: nn.Module, dtype: torch.dtype) -> dict[str, CacheSpec]:
    """The cache entries ``module``'s submodules declare, in module order: each module with a
    ``cache_entries(dtype)`` method answers for itself and everything under it (the name is the one the module
    reads its cache under, so nothing else has to repeat it). Two modules declaring one name is an error."""
    found: dict[str, CacheSpec] = {}

    def visit(sub: nn.Module) -> None:
        declare = getattr(sub, "cache_entries", None)
        if callable(declare):
            for name, spec in declare(dtype).items():
                if name in found:
                    raise ValueError(f"cache entry {name!r} is declared by two modules")
                found[name] = spec
            return
        for child in sub.children():
            visit(child)

    for child in module.children():
        visit(child)
    return found


@runtime_checkable
class Drafter(Protocol):
    """A speculative drafter (an MTP layer, a block drafter): what ``dgpp_build_draft`` returns and
    ``dgpp.engine.speculative`` runs. Usually an ``nn.Module``, whose ``__call__`` runs ``forward``.

    ``step`` is the draft depth being produced (0 for the first draft token); a drafter with several layers
    picks its layer from it, one with a single layer ignores it. Both calls take it, so the engine calls every
    drafter the same way.
    """

    def cache_spec(self) -> dict[str, CacheSpec]:
        """The drafter's own cache entries (paged K/V only), allocated by the engine beside the target's."""
        ...

    def __call__(self, batch: ForwardBatch, previous_hidden: torch.Tensor, step: int) -> torch.Tensor:
        """Rows of ``batch`` (tokens one position ahead of ``batch.positions``) fed the target's (or the previous
        draft's) hidden rows; returns hidden rows at ``batch.logits_indices``."""
        ...

    def compute_logits(self, hidden: torch.Tensor, step: int) -> torch.Tensor:
        """Hidden rows of draft depth ``step`` -> logits ``[R, vocab]``."""
        ...


@runtime_checkable
class BlockDrafter(Protocol):
    """A drafter that proposes a whole block of drafts in one forward (DeepSeek-V4's DSpark stages, a DFlash2
    checkpoint): what ``dgpp_build_draft`` may return instead of a ``Drafter``; ``dgpp.engine.block_draft`` runs
    it. Its context is paged K/V rows, one per position, written from the target's feature rows
    (``Model.last_hidden``, the family's features for this drafter) of every accepted input; a block at position
    ``c`` reads the context rows before ``c`` and writes nothing, so a rejected draft leaves no trace."""

    #: the most drafts one block proposes
    drafts: int

    def cache_spec(self) -> dict[str, CacheSpec]:
        """The drafter's context entries (paged K/V only), allocated by the engine beside the target's."""
        ...

    def absorb(self, batch: ForwardBatch, features: torch.Tensor) -> None:
        """Write the context rows of ``batch``'s rows (at ``batch.positions``, through ``batch.slot_mapping``) from
        the target's feature rows ``features`` of the same positions."""
        ...

    def draft(self, batch: ForwardBatch) -> tuple[torch.Tensor, torch.Tensor]:
        """One block per sequence of ``batch`` (one row each: the token fed at ``c``, the block's first position;
        the context rows before ``c`` are cached). Returns the greedy drafts for ``c + 1 .. c + drafts``
        (``[B, drafts]`` int64) and each one's confidence, the drafter's estimate that it is accepted (``[B,
        drafts]`` fp32 in ``[0, 1]``)."""
        ...
