"""``engine.mtp_schedule``: the rule (a draft is verified while its prefix survival beats the value of a verify
row, which grows with the batch; ``min_depth``; the sampled scale; the adapted value), a request's draft record
(acceptance rate, the plain-decode backoff), and through the scheduler: greedy output with the schedule on is the
plain greedy output for MTP (a real random drafter, a sure oracle that is verified deep, a sure drafter that is
always wrong and falls back to plain rows) and for prompt-lookup drafts (dense and hybrid); the keys."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

from dgpp.config import parse_config
from dgpp.engine.verify_schedule import DraftTrack, ScheduleSettings, VerifySchedule
from dgpp.errors import ConfigError
from dgpp.sample import SamplingParams
from dgpp.sched.published import Published
from dgpp.serve.metrics import engine_report

sys.path.insert(0, str(Path(__file__).parent))
import test_lookup_draft as lookup  # noqa: E402
from test_lookup_draft import dense, hybrid  # noqa: E402,F401 - module fixtures
from test_speculative import PROMPTS, glm, serve  # noqa: E402,F401 - glm is the module fixture

GREEDY, SAMPLED = SamplingParams(temperature=0.0), SamplingParams(temperature=0.8)


# ---- the rule --------------------------------------------------------------------------------------------
def test_a_draft_is_verified_while_its_survival_beats_the_batch_value_of_a_row():
    settings = ScheduleSettings(row_ms=8.0, base_ms=28.0, adapt=False, min_depth=0)
    schedule = VerifySchedule(settings)
    # a plain pass over B requests commits B tokens in base + B * row ms
    assert schedule.floor(1) == pytest.approx(1 / 36) and schedule.floor(8) == pytest.approx(8 / 92)
    alone, batched = schedule.rule([GREEDY]), schedule.rule([GREEDY] * 8)
    assert alone.threshold == pytest.approx(8 / 36) and batched.threshold == pytest.approx(64 / 92)
    # drafts each right half the time: alone, two pay for their rows (0.5, 0.25 > 0.22); in a batch of 8 none
    assert alone.cut(0, [0.5] * 4) == 2 and batched.cut(0, [0.5] * 4) == 0
    assert batched.cut(0, [0.99] * 4) == 4  # sure drafts pay at any batch size
    # survival is a product: one unsure draft stops the ones behind it, however sure they are
    assert alone.cut(0, [0.9, 0.1, 0.99, 0.99]) == 1


def test_min_depth_configured_value_and_sampled_scale():
    rule = VerifySchedule(ScheduleSettings(adapt=False, min_depth=2)).rule([GREEDY])
    assert rule.cut(0, [0.01] * 4) == 2  # the fewest a drafting request verifies
    fixed = VerifySchedule(ScheduleSettings(lam=0.05, adapt=False, min_depth=0))
    assert fixed.rule([GREEDY] * 8).threshold == pytest.approx(0.4)  # lambda * row_ms, whatever the batch
    scaled = VerifySchedule(ScheduleSettings(adapt=False, min_depth=0, sampled_scale=0.5)).rule(
        [GREEDY, SAMPLED]
    )
    assert scaled.threshold == pytest.approx(16 / 44)
    assert scaled.cut(0, [0.6, 0.6]) == 1 and scaled.cut(1, [0.6, 0.6]) == 0  # 0.6 vs 0.3 against 0.36
    unscheduled = VerifySchedule(ScheduleSettings(min_depth=0, sampled_scale=0.0)).rule([SAMPLED])
    assert unscheduled.cut(0, [0.01] * 3) == 3  # scale 0: sampled requests verify every draft


def test_the_value_of_time_adapts_to_the_modelled_throughput_above_its_floor():
    schedule = VerifySchedule(ScheduleSettings(row_ms=8.0, base_ms=28.0))
    assert schedule.lam is None and schedule.value(1) == pytest.approx(1 / 36)
    for _ in range(200):  # passes committing 4 tokens over 4 rows: 4 / 60 tokens/ms
        schedule.observe(committed=4, rows=4)
    assert schedule.value(1) == pytest.approx(4 / 60, rel=1e-3)
    for _ in range(200):  # slower than the floor: the floor holds
        schedule.observe(committed=1, rows=8)
    assert schedule.value(1) == pytest.approx(1 / 36)
    still = VerifySchedule(ScheduleSettings(adapt=False))
    still.observe(committed=50, rows=1)
    assert still.value(1) == pytest.approx(1 / 36)


def test_a_request_that_keeps_missing_backs_off_and_its_rate_follows_its_drafts():
    track = DraftTrack()
    assert track.rate == 0.5 and not track.resting()
    for skip in (1, 3, 7, 15, 15):
        track.judged(drafted=2, accepted=0)
        assert [track.resting() for _ in range(skip)] == [True] * skip and not track.resting()
    low = track.rate
    track.judged(drafted=3, accepted=3)
    assert track.misses == 0 and track.rate > low
    track.judged(drafted=3, accepted=1)  # one accepted, one rejected, the third never reached
    assert track.misses == 0 and not track.resting()


# ---- through the scheduler: greedy is exact ----------------------------------------------------------------
def _spec(sched) -> dict:
    spec = engine_report(Published(sched))["scheduler"]["spec_decode"]
    assert spec["scheduled"] is True
    # every request-pass is counted at the depth it verified (0: a plain row)
    assert sum(spec["num_verifies_per_depth_total"]) == sched.stats.decode_rows
    assert spec["num_draft_tokens_total"] == sum(
        k * n for k, n in enumerate(spec["num_verifies_per_depth_total"])
    )
    return spec


def test_scheduled_mtp_greedy_equals_plain(glm):  # noqa: F811
    model, drafter = glm
    plain, _ = serve(model)
    spec, sched = serve(model, drafter, 3, schedule=ScheduleSettings())
    assert spec == plain
    counters = _spec(sched)
    by_depth = counters["num_verifies_per_depth_total"]
    # a random drafter is unsure of every draft: the chain stops at min_depth, and its misses send it to plain rows
    assert by_depth[1] > 0 and by_depth[2] == by_depth[3] == 0 and by_depth[0] > 0


def test_a_sure_oracle_is_verified_deep_and_a_sure_wrong_drafter_falls_back_to_plain_rows(glm):  # noqa: F811
    model, _ = glm
    plain, _ = serve(model)
    transcripts = {f"r{i}": PROMPTS[i] + plain[f"r{i}"] for i in range(len(PROMPTS))}
    sure = ScheduleSettings()
    right, sched = serve(model, depth=3, oracle=transcripts, oracle_logit=30.0, schedule=sure)
    assert right == plain
    by_depth = _spec(sched)["num_verifies_per_depth_total"]
    assert by_depth[3] > by_depth[1] + by_depth[2]  # short only where few tokens are left
    assert _spec(sched)["num_accepted_tokens_total"] == _spec(sched)["num_draft_tokens_total"]
    wrong, sched = serve(model, depth=3, oracle=transcripts, oracle_logit=30.0, wrong_from=0, schedule=sure)
    assert wrong == plain
    counters = _spec(sched)
    # every pass it drafts, it drafts deep and loses them all; then it rests for 1, 3, 7 ... passes
    assert counters["num_accepted_tokens_total"] == 0
    assert counters["num_verifies_per_depth_total"][0] > counters["num_drafts_total"]


@pytest.mark.parametrize("fixture", ["dense", "hybrid"])
def test_scheduled_lookup_greedy_equals_plain(fixture, request):
    model = request.getfixturevalue(fixture)
    requests = lookup._greedy(biased=True)
    plain, _ = lookup.serve(model, requests)
    got, sched = lookup.serve(model, requests, depth=3, schedule=ScheduleSettings(adapt=False))
    assert got == plain
    counters = _spec(sched)
    assert counters["drafter"] == "lookup" and counters["num_accepted_tokens_total"] > 0


# ---- keys ------------------------------------------------------------------------------------------------
def test_schedule_keys_are_read_and_checked():
    cfg = parse_config(
        {
            "model": "m",
            "engine": {
                "mtp": True,
                "mtp_depth": 3,
                "mtp_schedule": True,
                "mtp_schedule_row_ms": 2.0,
                "mtp_schedule_base_ms": 34.0,
                "mtp_schedule_lambda": 0.01,
                "mtp_schedule_min_depth": 0,
                "mtp_schedule_adapt": False,
                "mtp_schedule_sampled_scale": 0.5,
            },
        }
    )
    assert ScheduleSettings.from_engine(cfg.engine) == ScheduleSettings(2.0, 34.0, 0.01, 0, False, 0.5)
    with pytest.raises(ConfigError, match=r"engine\.mtp_schedule: true schedules the drafts"):
        parse_config({"model": "m", "engine": {"mtp_schedule": True}})
    with pytest.raises(ConfigError, match=r"engine\.mtp_schedule_row_ms"):
        parse_config({"model": "m", "engine": {"mtp": True, "mtp_schedule": True, "mtp_schedule_row_ms": 0}})
    with pytest.raises(ConfigError, match=r"engine\.mtp_schedule_sampled_scale"):
        parse_config({"model": "m", "engine": {"draft": "lookup", "mtp_schedule_sampled_scale": 1.5}})
