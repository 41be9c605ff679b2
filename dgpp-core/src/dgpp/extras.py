"""Optional dependencies, installed as extras of dgpp-core; a missing one is one line naming the extra.

| extra | installs | needed for |
|---|---|---|
| ``demo`` | transformers, gguf | building the CPU demo checkpoints (``dgpp serve demo_cpu``) |
| ``gpu`` | triton | the Triton kernels (without it every op runs its torch reference) |
| ``fabric`` | pyverbs | the RDMA fabric preflight of multi-node worlds (``dgpp check`` lists the lanes) |
"""

from __future__ import annotations

from importlib.util import find_spec

from dgpp.errors import DgppError


class MissingExtraError(DgppError):
    """An optional dependency is not installed; the message names the extra that installs it."""


def install_hint(module: str, extra: str) -> str:
    return f"{module} is not installed: pip install 'dgpp-core[{extra}]'"


def require_extra(module: str, extra: str, purpose: str) -> None:
    """Raise MissingExtraError (one line: what needs it and the pip command) when ``module`` is absent."""
    if find_spec(module) is None:
        raise MissingExtraError(
            f"{purpose} needs {module}, which is not installed: pip install 'dgpp-core[{extra}]'"
        )
