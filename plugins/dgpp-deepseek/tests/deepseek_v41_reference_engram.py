"""Engram of the float64 DeepSeek-V4.1 reference: n-gram hashes of normalised tokens look up rows of a large
table, and a gated projection of them is added to every hyper-connection stream.

- The token map: every token id's decoded text is normalised (NFKC, NFD, accents stripped, lowercased,
  whitespace runs collapsed to one space, stripped, a lone space kept as a space); tokens that normalise alike
  share one class, numbered in order of first appearance. A text with U+FFFD (a partial UTF-8 byte token) is
  keyed by its raw token string instead. The class count must equal ``engram_compressed_vocab_size``. Ids
  past the tokenizer's (a model vocabulary larger than the tokenizer's) take the pad token's class.
- Bucket sizes: for each engram layer (in ``engram_layer_ids`` order), n-gram size (2..``max_ngram_size``)
  and head, the next prime above ``engram_vocab_size - 1`` not used before (the search restarts at
  ``engram_vocab_size - 1`` for every n-gram size; primes are never reused). A layer's table holds the ranges
  one after another in (n-gram, head) order.
- Multipliers: per layer, ``max_ngram_size`` values ``2 v + 1`` with ``v`` drawn by numpy's
  ``default_rng(10007 * layer_id).integers(0, (2^63 - 1) // compressed_vocab // 2, size=max_ngram_size)``.
- The hash of the n-gram of size ``n`` ending at position ``p``: the classes of tokens ``p, p - 1, ...`` (a
  position before the sequence is the pad token's class) times their multipliers, XORed, modulo the head's
  prime, plus the head's range offset.
- The layer: the ``(max_ngram_size - 1) * n_heads`` rows (``head_dim`` each) concatenated, ``wkv`` to
  ``(hc_mult + 1) * hidden``: a key per stream and one shared value. Per stream ``s``:
  ``dot = sum(x_s * q_weight_s * k_weight_s * key_s) * rstd(x_s) * rstd(key_s) / sqrt(hidden)``,
  ``gate = sigmoid(copysign(sqrt(max(|dot|, 1e-6)), dot))``, ``x_s += gate * value``.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch
from deepseek_v41_reference_config import V41Config

F64 = torch.float64
Weights = dict[str, torch.Tensor]


def _is_prime(n: int) -> bool:
    if n < 2:
        return False
    f = 2
    while f * f <= n:
        if n % f == 0:
            return False
        f += 1
    return True


def bucket_primes(layers: int, max_ngram_size: int, n_heads: int, vocab_base: int) -> list[list[list[int]]]:
    """``[layer][ngram size - 2][head]`` prime bucket sizes."""
    seen: set[int] = set()
    out = []
    for _ in range(layers):
        per_ngram = []
        for _ in range(max_ngram_size - 1):
            sizes, current = [], vocab_base - 1
            for _ in range(n_heads):
                current += 1
                while not _is_prime(current) or current in seen:
                    current += 1
                seen.add(current)
                sizes.append(current)
            per_ngram.append(sizes)
        out.append(per_ngram)
    return out


def hash_multipliers(cfg: V41Config) -> list[list[int]]:
    bound = max(1, (int(np.iinfo(np.int64).max) // cfg.engram_compressed_vocab_size) // 2)
    rows = []
    for layer in cfg.engram_layer_ids:
        values = np.random.default_rng(10007 * layer).integers(
            0, bound, size=(cfg.engram_max_ngram_size,), dtype=np.int64
        )
        rows.append([int(v) * 2 + 1 for v in values])
    return rows


def compressed_token_map(tokenizer_json: str | Path) -> tuple[list[int], int]:
    """token id -> normalised class, and the class count, from a ``tokenizer.json``."""
    from tokenizers import Regex, Tokenizer, normalizers

    backend = Tokenizer.from_file(str(tokenizer_json))
    sentinel = "\ue000"  # a private-use character: a lone-space token survives the strip
    normalizer = normalizers.Sequence(
        [
            normalizers.NFKC(),
            normalizers.NFD(),
            normalizers.StripAccents(),
            normalizers.Lowercase(),
            normalizers.Replace(Regex(r"[ \t\r\n]+"), " "),
            normalizers.Replace(Regex(r"^ $"), sentinel),
            normalizers.Strip(),
            normalizers.Replace(sentinel, " "),
        ]
    )
    classes: dict[str, int] = {}
    out = []
    for token_id in range(backend.get_vocab_size(with_added_tokens=True)):
        text = backend.decode([token_id], skip_special_tokens=False)
        if "\ufffd" in text:
            key = backend.id_to_token(token_id)
        else:
            key = normalizer.normalize_str(text) or text
        out.append(classes.setdefault(key, len(classes)))
    return out, len(classes)


@dataclass(frozen=True)
class EngramHasher:
    cfg: V41Config
    token_map: tuple[int, ...]
    primes: tuple[tuple[tuple[int, ...], ...], ...]
    multipliers: tuple[tuple[int, ...], ...]

    @classmethod
    def build(cls, cfg: V41Config, token_map: list[int]) -> EngramHasher:
        classes = max(token_map) + 1 if token_map else 0
        if classes != cfg.engram_compressed_vocab_size:
            raise ValueError(
                f"engram_compressed_vocab_size: the tokenizer gives {classes} classes, the config says "
                f"{cfg.engram_compressed_vocab_size}"
            )
        primes = bucket_primes(
            len(cfg.engram_layer_ids), cfg.engram_max_ngram_size, cfg.engram_n_heads, cfg.engram_vocab_size
        )
        for i, layer in enumerate(cfg.engram_layer_ids):
            total = sum(sum(p) for p in primes[i])
            if total != cfg.engram_num_embeddings[i]:
                raise ValueError(
                    f"engram_num_embeddings: layer {layer}'s buckets total {total} rows, the config says "
                    f"{cfg.engram_num_embeddings[i]}"
                )
        # ids the tokenizer does not have (an embedding table larger than the vocabulary) have no text: they
        # hash as the pad token's class
        padded = list(token_map) + [token_map[cfg.engram_pad_token_id]] * max(
            0, cfg.vocab_size - len(token_map)
        )
        return cls(
            cfg,
            tuple(padded),
            tuple(tuple(tuple(h) for h in n) for n in primes),
            tuple(tuple(m) for m in hash_multipliers(cfg)),
        )

    def rows(self, tokens: list[int], positions: range, layer_index: int) -> list[list[int]]:
        """The table rows of every position in ``positions`` (``tokens`` holds the sequence so far): per
        position ``(max_ngram_size - 1) * n_heads`` row ids in (n-gram size, head) order."""
        cfg = self.cfg
        pad = self.token_map[cfg.engram_pad_token_id]
        mult = self.multipliers[layer_index]
        primes = self.primes[layer_index]
        out = []
        for p in positions:
            rolling = 0
            ids, offset = [], 0
            for shift in range(cfg.engram_max_ngram_size):
                cls = self.token_map[tokens[p - shift]] if p - shift >= 0 else pad
                rolling ^= cls * mult[shift]
                if shift == 0:
                    continue
                for prime in primes[shift - 1]:
                    ids.append(offset + rolling % prime)
                    offset += prime
            out.append(ids)
        return out


def engram(
    cfg: V41Config, w: Weights, layer: int, streams: torch.Tensor, rows: list[list[int]]
) -> torch.Tensor:
    """streams ``[T, hc, hidden]`` with the gated lookup of ``rows`` (``[T, n_cols]`` table row ids) added."""
    p = f"layers.{layer}.engram."
    table = w[p + "embed.weight"]
    looked = table[torch.tensor(rows, dtype=torch.long)].flatten(1)
    kv = looked @ w[p + "wkv.weight"].T
    hc, hidden = cfg.hc_mult, cfg.hidden_size
    key, value = kv[:, : hc * hidden].view(-1, hc, hidden), kv[:, hc * hidden :]
    weight = w[p + "q_weight"] * w[p + "k_weight"]
    eps = cfg.rms_norm_eps
    rstd = torch.rsqrt(streams.square().mean(-1) + eps) * torch.rsqrt(key.square().mean(-1) + eps)
    dot = (streams * weight * key).sum(-1) * rstd * hidden**-0.5
    gate = torch.sigmoid(torch.copysign(dot.abs().clamp_min(1e-6).sqrt(), dot))
    return streams + gate[..., None] * value[:, None, :]
