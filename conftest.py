"""Test-wide setup for every test of the repository (``tests/`` and each family's ``plugins/dgpp-<family>/tests``):
the Triton interpreter on CPU (set before any kernel is defined), no Hub access, one intra-op thread, and the
end-to-end helpers (``tests/e2e``: ``served_greedy``, ``serve_fixture``) importable as plain modules."""

import os
import sys
from pathlib import Path

os.environ.setdefault("TRITON_INTERPRET", "1")
# tests build their checkpoints locally; nothing may reach the Hugging Face Hub (CI has no network)
os.environ.setdefault("HF_HUB_OFFLINE", "1")
# the tiny test models issue thousands of microsecond-sized ops; with 2 OpenMP threads on a shared 2-core
# box every op pays a thread hand-off, measured 15-30x slower (64 decode steps: 5.4 s vs 0.34 s)
os.environ.setdefault("OMP_NUM_THREADS", "1")


sys.path.insert(0, str(Path(__file__).resolve().parent / "tests" / "e2e"))

import pytest  # noqa: E402

from dgpp.testing.interpreter import use_fixed_order_dot  # noqa: E402

# the interpreter's BLAS dot sums a row differently by tile height on some CPUs; the GPU's MMA does not
use_fixed_order_dot()


@pytest.fixture(autouse=True)
def _engine_wide_kernel_choices():
    """Engines built by a test install their execution policy (batch invariance, the packed decode GEMV) for the
    process; later tests start from the defaults and the environment again."""
    yield
    from dgpp.policy import ExecPolicy, install, with_environment

    install(with_environment(ExecPolicy()))
