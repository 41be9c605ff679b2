"""A random-weight checkpoint of a real geometry, written to disk for ``dgpp bench serve``.

The tensors are transformers' names and shapes for the geometry (its model class built on the meta device), filled
with N(0, 0.02) (norm weights 1) on the device and saved as safetensors shards, so ``dgpp serve`` loads it like any
downloaded checkpoint. The tokenizer is a word-level one over the model's whole vocabulary (``t0`` .. ``tN``): a
prompt of ``n`` words is exactly ``n`` tokens, and every generated id decodes to visible text, so each streamed
token arrives as its own event (what inter-token latency needs).

``quant`` (a ``dgpp bench --quant`` format name) writes the checkpoint in that release's own layout: the
``quantization_config`` a shipped checkpoint carries, and every decoder-layer linear encoded on the device as it is
drawn (``<module>.weight`` codes plus its scale tensors, the names the format's releases use), so ``dgpp serve``
loads and serves it packed, as users meet it.
"""

from __future__ import annotations

import json
import re
from pathlib import Path
from typing import Any

import torch

from dgpp.bench.models import hf_config

SHARD_BYTES = 4 << 30
EOS = "<eos>"


def write_checkpoint(
    geometry: str, out_dir: Path, device: str, dtype: torch.dtype, seed: int = 0, quant: str = ""
) -> Path:
    """Write config, weights and tokenizer of ``geometry`` into ``out_dir`` (kept when already complete);
    ``quant``: a format of ``dgpp.bench.quantize.QUANT_CONFIGS``, its decoder-layer linears packed."""
    from dgpp.bench.quantize import QUANT_CONFIGS
    from dgpp.errors import ConfigError
    from dgpp.quant.scheme import KEY, QuantScheme

    config = hf_config(geometry, dtype)
    scheme = None
    if quant:
        if quant not in QUANT_CONFIGS:
            raise ConfigError(
                f"--quant: unknown format {quant!r} for a served checkpoint; known: {', '.join(QUANT_CONFIGS)}"
            )
        _refuse_packed_moe(config, quant)
        config[KEY] = QUANT_CONFIGS[quant]
        scheme = QuantScheme.from_hf_config(config)
    out_dir.mkdir(parents=True, exist_ok=True)
    done = out_dir / ".complete"
    if done.is_file():
        return out_dir
    (out_dir / "config.json").write_text(json.dumps(config, indent=1))
    (out_dir / "generation_config.json").write_text(json.dumps({"do_sample": False, "eos_token_id": 0}))
    _write_weights(config, out_dir, device, dtype, seed, scheme)
    write_word_tokenizer(out_dir, int(config["vocab_size"]))
    done.write_text("ok")
    return out_dir


def _refuse_packed_moe(config: dict[str, Any], quant: str) -> None:
    """Experts are written as transformers holds them (stacked) and every 2-D decoder tensor packed, routers
    included: no release's layout, so an MoE geometry is refused by name."""
    from dgpp.bench.models import new_model
    from dgpp.errors import ConfigError
    from dgpp.nn.moe import FusedExperts

    if any(isinstance(m, FusedExperts) for m in new_model(config, "meta").modules()):
        raise ConfigError(
            f"--quant {quant}: dgpp bench serve writes packed checkpoints of dense geometries only (an MoE "
            "geometry's experts and routers are not written in a release's layout); measure packed MoE "
            "geometries with the in-process sweep, dgpp bench --quant"
        )


DECODER_LINEAR = re.compile(
    r".*\.layers\.\d+\..*"
)  # what a release packs: decoder-layer linears, never embeddings


def _stored(name: str, t: torch.Tensor, scheme: Any) -> dict[str, torch.Tensor]:
    """The checkpoint tensors of parameter ``name``: itself, or its packed encoding where ``scheme`` packs its module."""
    module = name[: -len(".weight")] if name.endswith(".weight") else None
    fmt = (
        scheme.format_for(module)
        if scheme and module and t.dim() == 2 and DECODER_LINEAR.fullmatch(module)
        else None
    )
    if fmt is None:
        return {name: t}
    from dgpp.quant.encode import encode

    return {f"{module}.{suffix}": packed for suffix, packed in encode(fmt, t.float()).items()}


def _write_weights(
    config: dict[str, Any], out_dir: Path, device: str, dtype: torch.dtype, seed: int, scheme: Any = None
) -> None:
    from safetensors.torch import save_file
    from transformers import AutoConfig, AutoModelForCausalLM

    plain = {k: v for k, v in config.items() if k not in ("model_type", "quantization_config")}  # shapes only
    hf = AutoConfig.for_model(config["model_type"], **plain)
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
        for stored_name, stored in _stored(name, t, scheme).items():
            shard[stored_name] = stored.cpu()
            size += stored.numel() * stored.element_size()
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
