"""Which tree a measurement ran: the commit the bench prints in its header."""

from __future__ import annotations

import os
import subprocess


def tree_commit() -> str:
    """``$DGPP_COMMIT`` when set (a copy of the tree whose ``.git`` lags the working files, as on a lent GPU host,
    is told its commit by whoever sent it), else ``git rev-parse --short HEAD`` here, else ``unknown``."""
    named = os.environ.get("DGPP_COMMIT", "").strip()
    if named:
        return named
    found = subprocess.run(
        ["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True, check=False
    ).stdout.strip()
    return found or "unknown"
