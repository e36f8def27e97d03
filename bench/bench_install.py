"""Install size and import time of each dependency group (``pyproject.toml``).

What is measured, for each group (``core``: the simulator; ``serve``: the policy server and
the controller adapters; ``train``; ``delivery``):

* ``install``   -- ``uv pip install '<repo>[<group>]'`` into a new virtual environment, with
  ``requirements.lock`` as constraints (the versions a full install has). uv's cache is
  used, so the time is mostly linking files from it, not downloading;
* ``size``      -- the bytes of the environment's ``site-packages`` (MB = 10^6 bytes), and
  its number of distributions;
* ``import``    -- the group's top modules (:data:`GROUPS`) imported by a fresh interpreter
  of that environment, run from outside the repository (so the installed package is
  imported): wall time of ``python -c "import ..."`` minus that of ``python -c pass``
  (interpreter start-up), and the cumulative time ``python -X importtime`` reports for
  those modules; median (min-max) of ``REPEATS`` interpreters, after one untimed run that
  fills the bytecode and numba caches.

Usage: ``python bench/bench_install.py [--quick] [--groups core,serve]``
"""

from __future__ import annotations

import argparse
import os
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _common import ROOT, dir_bytes, finish, fmt_stats, log, md_table, stats

REPEATS = 5
#: group -> what a user of it imports first
GROUPS: dict[str, tuple[str, ...]] = {
    "core": ("envs.dsmd.problems", "envs.dsmd.cost", "agents.baselines", "agents.exact"),
    "serve": ("serving.app", "serving.client.static", "serving.client.online"),
    "train": ("agents.algorithms", "agents.ddpg.algorithm", "agents.bundle_export",
              "envs.dsmd.env"),
    "delivery": ("delivery.controller", "delivery.agent", "delivery.testbed"),
}


def _uv() -> list[str]:
    for cmd in ([sys.executable, "-m", "uv"], [shutil.which("uv") or "uv"]):
        try:
            r = subprocess.run([*cmd, "--version"], capture_output=True, check=False)
            if r.returncode == 0:
                return cmd
        except OSError:
            pass
    raise SystemExit("bench_install: needs uv (pip install uv)")


def _env() -> dict[str, str]:
    return {k: v for k, v in os.environ.items() if k not in ("VIRTUAL_ENV", "PYTHONPATH")}


def _run(cmd: list[str], cwd: Path, timeout: float = 1800) -> subprocess.CompletedProcess:
    r = subprocess.run(cmd, cwd=cwd, capture_output=True, text=True, env=_env(),
                       timeout=timeout, check=False)
    if r.returncode != 0:
        raise RuntimeError(f"{' '.join(cmd)[:300]} failed:\n{r.stdout[-2000:]}{r.stderr[-4000:]}")
    return r


def _importtime_us(stderr: str, modules: tuple[str, ...]) -> int:
    """The microseconds ``-X importtime`` gives the statement's own imports: the cumulative
    time of every top-level entry (not nested in another import) of the packages of
    ``modules`` (what they import runs nested inside them; the interpreter's start-up
    imports are top-level entries of other packages)."""
    tops = {m.split(".")[0] for m in modules}
    total = 0
    for line in stderr.splitlines():
        if not line.startswith("import time:") or line.count("|") != 2:
            continue
        _, cum, name = line[len("import time:"):].split("|")
        if name.startswith("  ") or not cum.strip().isdigit():  # nested, or the header
            continue
        if name.strip().split(".")[0] in tops:
            total += int(cum)
    return total


