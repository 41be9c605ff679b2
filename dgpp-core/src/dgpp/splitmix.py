"""SplitMix64, the one 64-bit mixer dgpp uses wherever a small integer must become a well-spread one
(per-choice sampling seeds, tool-call ids). Pure Python, no dependencies, so every layer may import it."""

from __future__ import annotations

MASK64 = (1 << 64) - 1
GOLDEN_GAMMA = (
    0x9E3779B97F4A7C15  # the generator's state increment; callers stepping a state stream add it too
)


def splitmix64(x: int) -> int:
    """One SplitMix64 output for state ``x``: spreads nearby seeds (seed, seed+1) over the whole range."""
    x = (x + GOLDEN_GAMMA) & MASK64
    x = ((x ^ (x >> 30)) * 0xBF58476D1CE4E5B9) & MASK64
    x = ((x ^ (x >> 27)) * 0x94D049BB133111EB) & MASK64
    return x ^ (x >> 31)
