"""Shared helpers of the benchmark scripts: core pinning, run statistics, machine facts,
markdown tables and the JSON result files under ``bench/results/``.

This module must not import numpy at import time: :func:`pin_one_core` sets the BLAS /
OpenMP thread variables, which only take effect if it runs before numpy is loaded.
"""

from __future__ import annotations

import contextlib
import datetime as _dt
import json
import os
import platform
import statistics
import subprocess
import sys
from collections.abc import Callable, Iterable, Sequence
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
RESULTS_DIR = ROOT / "bench" / "results"

if str(ROOT) not in sys.path:  # `python bench/x.py` puts bench/ first, not the repo root
    sys.path.insert(0, str(ROOT))

_THREAD_VARS = ("OMP_NUM_THREADS", "OPENBLAS_NUM_THREADS", "MKL_NUM_THREADS",
                "NUMEXPR_NUM_THREADS", "VECLIB_MAXIMUM_THREADS")


def pin_one_core() -> int:
    """Restrict this process to one CPU (core 0 when allowed) and one BLAS/OpenMP thread.

    Call it before importing numpy. Returns the core used.
    """
    if "numpy" in sys.modules:
        raise RuntimeError("pin_one_core() must run before numpy is imported")
    for var in _THREAD_VARS:
        os.environ[var] = "1"
    allowed = os.sched_getaffinity(0)
    core = 0 if 0 in allowed else min(allowed)
    os.sched_setaffinity(0, {core})
    return core


def stats(values: Sequence[float]) -> dict[str, Any]:
    """Median, min, max and the raw runs."""
    vals = [float(v) for v in values]
    return {"median": statistics.median(vals), "min": min(vals), "max": max(vals),
            "runs": len(vals), "values": vals}


def fmt_stats(s: dict[str, Any], fmt: str = "{:,.0f}") -> str:
    """``median (min-max)`` for a table cell."""
    if s["runs"] == 1:
        return fmt.format(s["median"])
    return f"{fmt.format(s['median'])} ({fmt.format(s['min'])}-{fmt.format(s['max'])})"


def _cpu_model() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor()


def _git(*args: str) -> str | None:
    try:
        out = subprocess.run(["git", "-C", str(ROOT), *args], capture_output=True, text=True,
                             timeout=10, check=False)
        return out.stdout.strip() if out.returncode == 0 else None
    except (OSError, subprocess.SubprocessError):
        return None


def machine_info() -> dict[str, Any]:
    """What the numbers depend on: CPU, core counts, affinity, versions, time."""
    import numpy as np
    import scipy

    versions = {"python": platform.python_version(), "numpy": np.__version__,
                "scipy": scipy.__version__}
    for mod in ("gymnasium", "pyarrow"):
        with contextlib.suppress(ImportError):
            versions[mod] = __import__(mod).__version__
    return {
        "timestamp": _dt.datetime.now(_dt.UTC).isoformat(timespec="seconds"),
        "processor": platform.processor(),
        "cpu_model": _cpu_model(),
        "uname": " ".join(platform.uname()),
        "cpu_count": os.cpu_count(),
        "affinity": sorted(os.sched_getaffinity(0)),
        "loadavg_1_5_15": [round(x, 2) for x in os.getloadavg()],  # other work on the box
        "thread_env": {v: os.environ.get(v) for v in _THREAD_VARS},
        "versions": versions,
        # BENCH_GIT_COMMIT: the commit of a copy of the tree run elsewhere (a GPU machine),
        # whose .git, if any, is not this one's
        "git_commit": os.environ.get("BENCH_GIT_COMMIT") or _git("rev-parse", "--short", "HEAD"),
        # tracked files with uncommitted changes: the measured code may differ from the commit
        "git_modified": [ln.strip() for ln in (_git("status", "--porcelain",
                                                      "--untracked-files=no") or "").splitlines()],
    }


def md_table(headers: Sequence[str], rows: Iterable[Sequence[Any]]) -> str:
    lines = ["| " + " | ".join(headers) + " |",
             "|" + "|".join("---" for _ in headers) + "|"]
    lines += ["| " + " | ".join(str(c) for c in row) + " |" for row in rows]
    return "\n".join(lines)


def write_result(name: str, payload: dict[str, Any], table: str, notes: Sequence[str] = ()
                 ) -> Path:
    """Write ``bench/results/<name>.json`` (machine facts, table, notes and ``payload``)."""
    RESULTS_DIR.mkdir(parents=True, exist_ok=True)
    path = RESULTS_DIR / f"{name}.json"
    doc = {"benchmark": name, "machine": machine_info(), "table_md": table,
           "notes": list(notes), **payload}
    path.write_text(json.dumps(doc, indent=2, default=_json_default) + "\n")
    return path


def _json_default(o: Any) -> Any:
    if hasattr(o, "item"):  # numpy scalars
        return o.item()
    if hasattr(o, "tolist"):
        return o.tolist()
    return str(o)


def timed(label: str, fn: Callable[[int], Any], repeats: int) -> tuple[dict, Any]:
    """``fn(0)`` once cold, then ``fn(1..repeats)``: {"cold_s", "warm_s": stats} and the
    last result."""
    import time

    times: list[float] = []
    out: Any = None
    for r in range(repeats + 1):
        t0 = time.perf_counter()
        out = fn(r)
        times.append(time.perf_counter() - t0)
        log(f"  {label:10s} {'cold' if r == 0 else f'run {r}/{repeats}'}: {times[-1]:.3f} s")
    return {"cold_s": times[0], "warm_s": stats(times[1:])}, out


def dir_bytes(d: Path) -> int:
    """Bytes of every file below ``d``."""
    return sum(p.stat().st_size for p in d.rglob("*") if p.is_file())


def log(msg: str) -> None:
    print(msg, flush=True)


def finish(name: str, payload: dict[str, Any], table: str, notes: Sequence[str],
           total_s: float) -> Path:
    """Write the result JSON, then print the table, the notes and the total time."""
    path = write_result(name, payload, table, notes)
    log("")
    log(table)
    log("")
    for n in notes:
        log(f"* {n}")
    log(f"total {total_s:.0f} s; wrote {path}")
    return path
