"""Test-wide setup: the Triton interpreter on CPU (set before any kernel is defined)."""

import os

os.environ.setdefault("TRITON_INTERPRET", "1")
