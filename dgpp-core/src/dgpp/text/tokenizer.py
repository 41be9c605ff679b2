"""A checkpoint's tokenizer: ``tokenizer.json`` through the ``tokenizers`` library, special tokens and the
chat template from ``tokenizer_config.json`` (or ``chat_template.jinja``), stop ids from ``generation_config.json``."""

from __future__ import annotations

import json
from functools import cached_property
from pathlib import Path
from typing import Any

import tokenizers

from dgpp.text.errors import TokenizerError

# Texts longer than this are encoded through encode_batch, which runs without holding the GIL.
_LONG_TEXT = 32768
# The special-token names HF passes to chat templates (``special_tokens_map``), in HF's order.
SPECIAL_TOKEN_NAMES = (
    "bos_token",
    "eos_token",
    "unk_token",
    "sep_token",
    "pad_token",
    "cls_token",
    "mask_token",
)


def _byte_level_alphabet() -> dict[str, int]:
    """The GPT-2 byte-level alphabet: printable character -> the byte it stands for."""
    printable = [
        *range(ord("!"), ord("~") + 1),
        *range(ord("¡"), ord("¬") + 1),
        *range(ord("®"), ord("ÿ") + 1),
    ]
    chars = list(printable)
    extra = 0
    for byte in range(256):
        if byte not in printable:
            printable.append(byte)
            chars.append(256 + extra)
            extra += 1
    return {chr(c): b for b, c in zip(printable, chars, strict=True)}


def _token_text(value: Any) -> str | None:
    """A special token in tokenizer_config.json is a string or an AddedToken dict with ``content``."""
    if isinstance(value, dict):
        return value.get("content")
    return value if isinstance(value, str) else None


def _read_json(path: Path) -> dict:
    try:
        return json.loads(path.read_text(encoding="utf-8"))
    except json.JSONDecodeError as exc:
        raise TokenizerError(f"{path} is not valid JSON: {exc}") from exc


