"""Polling with a deadline, for tests that wait on real components."""

from __future__ import annotations

import time
from collections.abc import Callable

import pytest


def wait_until(cond: Callable[[], object], timeout: float, what: str | Callable[[], str],
               interval: float = 0.05) -> None:
    """Poll ``cond`` until it is truthy; fail naming ``what`` after ``timeout`` s."""
    deadline = time.monotonic() + timeout
    while True:
        if cond():
            return
        if time.monotonic() >= deadline:
            pytest.fail(f"timed out after {timeout:.0f} s waiting for: "
                        f"{what() if callable(what) else what}")
        time.sleep(interval)
