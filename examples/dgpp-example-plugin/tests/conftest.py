"""Test setup for this plugin's tests, wherever they run: Triton kernels under the CPU interpreter, no Hugging
Face Hub access (the checkpoints are built locally), one intra-op thread (tiny models issue thousands of
microsecond-sized ops, which thread hand-offs would dominate), and the interpreter's fixed-order dot products."""

from __future__ import annotations

import os

os.environ.setdefault("TRITON_INTERPRET", "1")
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("OMP_NUM_THREADS", "1")

from dgpp.testing.interpreter import use_fixed_order_dot  # noqa: E402

use_fixed_order_dot()
