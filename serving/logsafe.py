"""Log lines that a request or a file cannot forge.

A value written into a log line that came from a request (a path, a header) or from a file
(a bundle's ``SIGNATURE.json``) may hold a newline and so write a line of its own, such as
a fake audit entry. :func:`log_field` makes one field safe (control characters as ``?``,
bounded, quoted when it has spaces); :func:`install` makes every record of the process one
line (control characters of the formatted message escaped), for the server process, where
``serve.py`` installs it before anything logs. Tracebacks are formatted apart from the
message and keep their lines.
"""

from __future__ import annotations

import logging
import re
from typing import Any

__all__ = ["install", "log_field", "one_line"]

_CONTROL = re.compile(r"[\x00-\x08\x0a-\x1f\x7f]")


def log_field(value: object, limit: int = 300) -> str:
    """A log field from a request or a file: one line (control characters as ``?``),
    at most ``limit`` characters, quoted when it has spaces or ``=``."""
    s = re.sub(r"[\x00-\x1f\x7f]", "?", str(value))[:limit]
    return repr(s) if (" " in s or "=" in s or not s) else s


def one_line(text: str) -> str:
    """``text`` with its control characters (tabs kept) escaped as ``\\n``, ``\\x1b``..."""
    if _CONTROL.search(text) is None:
        return text
    return _CONTROL.sub(lambda m: repr(m.group())[1:-1], text)


def install() -> None:
    """Every log record of this process formats to one line (idempotent)."""
    base = logging.getLogRecordFactory()
    if getattr(base, "one_line", False):
        return

    def factory(*args: Any, **kwargs: Any) -> logging.LogRecord:
        record = base(*args, **kwargs)
        plain = record.getMessage

        def get_message() -> str:
            return one_line(plain())

        record.getMessage = get_message  # type: ignore[method-assign]
        return record

    factory.one_line = True  # type: ignore[attr-defined]
    logging.setLogRecordFactory(factory)
