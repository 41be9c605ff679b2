"""The op stream: one text line per scheduler decision, folded as it grows.

Every rank appends the same lines in the same order (``A`` admissions with their cache decision, ``K``
tokens, ``R`` retirements, ``T`` tick ends). The running FNV-1a 64 fold travels in each journal tick
so a peer notices a divergence one tick after it happens; the MD5 of the whole stream is compared
at shutdown.
"""

from __future__ import annotations

import hashlib
from pathlib import Path

_FNV_OFFSET = 0xCBF29CE484222325
_FNV_PRIME = 0x100000001B3
_MASK64 = 0xFFFFFFFFFFFFFFFF


def fnv1a64_update(h: int, data: bytes) -> int:
    """Continue an FNV-1a 64 fold over ``data`` (start from ``_FNV_OFFSET``)."""
    for byte in data:
        h = ((h ^ byte) * _FNV_PRIME) & _MASK64
    return h


class OpStream:
    """Append-only op log of one rank; ``fold`` (hex) for per-tick checks, ``full_digest`` (MD5) at the end.

    ``path`` optionally keeps the text on disk (one file per rank) for post-mortem diffs."""

    def __init__(self, path: str | Path | None = None) -> None:
        self._fold = _FNV_OFFSET
        self._md5 = hashlib.md5()
        self.lines = 0
        self._file = open(path, "w", encoding="ascii") if path else None  # noqa: SIM115 - closed in close()

    def add(self, line: str) -> None:
        data = (line + "\n").encode("ascii")
        self._fold = fnv1a64_update(self._fold, data)
        self._md5.update(data)
        self.lines += 1
        if self._file is not None:
            self._file.write(line + "\n")

    @property
    def fold(self) -> str:
        return f"{self._fold:016x}"

    def full_digest(self) -> str:
        return self._md5.hexdigest()

    def close(self) -> None:
        if self._file is not None:
            self._file.close()
            self._file = None
