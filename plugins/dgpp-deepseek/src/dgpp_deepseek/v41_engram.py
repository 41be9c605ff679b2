"""Engram of DeepSeek-V4.1-Flash (``layers.N.engram.*``): n-gram hashes of normalised tokens look up rows of a
large table; a gated projection of them is added to every hyper-connection stream before the layer's attention.

- Token classes: every token id's text, normalised (NFKC, NFD, accents stripped, lowercased, whitespace runs
  to one space, stripped; a lone space stays a space; a text holding U+FFFD is keyed by its raw token), with
  tokens that normalise alike sharing a class, numbered by first appearance (``token_classes``).
- Buckets: per Engram layer, n-gram size 2..``engram_max_ngram_size`` and head, the next prime above
  ``engram_vocab_size - 1`` not used before (the search restarts per n-gram size); a layer's table holds the
  ranges one after another in (n-gram, head) order.
- Multipliers: per layer ``2 v + 1`` for ``v`` from numpy's ``default_rng(10007 * layer)`` below
  ``(2^63 - 1) // classes // 2``. The n-gram of size ``n`` ending at ``p`` hashes to the XOR of the classes of
  tokens ``p, p - 1, ...`` (before the sequence: the pad token's class) times their multipliers, modulo the
  head's prime, plus the head's range offset.
- The layer: the looked-up rows concatenated, ``wkv`` to ``(hc_mult + 1) x hidden`` (a key per stream, one
  value); per stream ``dot = sum(x_s q_s k_s key_s) rstd(x_s) rstd(key_s) / sqrt(hidden)``,
  ``x_s += sigmoid(sign(dot) sqrt(max(|dot|, 1e-6))) value``.

The table (``engram.embed``, FP8 E4M3 with an E8M0 scale per 32 channels, or dense) stays in the checkpoint
file, memory-mapped: a step reads only the rows its tokens hash to (``EngramTable``). The last
``max_ngram_size - 1`` token ids of a request are its state (``engram.context``), so chunks and prefix-cache
hits hash exactly as one pass would.
"""

from __future__ import annotations

import json
import struct
from pathlib import Path

import numpy as np
import torch
from torch import nn

from dgpp.kernels.masked_rows import store_rows
from dgpp.nn.batch_invariant import batch_invariant_rows
from dgpp.nn.linear import Linear
from dgpp.nn.weights import default_weight_loader, set_weight_attrs
from dgpp.nn.window_compressor import live_sequences
from dgpp.plugin_api import CacheSpec, ConfigError, ForwardBatch, StateSpec
from dgpp.quant.codecs import e8m0_to_float, fp8_e4m3_to_float
from dgpp_deepseek.v41_config import DeepseekV41ArchConfig
from dgpp_deepseek.v41_decode_rows import live_rows

_NUMPY = {
    "F8_E4M3": np.uint8,
    "F8_E8M0": np.uint8,
    "U8": np.uint8,
    "I8": np.uint8,
    "F32": np.float32,
    "BF16": np.uint16,
    "F16": np.float16,
}


def _is_prime(n: int) -> bool:
    if n < 2:
        return False
    f = 2
    while f * f <= n:
        if n % f == 0:
            return False
        f += 1
    return True


def bucket_primes(cfg: DeepseekV41ArchConfig) -> list[list[list[int]]]:
    """``[engram layer][n-gram size - 2][head]`` bucket sizes."""
    seen: set[int] = set()
    out = []
    for _ in cfg.engram_layer_ids:
        per_ngram = []
        for _ in range(cfg.engram_max_ngram_size - 1):
            sizes, current = [], cfg.engram_vocab_size - 1
            for _ in range(cfg.engram_n_heads):
                current += 1
                while not _is_prime(current) or current in seen:
                    current += 1
                seen.add(current)
                sizes.append(current)
            per_ngram.append(sizes)
        out.append(per_ngram)
    return out


def token_classes(tokenizer_json: Path) -> list[int]:
    """token id -> normalised class (see the module doc)."""
    from tokenizers import Regex, Tokenizer, normalizers

    backend = Tokenizer.from_file(str(tokenizer_json))
    lone_space = "\ue000"  # a private-use character carries a lone space through the strip
    normalizer = normalizers.Sequence(
        [
            normalizers.NFKC(),
            normalizers.NFD(),
            normalizers.StripAccents(),
            normalizers.Lowercase(),
            normalizers.Replace(Regex(r"[ \t\r\n]+"), " "),
            normalizers.Replace(Regex(r"^ $"), lone_space),
            normalizers.Strip(),
            normalizers.Replace(lone_space, " "),
        ]
    )
    classes: dict[str, int] = {}
    out = []
    for token_id in range(backend.get_vocab_size(with_added_tokens=True)):
        text = backend.decode([token_id], skip_special_tokens=False)
        raw = backend.id_to_token(token_id) if "\ufffd" in text else None
        key = raw if raw is not None else (normalizer.normalize_str(text) or text)
        out.append(classes.setdefault(key, len(classes)))
    return out


