"""Make the dist test helpers importable as plain modules (spawned ranks import them by name)."""

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent))
