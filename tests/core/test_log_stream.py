"""Logging must follow sys.stderr: a stream that was current at configure time may be closed later."""

import io
import sys

from dgpp.log import configure_logging, get_logger


def test_logging_survives_the_configure_time_stderr_being_closed(monkeypatch):
    first = io.StringIO()
    monkeypatch.setattr(sys, "stderr", first)
    configure_logging()
    first.close()  # as pytest's capture does at the end of a test that configured logging
    second = io.StringIO()
    monkeypatch.setattr(sys, "stderr", second)
    get_logger("dgpp.test").info("still writes")
    assert "still writes" in second.getvalue()
