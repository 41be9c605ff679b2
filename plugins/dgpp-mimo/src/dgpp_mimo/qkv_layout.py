"""The fused, pre-sharded ``self_attn.qkv_proj`` of MiMo-V2.6, split into transformers' ``q_proj`` / ``k_proj`` /
``v_proj`` without touching a code.

The release stores one FP8 E4M3 matrix per layer, in ``C`` chunks of equal height (``C`` = the global layers'
KV head count, 4 at release size: the chunks are what each of 4 tensor-parallel ranks would hold). Chunk ``c``
is ``[Q heads of chunk c | K heads of chunk c | V heads of chunk c]`` (each head ``head_dim`` rows, V heads
``v_head_dim``), and each chunk has its own block-scale grid: ``ceil(rows_per_chunk / 128)`` scale rows, so a
128-row scale block never spans two chunks, but inside a chunk one block may cover the end of K and the start
of V. Splitting therefore keeps every code byte and gives each projection a finer row block: the gcd of 128
and where its rows start and end inside a chunk (at release size Q keeps 128; K and V get 64 on the global
layers, whose one KV head a chunk ends mid-block, and keep 128 on the sliding ones), each fine block taking the
scale of the shipped block it lies in. ``FP8Block`` with that block decodes every weight to exactly the
value the fused matrix decodes to.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from dgpp.plugin_api import CheckpointError, ConfigError
from dgpp.quant.format import cdiv

PARTS = ("q_proj", "k_proj", "v_proj")


@dataclass(frozen=True)
class FusedQKV:
    """One layer's fused projection: ``chunks`` chunks of ``q_rows + k_rows + v_rows`` rows each; ``block`` is
    the shipped FP8 (rows, cols) scale tile."""

    chunks: int
    q_rows: int
    k_rows: int
    v_rows: int
    block: tuple[int, int] = (128, 128)

    @classmethod
    def of(
        cls,
        heads: int,
        kv_heads: int,
        head_dim: int,
        v_head_dim: int,
        chunks: int,
        block: tuple[int, int] = (128, 128),
    ) -> FusedQKV:
        for name, count in (("num_attention_heads", heads), ("KV heads", kv_heads)):
            if count % chunks:
                raise ConfigError(
                    f"mimo_v2 config.json: {name} {count} cannot be split into the fused qkv_proj's "
                    f"{chunks} chunks (one per global KV head)"
                )
        return cls(
            chunks,
            heads // chunks * head_dim,
            kv_heads // chunks * head_dim,
            kv_heads // chunks * v_head_dim,
            (block[0], block[1]),
        )

    @property
    def rows_per_chunk(self) -> int:
        return self.q_rows + self.k_rows + self.v_rows

    @property
    def rows(self) -> int:
        return self.chunks * self.rows_per_chunk

    @property
    def scale_rows_per_chunk(self) -> int:
        return cdiv(self.rows_per_chunk, self.block[0])

    def span(self, part: str) -> tuple[int, int]:
        """(first row inside a chunk, rows per chunk) of ``part``."""
        starts = {
            "q_proj": (0, self.q_rows),
            "k_proj": (self.q_rows, self.k_rows),
            "v_proj": (self.q_rows + self.k_rows, self.v_rows),
        }
        return starts[part]

    def part_block(self, part: str) -> tuple[int, int]:
        """The FP8 scale tile of ``part`` once split: rows = gcd(block rows, its start and length in a chunk)."""
        start, length = self.span(part)
        return math.gcd(self.block[0], start, length), self.block[1]

    def part_rows(self, part: str) -> int:
        return self.chunks * self.span(part)[1]

    def split_rows(self, fused: torch.Tensor, part: str) -> torch.Tensor:
        """Rows of ``part`` from every chunk, in chunk order (codes, or a dense BF16 matrix)."""
        if fused.shape[0] != self.rows:
            raise CheckpointError(
                f"has {fused.shape[0]} rows; the config gives {self.chunks} chunks of "
                f"{self.q_rows} + {self.k_rows} + {self.v_rows} = {self.rows} rows"
            )
        start, length = self.span(part)
        chunked = fused.reshape(self.chunks, self.rows_per_chunk, *fused.shape[1:])
        return chunked[:, start : start + length].reshape(self.chunks * length, *fused.shape[1:])

    def split_scales(self, grid: torch.Tensor, part: str) -> torch.Tensor:
        """``part``'s scale grid at ``part_block`` rows: each fine block takes its shipped block's scale."""
        if grid.shape[0] != self.chunks * self.scale_rows_per_chunk:
            raise CheckpointError(
                f"has {grid.shape[0]} scale rows; {self.chunks} chunks of {self.rows_per_chunk} "
                f"rows need {self.scale_rows_per_chunk} each ({self.block[0]}-row blocks per chunk)"
            )
        start, length = self.span(part)
        fine = self.part_block(part)[0]
        # chunk-local first row of each fine block -> the shipped block (within the chunk) holding it
        shipped = (start + torch.arange(0, length, fine)) // self.block[0]
        chunked = grid.reshape(self.chunks, self.scale_rows_per_chunk, *grid.shape[1:])
        return chunked[:, shipped].reshape(self.chunks * len(shipped), *grid.shape[1:])
