"""Decode benchmark on a CUDA machine: a thin entry to ``dgpp bench`` (see dgpp/bench/cli.py for the flags)."""

from __future__ import annotations

import sys

from dgpp.bench.cli import main

if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
