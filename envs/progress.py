"""Progress of long work: a tqdm bar on a terminal, one line per step in a log, or nothing."""

from __future__ import annotations

import sys
import time

__all__ = ["Progress"]


class Progress:
    """``step(what)`` after each unit of work; ``close()`` at the end (or use ``with``).

    On a terminal (stderr is a TTY) a tqdm bar; otherwise one line per step on stderr,
    ``desc: done/total what (elapsed s)``, so a log file stays readable."""

    def __init__(self, enabled: bool, total: int, desc: str, unit: str = "trace") -> None:
        self.bar = None
        self.lines = enabled and not sys.stderr.isatty()
        self.total, self.done, self.desc = total, 0, desc
        self._t0 = time.perf_counter()
        if enabled and not self.lines:
            from tqdm.auto import tqdm

            self.bar = tqdm(total=total, desc=desc, unit=unit, dynamic_ncols=True)

    def step(self, what: str = "") -> None:
        self.done += 1
        if self.bar is not None:
            self.bar.update(1)
            if what:
                self.bar.set_postfix_str(what)
        elif self.lines:
            print(f"{self.desc}: {self.done}/{self.total} {what} "
                  f"({time.perf_counter() - self._t0:.0f} s)", file=sys.stderr, flush=True)

    def close(self) -> None:
        if self.bar is not None:
            self.bar.close()

    def __enter__(self) -> "Progress":
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
