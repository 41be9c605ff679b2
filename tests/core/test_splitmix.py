"""dgpp.splitmix: the published SplitMix64 outputs (one mixer for sampling seeds and tool-call ids)."""

from __future__ import annotations

from dgpp.splitmix import MASK64, splitmix64


def test_splitmix64_matches_the_reference_sequence():
    # the reference generator from state 0 adds the golden gamma before each output
    gamma = 0x9E3779B97F4A7C15
    outputs = [splitmix64((k * gamma) & MASK64) for k in range(3)]
    assert outputs == [0xE220A8397B1DCDAF, 0x6E789E6AA1B965F4, 0x06C45D188009454F]