class EngramTable:
    """One layer's ``engram.embed`` rows, read from the memory-mapped checkpoint file on demand."""

    def __init__(self, checkpoint_dir: Path, name: str, file_of: dict[str, Path]) -> None:
        if f"{name}.weight" not in file_of:
            raise ConfigError(f"{checkpoint_dir}: the Engram table {name}.weight is missing")
        self.codes = self._map(file_of[f"{name}.weight"], f"{name}.weight")
        scale = f"{name}.scale"
        self.scales = self._map(file_of[scale], scale) if scale in file_of else None

    @classmethod
    def resident(cls, codes: np.ndarray, scales: np.ndarray | None) -> EngramTable:
        """A table already in memory, as ``load_into_memory`` leaves one: E4M3 codes ``[rows, head_dim]`` and E8M0
        scales ``[rows, head_dim / 32]``, both as bytes."""
        table = cls.__new__(cls)
        table.codes = (codes, "F8_E4M3")
        table.scales = None if scales is None else (scales, "F8_E8M0")
        return table

    @staticmethod
    def _map(path: Path, name: str) -> tuple[np.ndarray, str]:
        with path.open("rb") as f:
            (size,) = struct.unpack("<Q", f.read(8))
            info = json.loads(f.read(size))[name]
        begin, end = info["data_offsets"]
        rows, cols = info["shape"]
        dtype = _NUMPY.get(info["dtype"])
        if dtype is None:
            raise ConfigError(
                f"{path}: Engram tensor {name} has dtype {info['dtype']}, which is not supported"
            )
        mapped = np.memmap(path, dtype=dtype, mode="r", offset=8 + size + begin, shape=(rows, cols))
        assert mapped.nbytes == end - begin
        return mapped, info["dtype"]

    def arrays(self) -> list[np.ndarray]:
        return [self.codes[0]] + ([self.scales[0]] if self.scales is not None else [])

    @property
    def mapped_bytes(self) -> int:
        return sum(a.nbytes for a in self.arrays())

    @property
    def row_bytes(self) -> int:
        """Bytes one looked-up row reads (its codes and its scales)."""
        return sum(a.shape[1] * a.itemsize for a in self.arrays())

    def load_into_memory(self) -> None:
        """Copy the table out of the file (``engine.ngram_table: resident``)."""
        self.codes = (np.array(self.codes[0]), self.codes[1])
        if self.scales is not None:
            self.scales = (np.array(self.scales[0]), self.scales[1])

    def rows(self, ids: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
        """The rows ``ids`` (any shape) decoded, ``[*ids.shape, head_dim]``."""
        flat = ids.reshape(-1).cpu().numpy()
        codes, kind = self.codes
        raw = torch.from_numpy(np.ascontiguousarray(codes[flat]))
        if kind == "F8_E4M3":
            values = fp8_e4m3_to_float(raw)
        elif kind == "BF16":
            values = raw.view(torch.bfloat16).float()
        else:
            values = raw.float()
        if self.scales is not None:
            scale = e8m0_to_float(torch.from_numpy(np.ascontiguousarray(self.scales[0][flat])))
            values = (values.unflatten(-1, (scale.shape[-1], -1)) * scale[..., None]).flatten(-2)
        return values.to(dtype).reshape(*ids.shape, -1).to(ids.device)


class EngramV41(nn.Module):
    """``engram.{wkv, q_weight, k_weight}`` of one layer; the table and the hasher are attached at load."""

    def __init__(self, cfg: DeepseekV41ArchConfig, layer_idx: int, *, dtype: torch.dtype) -> None:
        super().__init__()
        self.hidden, self.streams, self.eps = cfg.hidden_size, cfg.hc_mult, cfg.rms_norm_eps
        self.ngram, self.heads = cfg.engram_max_ngram_size, cfg.engram_n_heads
        self.position = cfg.engram_layer_ids.index(layer_idx)
        self.layer_idx, self.vocab_size = layer_idx, cfg.vocab_size
        self.cache_name = f"layers.{layer_idx}.engram.context"
        width = cfg.engram_rows_per_token * cfg.engram_head_dim
        self.wkv = Linear(width, (cfg.hc_mult + 1) * cfg.hidden_size, dtype=dtype)
        self.q_weight = nn.Parameter(
            torch.empty(cfg.hc_mult, cfg.hidden_size, dtype=dtype), requires_grad=False
        )
        self.k_weight = nn.Parameter(
            torch.empty(cfg.hc_mult, cfg.hidden_size, dtype=dtype), requires_grad=False
        )
        for p in (self.q_weight, self.k_weight):
            set_weight_attrs(p, weight_loader=default_weight_loader)
        self.table: EngramTable | None = None
        self.classes: torch.Tensor | None = None  # token id -> class
        self.pad_class = 0
        self.multipliers = torch.zeros(0, dtype=torch.int64)
        self.primes = torch.zeros(0, dtype=torch.int64)  # [(ngram - 1) * heads] in (n-gram, head) order
        # decode steps hash on the device (False: the per-sequence form, the reference it matches)
        self.batched_decode = True
        self.dtype = dtype
        self._device_hash: tuple[torch.Tensor, ...] | None = None  # classes, multipliers, primes, offsets
        # decode steps' looked-up rows, gathered before the forward (``stage_decode``): per row count, the static
        # device buffer a captured graph reads and its pinned host mirror
        self._staged: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}
        self._pending: torch.Tensor | None = None

    def attach(
        self, table: EngramTable, classes: list[int], pad_token: int, primes: list[list[int]], seed_layer: int
    ) -> None:
        self.table = table
        self.pad_class = classes[pad_token]
        # ids past the tokenizer's (a vocabulary padded for the head) hash as the pad token
        padded = classes + [self.pad_class] * max(0, self.vocab_size - len(classes))
        self.classes = torch.tensor(padded, dtype=torch.int64)
        bound = max(1, (int(np.iinfo(np.int64).max) // (max(classes) + 1)) // 2)
        values = np.random.default_rng(10007 * seed_layer).integers(
            0, bound, size=(self.ngram,), dtype=np.int64
        )
        self.multipliers = torch.tensor([int(v) * 2 + 1 for v in values], dtype=torch.int64)
        self.primes = torch.tensor([p for sizes in primes for p in sizes], dtype=torch.int64)
        self._device_hash = None

    def table_bytes_per_token(self) -> int:
        """Table bytes one token's lookup reads (a row per n-gram size and head), for the decode roofline."""
        rows = (self.ngram - 1) * self.heads
        return 0 if self.table is None else rows * self.table.row_bytes

    def cache_entries(self, dtype: torch.dtype) -> dict[str, CacheSpec]:
        return {self.cache_name: StateSpec({"tokens": ((self.ngram - 1,), torch.int64)})}

    def row_ids(self, batch: ForwardBatch) -> torch.Tensor:
        """``[T, rows per token]`` table rows of the step's tokens (padding rows: row 0, their output unused)."""
        assert self.classes is not None
        ring = batch.cache.state[self.cache_name]["tokens"]
        back = self.ngram - 1
        tokens = batch.input_ids.cpu()
        out = torch.zeros(tokens.shape[0], back * self.heads, dtype=torch.int64)
        offsets = torch.cumsum(torch.cat([torch.zeros(1, dtype=torch.int64), self.primes[:-1]]), 0)
        for _, start, q_len, ctx, end, slot in live_sequences(batch):
            lo = max(0, ctx - back)
            old = ring[slot, torch.arange(lo, ctx) % back].cpu()
            line = torch.cat([old, tokens[start : start + q_len]])  # positions lo .. end - 1
            cls = self.classes[line]
            rolling = torch.zeros(q_len, dtype=torch.int64)
            for shift in range(self.ngram):
                idx = torch.arange(ctx, end) - shift - lo
                picked = torch.where(idx >= 0, cls[idx.clamp_min(0)], torch.full_like(idx, self.pad_class))
                rolling = rolling ^ (picked * self.multipliers[shift])
                if shift:
                    heads = slice((shift - 1) * self.heads, shift * self.heads)
                    out[start : start + q_len, heads] = rolling[:, None] % self.primes[heads] + offsets[heads]
            keep = max(ctx, end - back)
            ring[slot, torch.arange(keep, end, device=ring.device) % back] = line[keep - lo :].to(ring.device)
        return out

    def _hash_on(self, device: torch.device) -> tuple[torch.Tensor, ...]:
        """(classes, multipliers, primes, range offsets) on ``device``, copied there once."""
        if self._device_hash is None or self._device_hash[0].device != device:
            assert self.classes is not None
            offsets = torch.cumsum(torch.cat([torch.zeros(1, dtype=torch.int64), self.primes[:-1]]), 0)
            consts = (self.classes, self.multipliers, self.primes, offsets)
            self._device_hash = tuple(t.to(device) for t in consts)
        return self._device_hash

    def decode_row_ids(self, batch: ForwardBatch) -> torch.Tensor:
        """``row_ids`` of a decode step (one token per row) on the device, no host read: the n-grams ending at each
        row's token from its ring; the token joins the ring (a padding row reads slot 0 and writes nothing).
        The same int64 ops as ``row_ids`` (wrapping products, XOR, a floored ``%`` by positive primes)."""
        classes, multipliers, primes, offsets = self._hash_on(batch.input_ids.device)
        ring = batch.cache.state[self.cache_name]["tokens"]
        back = self.ngram - 1
        pos, tokens = batch.positions.long(), batch.input_ids.long()
        slot = batch.state_slots.long().clamp(min=0)
        rolling = classes[tokens] * multipliers[0]
        parts = []
        for shift in range(1, self.ngram):
            before = pos - shift
            earlier = classes[ring[slot, before % back]]
            rolling = rolling ^ (torch.where(before >= 0, earlier, self.pad_class) * multipliers[shift])
            heads = slice((shift - 1) * self.heads, shift * self.heads)
            parts.append(rolling[:, None] % primes[heads] + offsets[heads])
        store_rows(ring.view(-1, 1), slot * back + pos % back, tokens[:, None], live_rows(batch))
        return torch.cat(parts, dim=1)

    def stage_decode(self, batch: ForwardBatch) -> None:
        """Gather a decode step's rows before its forward (or graph replay), which then reads them from a static
        device buffer. The table stays memory-mapped on the host, so the rows' ids are read there: this waits for
        the step's token ids on the device (an overlapped step's come from the previous step's sampling). That
        wait also orders the pinned mirror's rewrite after the previous step's copy out of it."""
        assert self.table is not None
        ids = self.decode_row_ids(batch)
        rows = self.table.rows(ids.cpu(), self.dtype)
        staged = self._staged.get(ids.shape[0])
        if staged is None or staged[0].device != ids.device:
            pin = ids.device.type == "cuda"
            pinned = torch.empty(rows.shape, dtype=rows.dtype, pin_memory=pin)
            staged = (torch.empty(rows.shape, dtype=rows.dtype, device=ids.device), pinned)
            self._staged[ids.shape[0]] = staged
        device_rows, pinned = staged
        pinned.copy_(rows)
        device_rows.copy_(pinned, non_blocking=True)
        self._pending = device_rows

    def forward(self, streams: torch.Tensor, batch: ForwardBatch) -> torch.Tensor:
        """``streams [T, hc, hidden]`` with the gated lookup added to every stream."""
        assert self.table is not None
        if self._pending is not None:  # staged by ``stage_decode`` for this step
            looked, self._pending = self._pending, None
            if looked.shape[0] != streams.shape[0]:
                raise RuntimeError(
                    f"Engram rows staged for {looked.shape[0]} rows, the step has {streams.shape[0]}"
                )
        elif self.batched_decode and batch.is_decode_only:
            looked = self.table.rows(self.decode_row_ids(batch), streams.dtype)
        else:
            looked = self.table.rows(self.row_ids(batch).to(streams.device), streams.dtype)
        looked = looked.flatten(1)
        kv = self.wkv(looked)
        key = kv[:, : self.streams * self.hidden].view(-1, self.streams, self.hidden).float()
        value = kv[:, self.streams * self.hidden :]
        x = streams.float()
        weight = self.q_weight.float() * self.k_weight.float()
        # [T, hc] per-row functions, each row's bits independent of the step's row count
        rstd = batch_invariant_rows(torch.rsqrt, x.square().mean(-1) + self.eps) * batch_invariant_rows(
            torch.rsqrt, key.square().mean(-1) + self.eps
        )
        dot = (x * weight * key).sum(-1) * rstd * self.hidden**-0.5
        gate = batch_invariant_rows(
            lambda d: torch.sigmoid(torch.sign(d) * d.abs().clamp_min(1e-6).sqrt()), dot
        )
        return (x + gate[..., None] * value.float()[:, None, :]).to(streams.dtype)
