"""Journal records: newline-framed JSON on the TCP star from rank 0.

Floats of sampling parameters travel as ``float.hex`` strings so every rank rebuilds the exact bits;
unseeded choices carry the seed their generator was given on rank 0, constrained ones their grammar spec.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import msgspec

from dgpp.sample.params import SamplingParams


class Hello(msgspec.Struct, tag="hello", tag_field="op"):
    """A peer's first line: its rank and the settings it would serve with."""

    rank: int
    settings: dict[str, Any]


class Formed(msgspec.Struct, tag="formed", tag_field="op"):
    """Rank 0 accepted every peer's settings: the world forms."""


class Refuse(msgspec.Struct, tag="refuse", tag_field="op"):
    """Rank 0 refuses the world; ``reason`` names the difference."""

    reason: str


class Admission(msgspec.Struct, omit_defaults=True):
    """One choice handed to the scheduler: the exact inputs every rank needs to rebuild its ``Sequence``."""

    id: str
    choice: int
    p: list[int]
    sp: dict[str, Any]
    gs: int  # the choice's generator seed as rank 0 drew it
    leader: str | None = None
    prefix: bool = True
    # the grammar constraint exactly as rank 0's serving layer resolved it (response_format, tools,
    # tool_choice, ...): every rank compiles the same matcher from it, so masks agree
    g: dict[str, Any] | None = None
    # the prompt's images (dgpp.media.wire): processed pixels, placeholder spans, rotary positions
    m: dict[str, Any] | None = None


class Tick(msgspec.Struct, tag="tick", tag_field="op"):
    """What tick ``n`` applies (admissions per request, cancels/stops) and rank 0's fold before it."""

    n: int
    od: str
    s: list[list[Admission]] = []
    c: list[tuple[str, str]] = []


class Stop(msgspec.Struct, tag="stop", tag_field="op"):
    """Orderly end after tick ``n``; peers answer with their ``Final``."""

    n: int
    od: str


class Final(msgspec.Struct, tag="final", tag_field="op"):
    """A peer's full-stream digest at shutdown."""

    rank: int
    full: str
    od: str


class Diverged(msgspec.Struct, tag="diverged", tag_field="op"):
    """A peer's fold disagreed with rank 0's at tick ``n``: the world stops."""

    rank: int
    n: int
    ours: str
    theirs: str


Record = Hello | Formed | Refuse | Tick | Stop | Final | Diverged
_encoder = msgspec.json.Encoder()
_decoder = msgspec.json.Decoder(Record)


def encode(record: Record) -> bytes:
    return _encoder.encode(record) + b"\n"


def decode(line: bytes) -> Record:
    return _decoder.decode(line)


def params_to_wire(params: SamplingParams) -> dict[str, Any]:
    """SamplingParams as JSON data with every float as its exact hex spelling."""
    out: dict[str, Any] = {}
    for f in dataclasses.fields(params):
        value = getattr(params, f.name)
        if isinstance(value, float):
            value = value.hex()
        elif f.name == "logit_bias":
            value = [[int(k), float(v).hex()] for k, v in sorted(value.items())]
        elif isinstance(value, tuple):
            value = list(value)
        out[f.name] = value
    return out


def params_from_wire(data: dict[str, Any]) -> SamplingParams:
    """The inverse of ``params_to_wire``: bit-identical floats."""
    kwargs: dict[str, Any] = {}
    floats = {f.name for f in dataclasses.fields(SamplingParams) if f.type in ("float", float)}
    for key, value in data.items():
        if key in floats:
            value = float.fromhex(value)
        elif key == "logit_bias":
            value = {int(k): float.fromhex(v) for k, v in value}
        elif key == "stop":
            value = tuple(value)
        kwargs[key] = value
    return SamplingParams(**kwargs)