def measure(group: str, root: Path, uv: list[str], repeats: int) -> dict[str, Any]:
    venv = root / group
    py = venv / "bin" / "python"
    _run([*uv, "venv", "-q", "--python", sys.executable, str(venv)], root)
    target = str(ROOT) if group == "core" else f"{ROOT}[{group}]"
    t0 = time.perf_counter()
    _run([*uv, "pip", "install", "-q", "--python", str(py), "-c",
          str(ROOT / "requirements.lock"), target], root)
    install_s = time.perf_counter() - t0
    site = next((venv / "lib").glob("python3*/site-packages"))
    dists = len(list(site.glob("*.dist-info")))
    mods = GROUPS[group]
    stmt = "; ".join(f"import {m}" for m in mods)
    _run([str(py), "-c", stmt], root)  # bytecode and numba caches
    walls, bare, itimes = [], [], []
    for _ in range(repeats):
        t0 = time.perf_counter()
        _run([str(py), "-c", "pass"], root)
        bare.append(time.perf_counter() - t0)
        t0 = time.perf_counter()
        _run([str(py), "-c", stmt], root)
        walls.append(time.perf_counter() - t0)
        itimes.append(_importtime_us(_run([str(py), "-X", "importtime", "-c", stmt],
                                          root).stderr, mods) / 1e6)
    imp = [w - b for w, b in zip(walls, bare)]
    res = {"modules": list(mods), "install_s": install_s, "site_packages_mb":
           dir_bytes(site) / 1e6, "distributions": dists, "import_s": stats(imp),
           "importtime_s": stats(itimes), "interpreter_s": stats(bare),
           "absent": [m for m in ("torch", "ray", "gymnasium", "mlflow", "fastapi",
                                  "onnxruntime", "pulsar")
                      if _run([str(py), "-c", f"import importlib.util as u; "
                               f"print(u.find_spec({m!r}) is None)"], root
                              ).stdout.strip() == "True"]}
    log(f"  {group:9s} {res['site_packages_mb']:8.0f} MB, {dists:3d} distributions, "
        f"install {install_s:5.1f} s, import {fmt_stats(res['import_s'], '{:.2f}')} s")
    return res


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--groups", default=",".join(GROUPS), help="comma-separated groups")
    ap.add_argument("--quick", action="store_true", help="2 interpreters per group")
    ap.add_argument("--keep", action="store_true", help="keep the environments (printed)")
    args = ap.parse_args()
    groups = [g.strip() for g in args.groups.split(",") if g.strip()]
    unknown = sorted(set(groups) - set(GROUPS))
    if unknown:
        raise SystemExit(f"bench_install: unknown group(s) {unknown}; known: {list(GROUPS)}")
    repeats = 2 if args.quick else REPEATS
    uv = _uv()
    t_start = time.perf_counter()
    log(f"bench_install: groups {groups}, {repeats} interpreters each")
    root = Path(tempfile.mkdtemp(prefix="bench_install."))
    try:
        results = {g: measure(g, root, uv, repeats) for g in groups}
    finally:
        if args.keep:
            log(f"environments kept in {root}")
        else:
            shutil.rmtree(root, ignore_errors=True)
    rows = [(g, f"{r['site_packages_mb']:,.0f}", r["distributions"],
             fmt_stats(r["import_s"], "{:.2f}"), fmt_stats(r["importtime_s"], "{:.2f}"),
             ", ".join(r["modules"]), ", ".join(r["absent"]) or "-")
            for g, r in results.items()]
    table = md_table(["group", "site-packages MB", "distributions", "import s",
                      "-X importtime s", "modules imported", "not installed"], rows)
    notes = [f"`uv pip install '.[group]'` with requirements.lock as constraints into a new "
             f"virtual environment; import: median (min-max) of {repeats} fresh interpreters "
             "(wall time minus a bare interpreter's start-up) after one untimed run; "
             "-X importtime: the cumulative time of the statement's own (not nested) imports",
             "serve installs neither torch, Ray, gymnasium nor MLflow "
             "(tests/test_install_groups.py)"]
    finish("bench_install", {"settings": {"repeats": repeats, "groups": groups},
                             "groups": results, "total_s": time.perf_counter() - t_start},
           table, notes, time.perf_counter() - t_start)


if __name__ == "__main__":
    main()
