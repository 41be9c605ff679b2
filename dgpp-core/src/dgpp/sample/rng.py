"""Per-choice random streams: a seeded choice draws the same numbers however it is batched."""

from __future__ import annotations

import secrets

import torch

from dgpp.splitmix import MASK64, splitmix64


def choice_generator(seed: int | None, choice_index: int) -> torch.Generator:
    """A CPU generator owned by one choice. Choice ``i`` of a request seeded ``s`` uses seed ``s + i``
    (anchor §2.2), mixed by SplitMix64 so neighbouring seeds do not give neighbouring streams; unseeded
    choices get fresh entropy."""
    gen = torch.Generator(device="cpu")
    if seed is None:
        gen.manual_seed(secrets.randbits(63))
    else:
        gen.manual_seed(splitmix64((seed + choice_index) & MASK64) & ((1 << 63) - 1))
    return gen


def uniform(gen: torch.Generator) -> float:
    """One float64 draw in [0, 1)."""
    return float(torch.rand((), dtype=torch.float64, generator=gen))
