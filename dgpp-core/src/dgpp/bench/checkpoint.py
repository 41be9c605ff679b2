"""A random-weight checkpoint of a real geometry, written to disk for ``dgpp bench serve``.

The tensors are transformers' names and shapes for the geometry (its model class built on the meta device), filled
with N(0, 0.02) (norm weights 1) on the device and saved as safetensors shards, so ``dgpp serve`` loads it like any
downloaded checkpoint. The tokenizer is a word-level one over the model's whole vocabulary (``t0`` .. ``tN``): a
prompt of ``n`` words is exactly ``n`` tokens, and every generated id decodes to visible text, so each streamed
token arrives as its own event (what inter-token latency needs).
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import torch

from dgpp.bench.models import hf_config

SHARD_BYTES = 4 << 30
EOS = "<eos>"


def write_checkpoint(geometry: str, out_dir: Path, device: str, dtype: torch.dtype, seed: int = 0) -> Path:
    """Write config, weights and tokenizer of ``geometry`` into ``out_dir`` (kept when already complete)."""
    out_dir.mkdir(parents=True, exist_ok=True)
    done = out_dir / ".complete"
    if done.is_file():
        return out_dir
    config = hf_config(geometry, dtype)
    (out_dir / "config.json").write_text(json.dumps(config, indent=1))
    (out_dir / "generation_config.json").write_text(json.dumps({"do_sample": False, "eos_token_id": 0}))
    _write_weights(config, out_dir, device, dtype, seed)
    write_word_tokenizer(out_dir, int(config["vocab_size"]))
    done.write_text("ok")
    return out_dir


def _write_weights(config: dict[str, Any], out_dir: Path, device: str, dtype: torch.dtype, seed: int) -> None:
    from safetensors.torch import save_file
    from transformers import AutoConfig, AutoModelForCausalLM

    hf = AutoConfig.for_model(config["model_type"], **{k: v for k, v in config.items() if k != "model_type"})
    with torch.device("meta"):
        shapes = [(name, p.shape) for name, p in AutoModelForCausalLM.from_config(hf).named_parameters()]
    gen = torch.Generator(device=device).manual_seed(seed)
    shard: dict[str, torch.Tensor] = {}
    size, index, weight_map = 0, 0, {}

    def flush() -> None:
        nonlocal shard, size, index
        if shard:
            name = f"model-{index:05d}.safetensors"
            save_file(shard, str(out_dir / name), metadata={"format": "pt"})
            weight_map.update(dict.fromkeys(shard, name))
            shard, size, index = {}, 0, index + 1

    for name, shape in shapes:
        if name.endswith("norm.weight"):
            t = torch.ones(shape, dtype=dtype, device=device)
        else:
            t = torch.empty(shape, dtype=dtype, device=device).normal_(0.0, 0.02, generator=gen)
        shard[name] = t.cpu()
        size += t.numel() * t.element_size()
        if size >= SHARD_BYTES:
            flush()
    flush()
    index_file = {"metadata": {}, "weight_map": weight_map}
    (out_dir / "model.safetensors.index.json").write_text(json.dumps(index_file))


def write_word_tokenizer(out_dir: Path, vocab_size: int) -> None:
    """``tokenizer.json`` + ``tokenizer_config.json``: id 0 is ``<eos>``, id ``i`` is the word ``t{i}``."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers

    vocab = {EOS: 0, **{f"t{i}": i for i in range(1, vocab_size)}}
    tok = Tokenizer(models.WordLevel(vocab, unk_token=EOS))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    tok.decoder = decoders.WordPiece(prefix="##", cleanup=False)  # joins words with spaces
    tok.add_special_tokens([EOS])
    tok.save(str(out_dir / "tokenizer.json"))
    (out_dir / "tokenizer_config.json").write_text(
        json.dumps({"eos_token": EOS, "model_max_length": 1 << 20})
    )


def word_prompt(n_tokens: int, vocab_size: int, seed: int) -> str:
    """A prompt of exactly ``n_tokens`` tokens under ``write_word_tokenizer``'s tokenizer."""
    gen = torch.Generator().manual_seed(seed)
    ids = torch.randint(1, vocab_size, (n_tokens,), generator=gen).tolist()
    return " ".join(f"t{i}" for i in ids)
