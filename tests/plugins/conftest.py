"""Family tests import the end-to-end helpers (``tests/e2e``: ``served_greedy``, ``serve_fixture``) as plain
modules."""

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "e2e"))
