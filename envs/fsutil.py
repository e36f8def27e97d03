"""Filesystem helpers shared by everything that stores results."""

from __future__ import annotations

import contextlib
import os
import shutil
import tempfile
from collections.abc import Iterator
from pathlib import Path

__all__ = ["atomic_directory"]


@contextlib.contextmanager
def atomic_directory(directory: str | Path, overwrite: bool = False) -> Iterator[Path]:
    """Yield a temporary sibling directory; on success it replaces ``directory`` in one rename.

    On any error the temporary directory is removed and ``directory`` (if it existed) is left
    exactly as it was, so a failed write never loses what was stored before.
    """
    d = Path(directory)
    if d.exists() and not overwrite:
        raise FileExistsError(f"{d} exists; pass overwrite=True to replace it")
    d.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{d.name}.", dir=d.parent))
    try:
        yield tmp
        if d.exists():
            old = d.with_name(f".{d.name}.old")
            shutil.rmtree(old, ignore_errors=True)
            os.replace(d, old)
            os.replace(tmp, d)
            shutil.rmtree(old, ignore_errors=True)
        else:
            os.replace(tmp, d)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
