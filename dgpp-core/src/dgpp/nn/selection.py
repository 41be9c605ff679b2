"""Which cached tokens each query row attends to (a DSA selection), in the two forms the layers pass along.

- ``Selection``: per row the ascending positions it attends, or None for every visible position (the torch
  path, built row by row from host-side lengths);
- ``DeviceSelection``: every row's picks as device tensors (the CUDA path), ``positions [R, k]`` int32 ascending
  with the first ``counts[r]`` real; a row with at most ``k`` visible tokens lists them all (its dense row),
  and ``sparse`` marks the rows with more, decided from each row's own length on the device. Its
  shapes depend only on the step's table, so a decode step that builds one can be captured in a CUDA graph.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

Selection = list[torch.Tensor | None]


@dataclass(frozen=True)
class DeviceSelection:
    positions: torch.Tensor
    counts: torch.Tensor
    sparse: torch.Tensor | None = None  # [R] int32: 1 where a row has more than k tokens (None: every row)

    def as_rows(self) -> Selection:
        """The per-row form (reads the counts back: reference paths only); a row not ``sparse`` is None (dense)."""
        sparse = [1] * self.counts.shape[0] if self.sparse is None else self.sparse.tolist()
        return [
            self.positions[r, :n].long() if s else None
            for r, (n, s) in enumerate(zip(self.counts.tolist(), sparse, strict=True))
        ]
