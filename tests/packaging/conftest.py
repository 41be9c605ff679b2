"""The distributions built once per test session (sdists, and wheels built from them), shared by the
packaging tests."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

# build_dists and the e2e server helper (serve_fixture), imported by name from the test modules
sys.path[:0] = [str(Path(__file__).parent), str(Path(__file__).parents[1] / "e2e")]

from build_dists import build_all  # noqa: E402


@pytest.fixture(scope="session")
def built_dists(tmp_path_factory):
    out = tmp_path_factory.mktemp("dists")
    results = build_all(out)
    failed = [r for r in results if r.returncode != 0]
    assert not failed, "\n".join(r.stdout[-2000:] + r.stderr[-2000:] for r in failed)
    return out
