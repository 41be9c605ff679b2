"""Where a template's ``model`` lives on disk: a local directory, a GGUF file (converted once, see
``gguf_convert``), the CPU demo, or the HF cache (offline).

dgpp never downloads. An HF id ``ORG/NAME`` is looked up in the Hugging Face cache layout
(``<hub>/models--ORG--NAME/snapshots/<rev>``, ``rev`` from ``refs/main`` when present), where
``<hub>`` is ``HF_HUB_CACHE``, else ``HF_HOME/hub``, else ``~/.cache/huggingface/hub``. A miss names
every place that was looked at.
"""

from __future__ import annotations

import os
import re
from pathlib import Path

from dgpp.errors import CheckpointError
from dgpp.handoff import demo_builder

DEMO_ORG = "dgpp-demo"  # ids under this org are generated locally by dgpp.demo, never looked up
_HF_ID = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._-]*/[A-Za-z0-9][A-Za-z0-9._-]*$")


def _demo_checkpoint(model: str) -> Path:
    """A demo id through the builder the entry point handed in (``dgpp.demo`` is in a layer above this one)."""
    builder = demo_builder()
    if builder is None:
        raise CheckpointError(
            f"model {model!r} is a demo checkpoint, built on first use by dgpp's entry points (dgpp serve, "
            f"dgpp check, dgpp bench, python -m dgpp.demo); this program did not enable them: call "
            f"dgpp.demo.enable_demo_checkpoints() before resolving it"
        )
    return builder(model)


def hf_hub_dir() -> tuple[Path, str]:
    """The HF hub cache directory and the setting that chose it (for messages)."""
    if os.environ.get("HF_HUB_CACHE"):
        return Path(os.environ["HF_HUB_CACHE"]).expanduser(), "HF_HUB_CACHE"
    if os.environ.get("HF_HOME"):
        return Path(os.environ["HF_HOME"]).expanduser() / "hub", "HF_HOME/hub"
    return Path("~/.cache/huggingface/hub").expanduser(), "default HF cache"


def _checked_dir(path: Path, what: str) -> Path:
    if not (path / "config.json").is_file():
        raise CheckpointError(
            f"{what} {path} has no config.json (not a checkpoint, or an incomplete download)"
        )
    return path.resolve()


def _snapshot(repo_dir: Path, model: str) -> Path:
    snapshots = repo_dir / "snapshots"
    ref = repo_dir / "refs" / "main"
    if ref.is_file():
        rev = ref.read_text(encoding="utf-8").strip()
        if (snapshots / rev).is_dir():
            return snapshots / rev
        raise CheckpointError(
            f"checkpoint {model!r}: {ref} names revision {rev} but {snapshots / rev} is missing"
        )
    revs = sorted(p for p in snapshots.iterdir() if p.is_dir()) if snapshots.is_dir() else []
    if len(revs) == 1:
        return revs[0]
    if not revs:
        raise CheckpointError(f"checkpoint {model!r}: {snapshots} holds no snapshot")
    raise CheckpointError(
        f"checkpoint {model!r}: {snapshots} holds {len(revs)} snapshots and no refs/main; "
        f"set model to one snapshot directory ({', '.join(p.name for p in revs)})"
    )


def resolve_checkpoint(model: str) -> Path:
    """The checkpoint directory for a template's ``model`` value (raises CheckpointError naming where it looked).

    A relative local path is relative to the current directory.
    """
    from dgpp.checkpoint.gguf_convert import ensure_converted, find_gguf

    if model.startswith(DEMO_ORG + "/"):
        local = _demo_checkpoint(model)
    else:
        local = Path(model).expanduser()
    gguf_file = find_gguf(local)
    if gguf_file is not None:
        return ensure_converted(gguf_file)
    if local.is_dir():
        return _checked_dir(local, "checkpoint directory")
    looked = [f"local directory {local.absolute()}"]
    if model.startswith(("/", ".", "~")) or not _HF_ID.match(model):
        raise CheckpointError(f"checkpoint {model!r} not found: looked for {' and '.join(looked)}")
    hub, setting = hf_hub_dir()
    org, name = model.split("/")
    repo_dir = hub / f"models--{org}--{name}"
    if not repo_dir.is_dir():
        looked.append(f"HF cache {repo_dir} ({setting})")
        raise CheckpointError(
            f"checkpoint {model!r} not found: looked for {' and '.join(looked)}; "
            f"dgpp does not download: fetch it first (e.g. `hf download {model}`) or point HF_HUB_CACHE at its cache"
        )
    return _checked_dir(_snapshot(repo_dir, model), f"checkpoint {model!r} snapshot")