class Tokenizer:
    """A checkpoint's tokenizer (thread-safe for encode/decode; built once per model).

    ``vocab_size`` counts added tokens. ``eos_token_ids`` is every id that ends generation: the config's
    ``eos_token`` plus ``generation_config.json``'s ``eos_token_id`` (int or list).
    """

    def __init__(
        self,
        backend: tokenizers.Tokenizer,
        config: dict | None = None,
        generation_config: dict | None = None,
        chat_template: str | list | None = None,
        source: str = "<memory>",
    ) -> None:
        self.backend = backend
        self.config = dict(config or {})
        self.source = source
        self.chat_template = chat_template if chat_template is not None else self.config.get("chat_template")
        self._add_missing_added_tokens()
        self.special_tokens_map: dict[str, str] = {}
        for name in SPECIAL_TOKEN_NAMES:
            text = _token_text(self.config.get(name))
            if text is not None:
                self.special_tokens_map[name] = text
        eos_ids = set()
        eos_text = self.special_tokens_map.get("eos_token")
        if eos_text is not None:
            eos_ids.add(self._required_id(eos_text, "eos_token"))
        gen_eos = (generation_config or {}).get("eos_token_id")
        for tid in [gen_eos] if isinstance(gen_eos, int) else (gen_eos or []):
            eos_ids.add(int(tid))
        self.eos_token_ids: frozenset[int] = frozenset(eos_ids)

    # --- construction -------------------------------------------------------------------------------------------

    @classmethod
    def from_dir(cls, path: str | Path) -> Tokenizer:
        """Load ``tokenizer.json`` (required), ``tokenizer_config.json``, ``chat_template.jinja`` /
        ``chat_template.json`` and ``generation_config.json`` (optional) from a checkpoint directory."""
        root = Path(path)
        tok_file = root / "tokenizer.json"
        if not tok_file.is_file():
            raise TokenizerError(f"no tokenizer.json in {root} (dgpp needs the fast-tokenizer file)")
        try:
            backend = tokenizers.Tokenizer.from_file(str(tok_file))
        except Exception as exc:  # the Rust error says what is wrong inside the file
            raise TokenizerError(f"{tok_file} cannot be loaded: {exc}") from exc
        cfg_file = root / "tokenizer_config.json"
        config = _read_json(cfg_file) if cfg_file.is_file() else {}
        gen_file = root / "generation_config.json"
        generation = _read_json(gen_file) if gen_file.is_file() else {}
        template = None
        if (root / "chat_template.jinja").is_file():  # transformers >= 4.43 saves the template here
            template = (root / "chat_template.jinja").read_text(encoding="utf-8")
        elif (root / "chat_template.json").is_file():
            template = _read_json(root / "chat_template.json").get("chat_template")
        return cls(backend, config, generation, template, source=str(root))

    def _add_missing_added_tokens(self) -> None:
        """tokenizer_config.json may declare added tokens that tokenizer.json lacks; add them at their ids."""
        declared = self.config.get("added_tokens_decoder") or {}
        for raw_id, spec in sorted(declared.items(), key=lambda kv: int(kv[0])):
            content = spec.get("content") if isinstance(spec, dict) else None
            if content is None or self.backend.token_to_id(content) is not None:
                continue
            token = tokenizers.AddedToken(
                content,
                single_word=spec.get("single_word", False),
                lstrip=spec.get("lstrip", False),
                rstrip=spec.get("rstrip", False),
                normalized=spec.get("normalized", False),
                special=spec.get("special", True),
            )
            self.backend.add_special_tokens([token]) if token.special else self.backend.add_tokens([token])
            got = self.backend.token_to_id(content)
            if got != int(raw_id):
                raise TokenizerError(
                    f"{self.source}: tokenizer_config.json added token {content!r} is declared at id {raw_id} "
                    f"but tokenizer.json's vocabulary puts it at {got}"
                )

    def _required_id(self, text: str, what: str) -> int:
        tid = self.backend.token_to_id(text)
        if tid is None:
            raise TokenizerError(f"{self.source}: {what} {text!r} is not in the vocabulary of tokenizer.json")
        return tid

    # --- queries ------------------------------------------------------------------------------------------------

    @property
    def vocab_size(self) -> int:
        return self.backend.get_vocab_size(with_added_tokens=True)

    def token_to_id(self, token: str) -> int | None:
        return self.backend.token_to_id(token)

    def id_to_token(self, token_id: int) -> str | None:
        return self.backend.id_to_token(token_id)

    @property
    def bos_token_id(self) -> int | None:
        text = self.special_tokens_map.get("bos_token")
        return None if text is None else self.backend.token_to_id(text)

    @cached_property
    def special_ids(self) -> frozenset[int]:
        """Ids of added tokens marked special (what HF's ``skip_special_tokens`` drops)."""
        return frozenset(i for i, tok in self.backend.get_added_tokens_decoder().items() if tok.special)

    @cached_property
    def is_byte_level(self) -> bool:
        """True when decoding is GPT-2 byte-level (every family dgpp serves): token bytes are then exact."""
        state = json.loads(self.backend.decoder.__getstate__()) if self.backend.decoder is not None else {}
        kinds = [d.get("type") for d in state.get("decoders", [state])]
        return "ByteLevel" in kinds and all(k in ("ByteLevel",) for k in kinds)

    @cached_property
    def token_bytes(self) -> list[bytes]:
        """The raw bytes each id decodes to (byte-level tokenizers only); added tokens give their UTF-8 text.

        This mirrors the byte-level decoder: a token whose characters all belong to the byte alphabet maps
        through it, any other token is taken as its own UTF-8 text.
        """
        if not self.is_byte_level:
            raise TokenizerError(f"{self.source}: token_bytes needs a byte-level tokenizer")
        alphabet = _byte_level_alphabet()
        table: list[bytes] = [b""] * self.vocab_size
        for text, tid in self.backend.get_vocab(with_added_tokens=True).items():
            if tid >= len(table):
                table.extend([b""] * (tid + 1 - len(table)))
            try:
                table[tid] = bytes(alphabet[c] for c in text)
            except KeyError:
                table[tid] = text.encode("utf-8")
        return table

    # --- encode / decode ----------------------------------------------------------------------------------------

    def encode(self, text: str, add_special_tokens: bool = False) -> list[int]:
        """Token ids of ``text``; special-token text in it becomes the special token (as HF does).

        ``add_special_tokens`` runs tokenizer.json's post-processor (e.g. a BOS); chat prompts are rendered
        with their specials already in the text, so the default is off.
        """
        if (
            len(text) > _LONG_TEXT
        ):  # encode_batch releases the GIL while Rust works: the event loop keeps serving
            return self.backend.encode_batch([text], add_special_tokens=add_special_tokens)[0].ids
        return self.backend.encode(text, add_special_tokens=add_special_tokens).ids

    @cached_property
    def max_token_chars(self) -> int:
        """The most characters one vocabulary entry spells (byte-level entries: one character per byte)."""
        return max((len(t) for t in self.backend.get_vocab(with_added_tokens=True)), default=1) or 1

    def min_tokens(self, text: str) -> int:
        """A lower bound on ``len(encode(text))`` without tokenizing: no token covers more than
        ``max_token_chars`` characters of input. Halved again for normalizers that shorten text before the
        model (NFC composition, stripping), so the bound holds for every tokenizer.json."""
        return len(text) // (2 * self.max_token_chars)

    def decode(self, ids: list[int], skip_special_tokens: bool = False) -> str:
        return self.backend.decode(list(ids), skip_special_tokens=skip_special_tokens)
