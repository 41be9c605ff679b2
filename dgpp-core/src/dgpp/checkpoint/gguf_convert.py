"""A GGUF file as an HF-layout checkpoint directory, converted once and cached.

A template's ``model`` may name a ``.gguf`` file or a directory holding one (and no config.json). dgpp
then writes, under ``$DGPP_GGUF_DIR`` (default ``~/.cache/dgpp/gguf/``), a directory with config.json,
tokenizer.json, tokenizer_config.json (with the file's chat template), generation_config.json and
model.safetensors (the decoded weights: float tensors as stored, block quants as exact fp32), keyed by
the file's path, size and modification time. Every family, the memory plan and the tokenizer then read
it like any other checkpoint; a second start reuses it. Beside them, ``gguf/blocks.safetensors`` keeps the
block-quant tensors' raw blocks as shipped (uint8 ``[rows, bytes]`` under the HF name, the ggml type in the
file's metadata) for ``engine.gguf_weights: int4pack`` (``dgpp.checkpoint.gguf_packed``); the checkpoint
reader does not look into subdirectories.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import tempfile
from pathlib import Path

from dgpp.errors import CheckpointError

CONVERTER_VERSION = 2  # bump when the converted layout changes, so stale caches are rebuilt


BLOCKS_FILE = Path("gguf") / "blocks.safetensors"  # relative to a converted checkpoint directory


def gguf_cache_dir() -> Path:
    return Path(os.environ.get("DGPP_GGUF_DIR") or "~/.cache/dgpp/gguf").expanduser()


def find_gguf(path: Path) -> Path | None:
    """The GGUF file ``path`` names: the file itself, or the only ``*.gguf`` of a directory without config.json."""
    if path.is_file() and path.suffix == ".gguf":
        return path
    if not path.is_dir() or (path / "config.json").is_file():
        return None
    files = sorted(path.glob("*.gguf"))
    if len(files) > 1:
        raise CheckpointError(
            f"checkpoint directory {path} holds {len(files)} GGUF files ({', '.join(f.name for f in files)}); "
            "set model to one of them"
        )
    return files[0] if files else None


def _key(path: Path) -> str:
    stat = path.stat()
    text = f"{path.resolve()}|{stat.st_size}|{stat.st_mtime_ns}|{CONVERTER_VERSION}"
    return hashlib.sha256(text.encode()).hexdigest()[:16]


def write_converted(gguf_path: Path, out: Path) -> None:
    """Write the HF-layout checkpoint of ``gguf_path`` into directory ``out``."""
    from safetensors.torch import save_file

    from dgpp.checkpoint.gguf_arch import architecture, hf_blocks, hf_tensors
    from dgpp.checkpoint.gguf_file import GGUFFile
    from dgpp.checkpoint.gguf_tokenizer import build_tokenizer, tokenizer_configs

    gguf = GGUFFile(gguf_path)
    arch = architecture(gguf)
    config = arch.hf_config(gguf, len(gguf.get("tokenizer.ggml.tokens") or ()))
    tokenizer = build_tokenizer(gguf)
    tokenizer_config, generation = tokenizer_configs(gguf)
    config.update(generation)
    tensors = dict(hf_tensors(gguf, arch, config))
    save_file(tensors, str(out / "model.safetensors"), metadata={"format": "pt", "source": gguf_path.name})
    blocks, types = {}, {}
    for name, type_name, rows in hf_blocks(gguf, arch, config):
        blocks[name], types[name] = rows.contiguous(), type_name
    if blocks:
        (out / BLOCKS_FILE).parent.mkdir()
        save_file(
            blocks,
            str(out / BLOCKS_FILE),
            metadata={"source": gguf_path.name, "ggml_types": json.dumps(types)},
        )
    tokenizer.save(str(out / "tokenizer.json"))
    (out / "tokenizer_config.json").write_text(json.dumps(tokenizer_config, indent=2))
    (out / "generation_config.json").write_text(json.dumps(generation, indent=2))
    (out / "config.json").write_text(json.dumps(config, indent=2))  # last: its presence marks a complete dir


def ensure_converted(gguf_path: Path) -> Path:
    """The converted checkpoint directory of ``gguf_path``, converting on first use (safe under concurrency)."""
    final = gguf_cache_dir() / f"{gguf_path.stem}-{_key(gguf_path)}"
    if (final / "config.json").is_file():
        return final
    final.parent.mkdir(parents=True, exist_ok=True)
    from dgpp.log import get_logger

    get_logger("dgpp.gguf").info("converting GGUF checkpoint", file=str(gguf_path), to=str(final))
    tmp = Path(tempfile.mkdtemp(prefix=f".{gguf_path.stem}-", dir=final.parent))
    try:
        write_converted(gguf_path, tmp)
        tmp.chmod(0o755)
        try:
            tmp.rename(final)  # atomic: a reader sees no directory or a complete one
        except OSError:
            if not (final / "config.json").is_file():
                raise
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return final
