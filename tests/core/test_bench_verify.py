"""``dgpp bench verify`` on CPU: the oracle drafter's drafts are all accepted, the null drafter's none, every run
reproduces the plain greedy transcript (a dense model and the GDN hybrid, whose rejected rows are re-run), and the
schedule sends the null drafter to plain rows."""

from __future__ import annotations

import pytest
import torch

from dgpp.bench.cli import main as bench_main
from dgpp.bench.models import build_random_model
from dgpp.bench.verify import run_verify_case


@pytest.mark.parametrize("geometry", ["tiny", "tiny-qwen3.5"])
def test_oracle_is_always_and_null_never_accepted_and_both_are_exact(geometry):
    model = build_random_model(geometry, "cpu", torch.float32)
    results = run_verify_case(
        model, 8, 3, 10, depths=[1, 3], drafters=["oracle", "null"], schedules=[False, True]
    )
    assert all(r.exact for r in results)
    by = {(r.drafter, r.depth, r.scheduled): r for r in results}
    plain = by[("plain", 0, False)]
    assert plain.run.generated == 3 * 9 and plain.run.rows == plain.run.passes * 3
    for depth in (1, 3):
        oracle, null = by[("oracle", depth, False)], by[("null", depth, False)]
        assert oracle.drafted > 0 and oracle.accepted == oracle.drafted
        assert null.drafted > 0 and null.accepted == 0
        assert oracle.run.passes < plain.run.passes and null.run.passes == plain.run.passes
        assert null.run.rows == plain.run.rows + null.drafted  # every draft a wasted row
    # scheduled: the null drafter's misses send it to plain rows (backoff), so it drafts far less
    assert by[("null", 3, True)].drafted < by[("null", 3, False)].drafted / 2
    assert by[("oracle", 3, True)].accepted == by[("oracle", 3, True)].drafted > 0


def test_dgpp_bench_verify_prints_the_table(capsys):
    rc = bench_main(
        ["verify", "--device", "cpu", "--geometry", "tiny", "--cases", "8x2x6", "--verify-depths", "2"]
    )
    out = capsys.readouterr().out
    assert rc == 0, out
    assert "| 8x2x6 | oracle | 2 | off |" in out and "(100%) | yes |" in out and "(0%) | yes |" in out


def test_graph_runs_replay_every_decode_pass_and_stay_exact():
    """``graphs``: the decode graphs' padded static batch (run eagerly off CUDA) takes the plain passes and the
    verifies alike, with the transcripts of the eager runs."""
    model = build_random_model("tiny", "cpu", torch.float32)
    eager = run_verify_case(model, 8, 3, 10, depths=[1, 3], drafters=["oracle", "null"], schedules=[False])
    graph = run_verify_case(
        model, 8, 3, 10, depths=[1, 3], drafters=["oracle", "null"], schedules=[False], graphs=True
    )
    assert all(r.exact and r.graphs and r.run.replays >= r.run.passes > 0 for r in graph)
    assert all(not r.graphs and r.run.replays == 0 for r in eager)
    for e, g in zip(eager, graph, strict=True):
        assert (e.drafter, e.depth, e.run.tokens, e.accepted) == (
            g.drafter,
            g.depth,
            g.run.tokens,
            g.accepted,
        )
