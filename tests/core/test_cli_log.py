"""Logging: console lines by default, JSON lines with --log-json, and the progress helper."""

from __future__ import annotations

import io
import json

import pytest

from dgpp import log


@pytest.fixture(autouse=True)
def restore_console_logging():
    yield
    log.configure_logging()


def test_json_lines_carry_event_level_and_utc_ms_timestamp():
    buf = io.StringIO()
    log.configure_logging(json=True, level="info", stream=buf)
    log.get_logger("dgpp.test").info("loaded", tensors=3)
    log.get_logger("dgpp.test").debug("hidden")  # below the level
    lines = [json.loads(x) for x in buf.getvalue().splitlines()]
    assert len(lines) == 1
    rec = lines[0]
    assert (
        rec["event"] == "loaded"
        and rec["tensors"] == 3
        and rec["level"] == "info"
        and rec["logger"] == "dgpp.test"
    )
    assert rec["timestamp"].endswith("Z") and len(rec["timestamp"].split(".")[1]) == 4  # milliseconds + Z


def test_console_lines_are_readable():
    buf = io.StringIO()
    log.configure_logging(json=False, level="debug", stream=buf)
    log.get_logger("dgpp.test").debug("step", n=1)
    text = buf.getvalue()
    assert "step" in text and "n=1" in text and "{" not in text


def test_level_from_env_and_bad_level(monkeypatch):
    monkeypatch.setenv("DGPP_LOG_LEVEL", "warning")
    buf = io.StringIO()
    log.configure_logging(json=True, stream=buf)
    log.get_logger().info("quiet")
    log.get_logger().warning("loud")
    assert [json.loads(x)["event"] for x in buf.getvalue().splitlines()] == ["loud"]
    with pytest.raises(ValueError, match="log level 'chatty'"):
        log.configure_logging(level="chatty")


def test_progress_yields_everything_and_reports(monkeypatch):
    buf = io.StringIO()
    log.configure_logging(json=True, stream=buf)
    items = list(log.progress(iter(range(5)), 5, "loading shards", every_s=0.0))
    assert items == [0, 1, 2, 3, 4]
    recs = [json.loads(x) for x in buf.getvalue().splitlines()]
    assert recs[0]["progress"] == "1/5 (20%)"
    assert recs[-1]["event"] == "loading shards done" and recs[-1]["done"] == 5
