"""The tokenizer a GGUF file describes (``tokenizer.ggml.*``), rebuilt as a ``tokenizers`` byte-level BPE,
plus the tokenizer_config.json / generation_config.json values (chat template, BOS/EOS) it implies.

Supported: ``tokenizer.ggml.model = "gpt2"`` (byte-level BPE with merges) with the GPT-2 split
(``tokenizer.ggml.pre`` absent, ``default``, ``gpt2``, ``smollm``) or Llama-3's (``llama-bpe``,
``llama3``, ``llama-v3``). Tokens typed CONTROL (3) become special added tokens and USER_DEFINED (4)
plain added ones, so they are matched whole. Anything else is refused naming the key and its value.
"""

from __future__ import annotations

from typing import Any

from dgpp.checkpoint.gguf_file import GGUFFile
from dgpp.errors import CheckpointError

CONTROL, USER_DEFINED = 3, 4
# the split Llama-3's BPE was trained with (the regex is the published pre-tokenizer pattern)
_LLAMA3_SPLIT = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}"
    r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
_GPT2_PRE = (None, "default", "gpt2", "smollm")
_LLAMA3_PRE = ("llama-bpe", "llama3", "llama-v3")


def _pre_tokenizer(pre: str | None, where: str):
    from tokenizers import Regex, pre_tokenizers

    if pre in _GPT2_PRE:
        return pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    if pre in _LLAMA3_PRE:
        return pre_tokenizers.Sequence(
            [
                pre_tokenizers.Split(Regex(_LLAMA3_SPLIT), behavior="isolated"),
                pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
            ]
        )
    raise CheckpointError(
        f"{where}: tokenizer.ggml.pre {pre!r} is not supported (supported: {', '.join(str(p) for p in _GPT2_PRE + _LLAMA3_PRE)})"
    )


def build_tokenizer(gguf: GGUFFile):
    """A ``tokenizers.Tokenizer`` equal to the file's vocabulary, merges and added tokens."""
    from tokenizers import AddedToken, Tokenizer, decoders, models, processors

    kind = gguf.require("tokenizer.ggml.model")
    if kind != "gpt2":
        raise CheckpointError(
            f"{gguf.path}: tokenizer.ggml.model {kind!r} is not supported (supported: 'gpt2')"
        )
    tokens: list[str] = gguf.require("tokenizer.ggml.tokens")
    merges = [tuple(m.split(" ", 1)) for m in gguf.require("tokenizer.ggml.merges")]
    vocab = {token: i for i, token in enumerate(tokens)}
    tok = Tokenizer(models.BPE(vocab=vocab, merges=merges, fuse_unk=False, byte_fallback=False))
    tok.pre_tokenizer = _pre_tokenizer(gguf.get("tokenizer.ggml.pre"), str(gguf.path))
    tok.decoder = decoders.ByteLevel()
    types = gguf.get("tokenizer.ggml.token_type") or []
    tok.add_special_tokens(
        [
            AddedToken(t, special=True, normalized=False)
            for t, kind in zip(tokens, types, strict=False)
            if kind == CONTROL
        ]
    )
    tok.add_tokens(
        [
            AddedToken(t, special=False, normalized=False)
            for t, kind in zip(tokens, types, strict=False)
            if kind == USER_DEFINED
        ]
    )
    bos = gguf.get("tokenizer.ggml.bos_token_id")
    if gguf.get("tokenizer.ggml.add_bos_token", False) and bos is not None:
        tok.post_processor = processors.TemplateProcessing(
            single=f"{tokens[bos]} $A",
            pair=f"{tokens[bos]} $A {tokens[bos]} $B",
            special_tokens=[(tokens[bos], bos)],
        )
    else:
        tok.post_processor = processors.ByteLevel(trim_offsets=False)
    return tok


def tokenizer_configs(gguf: GGUFFile) -> tuple[dict[str, Any], dict[str, Any]]:
    """``(tokenizer_config.json, generation_config.json)`` contents: chat template and special tokens."""
    tokens: list[str] = gguf.require("tokenizer.ggml.tokens")
    ids = {name: gguf.get(f"tokenizer.ggml.{name}_token_id") for name in ("bos", "eos", "padding", "unknown")}
    tokenizer_config: dict[str, Any] = {
        "add_bos_token": bool(gguf.get("tokenizer.ggml.add_bos_token", False)),
        "add_eos_token": bool(gguf.get("tokenizer.ggml.add_eos_token", False)),
        "bos_token": tokens[ids["bos"]] if ids["bos"] is not None else None,
        "eos_token": tokens[ids["eos"]] if ids["eos"] is not None else None,
        "pad_token": tokens[ids["padding"]] if ids["padding"] is not None else None,
    }
    template = gguf.get("tokenizer.chat_template")
    if template:
        tokenizer_config["chat_template"] = template
    generation = {"bos_token_id": ids["bos"], "eos_token_id": ids["eos"]}
    return tokenizer_config, {k: v for k, v in generation.items() if v is not None}
