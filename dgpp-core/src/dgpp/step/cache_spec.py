"""What each layer of a model needs the engine to hold for it (``Model.cache_spec()``)."""

from __future__ import annotations

from dataclasses import dataclass, field

import torch


@dataclass(frozen=True)
class PagedKV:
    """Paged K/V rows for one attention layer: per token ``num_kv_heads × head_dim`` (V may differ)."""

    num_kv_heads: int
    head_dim: int
    dtype: torch.dtype
    v_head_dim: int | None = None

    @property
    def v_dim(self) -> int:
        return self.head_dim if self.v_head_dim is None else self.v_head_dim

    def bytes_per_token(self) -> int:
        itemsize = torch.empty((), dtype=self.dtype).element_size()
        return self.num_kv_heads * (self.head_dim + self.v_dim) * itemsize


@dataclass(frozen=True)
class LatentKV(PagedKV):
    """Paged multi-head latent attention (MLA) rows for one layer: per token the normed latent
    (``kv_lora_rank``) and the rotated shared rope key (``qk_rope_head_dim``), not the per-head K/V they
    expand to. Stored as a one-head paged pair, so block tables, prefix sharing and the memory plan treat
    it like any paged K/V: ``kv[name] = (latent [blocks, block_size, 1, latent_dim], k_rot [.., rope_dim])``."""

    @classmethod
    def of(cls, latent_dim: int, rope_dim: int, dtype: torch.dtype) -> LatentKV:
        return cls(num_kv_heads=1, head_dim=latent_dim, dtype=dtype, v_head_dim=rope_dim)

    @property
    def latent_dim(self) -> int:
        return self.head_dim

    @property
    def rope_dim(self) -> int:
        return self.v_dim


@dataclass(frozen=True)
class StateSpec:
    """Fixed-size per-request state for one layer (recurrent / conv / ring): ``name -> (shape, dtype)``."""

    tensors: dict[str, tuple[tuple[int, ...], torch.dtype]] = field(default_factory=dict)

    def bytes_per_request(self) -> int:
        total = 0
        for shape, dtype in self.tensors.values():
            n = 1
            for d in shape:
                n *= d
            total += n * torch.empty((), dtype=dtype).element_size()
        return total


CacheSpec = PagedKV | StateSpec


@dataclass(frozen=True)
class WindowKV(StateSpec):
    """K/V of a sliding-window attention layer, bounded by the window: a per-request ring of the last
    ``window - 1`` positions (position ``j`` at index ``j % (window - 1)``), held in the state pool. A row at
    position ``p`` sees keys ``p - window + 1 .. p``: the ring holds every earlier one it can see, and the
    step's own rows come from the step itself (``dgpp.nn.sliding_attention``). Being state, the ring is
    snapshotted with the rest of a request's state, which keeps the prefix cache exact.

    Build with keywords: ``WindowKV(num_kv_heads=4, head_dim=128, dtype=torch.bfloat16, window=513)``."""

    num_kv_heads: int = 0
    head_dim: int = 0
    dtype: torch.dtype = torch.bfloat16
    window: int = 0
    v_head_dim: int | None = None

    def __post_init__(self) -> None:
        if self.window < 2:
            raise ValueError(f"a sliding window must cover at least 2 tokens, got {self.window}")
        v_dim = self.head_dim if self.v_head_dim is None else self.v_head_dim
        ring = self.window - 1
        object.__setattr__(self, "tensors", {
            "k": ((ring, self.num_kv_heads, self.head_dim), self.dtype),
            "v": ((ring, self.num_kv_heads, v_dim), self.dtype),
        })
