"""Console output: progress lines in a log (envs/progress.py) and the third-party noise
filters every entry point installs (envs/quiet.py)."""

from __future__ import annotations

import io
import logging

import pytest

from envs.progress import Progress, format_seconds
from envs.quiet import DROPPED_LOG_MESSAGES, quiet


def test_progress_in_a_log_is_plain_rate_limited_lines():
    out = io.StringIO()  # not a TTY: lines, never a bar
    with Progress(True, 100, "sweep", unit="instance", every_s=3600, stream=out) as bar:
        for i in range(100):
            bar.step(f"i{i}")
    text = out.getvalue()
    lines = text.splitlines()
    assert "\r" not in text
    # the first step, then one line per further tenth of the total (the rate limit is long)
    assert len(lines) == 11
    assert lines[0].startswith("sweep: 1/100 i0  1%  ")
    assert lines[-1].startswith("sweep: 100/100 i99  100%  ")
    assert all("instances/s" in ln or "s/instance" in ln for ln in lines)
    assert "ETA" in lines[0] and "ETA" not in lines[-1]


def test_progress_writes_the_final_count_on_close_and_nothing_when_disabled():
    out = io.StringIO()
    with Progress(True, 5, "build", every_s=3600, stream=out) as bar:
        bar.step("a")
        bar.step("b", n=2)  # 3/5 is a further tenth: shown
    assert out.getvalue().splitlines()[-1].startswith("build: 3/5 b  60%")
    quiet_out = io.StringIO()
    with Progress(False, 5, "build", stream=quiet_out) as bar:
        bar.step("a")
    assert quiet_out.getvalue() == ""
    with pytest.raises(ValueError, match=r"'build'.*total"):
        Progress(True, -1, "build")


def test_format_seconds():
    assert [format_seconds(s) for s in (3.2, 65, 3725, float("inf"))] == \
        ["3 s", "1 min 05 s", "1 h 02 min", "?"]


def test_quiet_drops_only_the_named_messages(caplog):
    quiet()
    quiet()  # a second call adds no second filter
    name, _ = DROPPED_LOG_MESSAGES[0]
    logger = logging.getLogger(name)
    assert sum(type(f).__name__ == "_Drop" for f in logger.filters) == 1
    with caplog.at_level(logging.INFO, logger=name):
        logger.warning("Token authentication is enabled for this Ray cluster.")
        logger.warning("something else went wrong")
    assert [r.getMessage() for r in caplog.records] == ["something else went wrong"]
