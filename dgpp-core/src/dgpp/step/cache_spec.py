"""What each layer of a model needs the engine to hold for it (``Model.cache_spec()``)."""

from __future__ import annotations

from dataclasses import dataclass, field, replace

import torch

from dgpp.errors import ConfigError

# ``engine.kv_dtype: fp8``: K/V rows stored as e4m3 codes with one fp32 scale per row (one token's one KV head),
# ``scale = amax(row) / 448``; the attention that reads them dequantizes ``code * scale`` to the compute dtype
KV_FP8 = torch.float8_e4m3fn
SCALE_BYTES = 4  # one fp32 scale per K row and per V row
FP4_BLOCK = 16  # fp4 latent values per e4m3 block scale
QUANTIZED_LATENT = ("fp8", "fp4")  # engine.kv_dtype values that quantize an MLA latent cache


@dataclass(frozen=True)
class PagedKV:
    """Paged K/V rows for one attention layer: per token ``num_kv_heads × head_dim`` (V may differ)."""

    num_kv_heads: int
    head_dim: int
    dtype: torch.dtype
    v_head_dim: int | None = None
    fp8_rows: bool = False  # the attention reading this entry takes e4m3 rows and their scales (kv_dtype fp8)
    # DSA index keys: stored as e4m3 rows under either quantized kv_dtype (fp8 or fp4), as the original engine
    # keeps its index cache in fp8 whatever the latent format
    index_keys: bool = False

    @property
    def v_dim(self) -> int:
        return self.head_dim if self.v_head_dim is None else self.v_head_dim

    @property
    def row_scaled(self) -> bool:
        """Stored as codes with a per-row fp32 scale (``engine.kv_dtype: fp8`` / ``fp4``)."""
        return self.dtype == KV_FP8

    @property
    def k_storage(self) -> tuple[int, torch.dtype]:
        """(width, dtype) of the pool's first tensor (K, or the latent), per token and head."""
        return self.head_dim, self.dtype

    @property
    def v_scaled(self) -> bool:
        """The second tensor (V) has row scales too (a K-only entry has none)."""
        return self.row_scaled and self.v_dim > 0

    def bytes_per_token(self) -> int:
        k_width, k_dtype = self.k_storage
        k_bytes = k_width * torch.empty((), dtype=k_dtype).element_size()
        v_bytes = self.v_dim * torch.empty((), dtype=self.dtype).element_size()
        scales = (int(self.row_scaled) + int(self.v_scaled)) * SCALE_BYTES
        return self.num_kv_heads * (k_bytes + v_bytes + scales)

    def rows_per_block(self, block_size: int) -> int:
        """Rows one pool block holds: one per token."""
        return block_size


