"""Per-choice random streams: a seeded choice draws the same numbers however it is batched."""

from __future__ import annotations

import secrets

import torch

from dgpp.splitmix import GOLDEN_GAMMA, MASK64, splitmix64

MASK63 = (1 << 63) - 1


def choice_seed(seed: int, choice_index: int) -> int:
    """The 63-bit stream seed of choice ``i`` of a request seeded ``s``: the seed is mixed before the choice
    index is added, so choice ``i`` of seed ``s`` is not choice 0 of seed ``s + i`` (the streams of nearby
    requests never overlap)."""
    return splitmix64((splitmix64(seed & MASK64) + choice_index * GOLDEN_GAMMA) & MASK64) & MASK63


def choice_generator(seed: int | None, choice_index: int) -> torch.Generator:
    """A CPU generator owned by one choice (``choice_seed``); unseeded choices get fresh entropy."""
    gen = torch.Generator(device="cpu")
    gen.manual_seed(secrets.randbits(63) if seed is None else choice_seed(seed, choice_index))
    return gen


def draw_seed(stream: int, draw_index: int) -> int:
    """The device draw's seed for the ``draw_index``-th sampled token of the choice whose stream seed is
    ``stream`` (a function of the two alone, so batching cannot change it)."""
    return splitmix64((splitmix64(stream) + draw_index * GOLDEN_GAMMA) & MASK64) & MASK63
