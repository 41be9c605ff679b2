"""Rank 0 names the departed peer whatever step a broken collective surfaces in: the runner's step, and under
``engine.mtp`` the speculative decoder's draft/verify pass, which holds the bare runner it was built with."""

from __future__ import annotations

import types

import pytest

from dgpp.dist.watchdog import name_departed_peers


class _Hub:
    def __init__(self, departure: str | None) -> None:
        self.departure = departure

    def wait_departure(self, timeout_s: float) -> str | None:
        return self.departure


class _BrokenRunner:
    """A runner whose collective fails as gloo does when a peer's socket closes."""

    model = "the model"

    def step(self, works):
        raise ConnectionError("Connection closed by peer [127.0.0.1]:40123")


class _Decoder:
    """Like ``SpeculativeDecoder``: keeps the runner it was built with and steps it directly."""

    def __init__(self, runner) -> None:
        self.runner = runner
        self.stats = "spec stats"

    def decode(self, seqs, emit, fail):
        return self.runner.step([])

    def after_prefill(self, chunks):
        return self.runner.step([])


def _scheduler(mtp: bool, hub) -> types.SimpleNamespace:
    """What the scheduler is built with: rank 0's runner and decoder, both named through ``hub``."""
    runner = _BrokenRunner()
    runner, speculative = name_departed_peers(runner, _Decoder(runner) if mtp else None, hub)
    return types.SimpleNamespace(runner=runner, speculative=speculative)


def test_a_peer_death_during_a_speculative_step_names_the_peer():
    sched = _scheduler(True, _Hub("rank 1 left the world (its journal connection closed)"))
    for call in (lambda: sched.runner.step([]), lambda: sched.speculative.decode([], None, None),
                 lambda: sched.speculative.after_prefill([])):
        with pytest.raises(RuntimeError, match=r"^rank 1 left the world") as info:
            call()
        assert isinstance(info.value.__cause__, ConnectionError)
    # the wrappers stay transparent to metrics and the scheduler
    assert sched.speculative.stats == "spec stats" and sched.runner.model == "the model"


def test_without_a_departure_the_transport_error_stands_and_plain_decode_is_untouched():
    sched = _scheduler(True, _Hub(None))
    with pytest.raises(ConnectionError):
        sched.speculative.decode([], None, None)
    plain = _scheduler(False, _Hub("rank 1 left the world"))
    assert plain.speculative is None
    with pytest.raises(RuntimeError, match="rank 1 left"):
        plain.runner.step([])
