"""Test-wide setup: the Triton interpreter on CPU (set before any kernel is defined), and no Hub access."""

import os

os.environ.setdefault("TRITON_INTERPRET", "1")
# tests build their checkpoints locally; nothing may reach the Hugging Face Hub (CI has no network)
os.environ.setdefault("HF_HUB_OFFLINE", "1")