def fp4_row_bytes(latent_dim: int) -> int:
    """Bytes of one fp4 latent row (``dgpp.kernels.latent_formats``): ``L/2`` bytes of e2m1 codes and ``L/16``
    e4m3 block scales, padded to 16 bytes (288 at ``L`` 512)."""
    return -(-(latent_dim // 2 + latent_dim // FP4_BLOCK) // 16) * 16


@dataclass(frozen=True)
class LatentKV(PagedKV):
    """Paged multi-head latent attention (MLA) rows for one layer: per token the normed latent
    (``kv_lora_rank``) and the rotated shared rope key (``qk_rope_head_dim``), not the per-head K/V they
    expand to. Stored as a one-head paged pair, so block tables, prefix sharing and the memory plan treat
    it like any paged K/V: ``kv[name] = (latent [blocks, block_size, 1, latent_dim], k_rot [.., rope_dim])``.

    ``latent_format`` (``engine.kv_dtype``): ``auto`` keeps the latent in ``dtype``; ``fp8`` stores it as e4m3
    codes, ``fp4`` as packed rows of ``fp4_row_bytes`` bytes (``dgpp.kernels.latent_formats``), each with one fp32
    row scale in ``kv_scales[name][0]`` (``[.., 1, 1]``; the second scale tensor is empty). ``k_rot`` stays in
    ``dtype`` under every format."""

    latent_format: str = "auto"

    @classmethod
    def of(cls, latent_dim: int, rope_dim: int, dtype: torch.dtype) -> LatentKV:
        return cls(num_kv_heads=1, head_dim=latent_dim, dtype=dtype, v_head_dim=rope_dim)

    @property
    def latent_dim(self) -> int:
        return self.head_dim

    @property
    def rope_dim(self) -> int:
        return self.v_dim

    @property
    def row_scaled(self) -> bool:
        return self.latent_format in QUANTIZED_LATENT

    @property
    def v_scaled(self) -> bool:
        return False

    @property
    def k_storage(self) -> tuple[int, torch.dtype]:
        if self.latent_format == "fp8":
            return self.latent_dim, KV_FP8
        if self.latent_format == "fp4":
            return fp4_row_bytes(self.latent_dim), torch.uint8
        return self.latent_dim, self.dtype


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


ACCOUNTED_BLOCK_SIZE = 16  # the engine's default engine.block_size, which CompressedKV's plan counts with


@dataclass(frozen=True)
class CompressedKV(PagedKV):
    """Compressed K/V entries of one layer (DeepSeek-V4's CSA / HCA): one entry per ``ratio`` tokens, pooled from
    that window's rows once the window is complete. Entries live in the paged pool beside the tokens they
    summarise: entry ``w`` covers positions ``w·ratio .. w·ratio + ratio - 1`` and sits in the block of the
    window's LAST token, so it is written in the step that writes that block, and a block shared by the prefix
    cache already holds every entry it ever will. A block holds ``block_size // ratio`` entries (one when the
    ratio is larger than a block; the block size and the ratio must divide one another). No V (``v_head_dim``
    0): the entry is both key and value. Build with ``CompressedKV.of(ratio, head_dim, dtype)``."""

    ratio: int = 1

    @classmethod
    def of(cls, ratio: int, head_dim: int, dtype: torch.dtype) -> CompressedKV:
        return cls(num_kv_heads=1, head_dim=head_dim, dtype=dtype, v_head_dim=0, ratio=ratio)

    def rows_per_block(self, block_size: int) -> int:
        if block_size % self.ratio and self.ratio % block_size:
            raise ValueError(
                f"block_size {block_size} and compression ratio {self.ratio} must divide one another"
            )
        return max(1, block_size // self.ratio)

    def bytes_per_token(self) -> int:
        """Pool bytes per token at the engine's default 16-token blocks: an entry per ``ratio`` tokens, but at
        least one per block (ratio 128: an entry per 16 tokens' room). Larger blocks need less."""
        itemsize = torch.empty((), dtype=self.dtype).element_size()
        entry = self.head_dim * itemsize + (SCALE_BYTES if self.row_scaled else 0)
        return -(-entry // min(self.ratio, ACCOUNTED_BLOCK_SIZE))


@dataclass(frozen=True)
class WindowBuffer(StateSpec):
    """The rows a compressor has not pooled yet, per request: a ring of the last ``rows`` positions' projected
    K/V and gate logits (position ``j`` at index ``j % rows``), ``width`` wide each. ``rows`` is the ratio for
    non-overlapping windows (HCA) and twice it for overlapping ones (CSA: entry ``w`` pools window ``w - 1``'s
    first half-width with window ``w``'s second). Being state, it is snapshotted with the request, which keeps
    chunked prefill and the prefix cache exact.

    Build with keywords: ``WindowBuffer(rows=8, width=1024, dtype=torch.bfloat16)``."""

    rows: int = 0
    width: int = 0
    dtype: torch.dtype = torch.bfloat16

    def __post_init__(self) -> None:
        if self.rows < 1 or self.width < 1:
            raise ValueError(f"a window buffer needs rows and width >= 1, got {self.rows} x {self.width}")
        shape = (self.rows, self.width)
        object.__setattr__(self, "tensors", {"kv": (shape, self.dtype), "gate": (shape, self.dtype)})


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
    fp8_rows: bool = False  # the attention reading this ring takes e4m3 rows and their scales (kv_dtype fp8)

    def __post_init__(self) -> None:
        if self.window < 2:
            raise ValueError(f"a sliding window must cover at least 2 tokens, got {self.window}")
        v_dim = self.head_dim if self.v_head_dim is None else self.v_head_dim
        ring = self.window - 1
        tensors = {
            "k": ((ring, self.num_kv_heads, self.head_dim), self.dtype),
            "v": ((ring, self.num_kv_heads, v_dim), self.dtype),
        }
        if self.dtype == KV_FP8:  # one fp32 scale per ring row and head, beside its codes
            tensors["k_scale"] = ((ring, self.num_kv_heads, 1), torch.float32)
            tensors["v_scale"] = ((ring, self.num_kv_heads, 1), torch.float32)
        object.__setattr__(self, "tensors", tensors)


def stored_as(spec: dict[str, CacheSpec], kv_dtype: str) -> dict[str, CacheSpec]:
    """The cache entries as the engine stores them under ``engine.kv_dtype``. ``fp8``: every grouped-query, window
    and sink K/V entry (paged or ring) becomes e4m3 rows with per-row scales, an MLA latent e4m3 rows with a row
    scale (``LatentKV.latent_format``), DSA index keys e4m3 rows. ``fp4``: MLA latents become packed fp4 rows and
    DSA index keys e4m3 rows. Raises ``ConfigError`` when an entry's attention does not read that form, so the
    lever never silently leaves part of the cache as it was."""
    if kv_dtype not in QUANTIZED_LATENT:
        return spec
    stored = {name: _stored(s, kv_dtype) for name, s in spec.items()}
    unread = [name for name, s in stored.items() if s is None]
    if unread:
        shown = ", ".join(f"{name} ({type(spec[name]).__name__})" for name in unread[:3])
        more = f" and {len(unread) - 3} more" if len(unread) > 3 else ""
        if kv_dtype == "fp8":
            raise ConfigError(
                "engine.kv_dtype: 'fp8' stores grouped-query, sliding-window and sink attention K/V, MLA latents and "
                f'DSA index keys; this model\'s cache entries {shown}{more} are read in the compute dtype only; use "auto"'
            )
        other = ' or "fp8"' if all(_stored(spec[n], "fp8") for n in unread) else ""
        raise ConfigError(
            "engine.kv_dtype: 'fp4' stores MLA latents (and DSA index keys as e4m3 rows); this model's cache "
            f'entries {shown}{more} have no fp4 form; use "auto"{other}'
        )
    return {name: s for name, s in stored.items() if s is not None}


def _stored(s: CacheSpec, kv_dtype: str) -> CacheSpec | None:
    """Entry ``s`` under quantized ``kv_dtype``; None when its attention does not read that form."""
    if isinstance(s, LatentKV):
        if kv_dtype == "fp4" and s.latent_dim % FP4_BLOCK:
            raise ConfigError(
                f"engine.kv_dtype: 'fp4' packs latents in blocks of {FP4_BLOCK}; this model's latent width "
                f'{s.latent_dim} is not a multiple of it; use "fp8" or "auto"'
            )
        return replace(s, latent_format=kv_dtype)
    if isinstance(s, PagedKV):
        readable = s.fp8_rows and (kv_dtype == "fp8" or s.index_keys)
        return s if s.dtype == KV_FP8 else replace(s, dtype=KV_FP8) if readable else None
    if isinstance(s, WindowKV):
        readable = s.fp8_rows and kv_dtype == "fp8"
        return s if s.dtype == KV_FP8 else replace(s, dtype=KV_FP8) if readable else None
    return s
