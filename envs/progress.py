"""Progress of long work: a tqdm bar on a terminal, plain rate-limited lines in a log, or nothing.

Every entry point's long loop (dataset generation, sweeps, held-out evaluation, episodes)
reports through :class:`Progress`, so a terminal shows one live bar and a log file (stderr
redirected, not a TTY) gets readable lines without carriage returns::

    online: 3/12 godaddy_online-042  25%  2.4 s/trace  elapsed 7 s  ETA 22 s
"""

from __future__ import annotations

import math
import sys
import time
from typing import Any, TextIO

__all__ = ["Progress", "format_seconds"]


def format_seconds(s: float) -> str:
    """``s`` seconds as ``42 s``, ``3 min 05 s`` or ``1 h 02 min``."""
    if not math.isfinite(s):  # an unknown duration (no rate yet)
        return "?"
    s = max(0.0, s)
    if s < 60:
        return f"{s:.0f} s"
    m, sec = divmod(round(s), 60)
    if m < 60:
        return f"{m} min {sec:02d} s"
    h, m = divmod(m, 60)
    return f"{h} h {m:02d} min"


class Progress:
    """``step(what)`` after each unit of work; ``close()`` at the end (or use ``with``).

    On a terminal (``stream`` is a TTY) a tqdm bar. Otherwise one plain line on ``stream``
    per update, rate-limited: at most one every ``every_s`` seconds unless another tenth of
    ``total`` is done, and always the last step; each line carries the rate and the ETA.
    ``enabled=False`` shows nothing. ``stream`` is ``sys.stderr`` unless given.
    """

    def __init__(self, enabled: bool, total: int, desc: str, unit: str = "trace", *,
                 every_s: float = 10.0, stream: TextIO | None = None) -> None:
        if total < 0:
            raise ValueError(f"Progress({desc!r}): total must be >= 0, got {total}")
        self.stream: TextIO = sys.stderr if stream is None else stream
        self.bar: Any = None
        self.enabled = bool(enabled)
        self.lines = self.enabled and not _isatty(self.stream)
        self.total, self.done, self.desc, self.unit = int(total), 0, desc, unit
        self.every_s = float(every_s)
        self._t0 = time.perf_counter()
        self._last_line = -math.inf   # perf_counter() of the last line written
        self._last_tenth = 0              # tenths of ``total`` done at the last line
        self._printed = 0                 # ``done`` at the last line
        if self.enabled and not self.lines:
            from tqdm.auto import tqdm

            self.bar = tqdm(total=total, desc=desc, unit=unit, dynamic_ncols=True,
                            file=self.stream)

    def step(self, what: str = "", n: int = 1) -> None:
        """``n`` more units done; ``what`` names the last one (shown beside the count)."""
        self.done += n
        if self.bar is not None:
            self.bar.update(n)
            if what:
                self.bar.set_postfix_str(what)
        elif self.lines:
            now = time.perf_counter()
            tenth = (10 * self.done) // self.total if self.total else 10
            if (self.done >= self.total or tenth > self._last_tenth
                    or now - self._last_line >= self.every_s):
                self._write(what, now)
                self._last_tenth = tenth

    def line(self, what: str = "", now: float | None = None) -> str:
        """The text of one progress line (count, percentage, ``what``, rate, elapsed, ETA)."""
        now = time.perf_counter() if now is None else now
        elapsed = max(now - self._t0, 1e-9)
        rate = self.done / elapsed
        pct = f"  {100 * self.done / self.total:.0f}%" if self.total else ""
        left = self.total - self.done
        eta = "" if left <= 0 else f"  ETA {format_seconds(left / rate if rate else math.inf)}"
        what = f" {what}" if what else ""
        return (f"{self.desc}: {self.done}/{self.total}{what}{pct}  "
                f"{_rate(rate, self.unit)}  elapsed {format_seconds(elapsed)}{eta}")

    def _write(self, what: str, now: float) -> None:
        print(self.line(what, now), file=self.stream, flush=True)
        self._last_line, self._printed = now, self.done

    def close(self) -> None:
        """End the bar; in a log, write the final count if the last step was not shown."""
        if self.bar is not None:
            self.bar.close()
            self.bar = None
        elif self.lines and self.done != self._printed:
            self._write("", time.perf_counter())

    def __enter__(self) -> Progress:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def _isatty(stream: TextIO) -> bool:
    try:
        return bool(stream.isatty())
    except (AttributeError, ValueError):  # a closed or file-like stream without isatty
        return False


def _rate(rate: float, unit: str) -> str:
    if rate >= 1 or rate == 0:
        return f"{rate:.2f} {unit}s/s" if rate < 10 else f"{rate:.0f} {unit}s/s"
    return f"{1 / rate:.1f} s/{unit}"
