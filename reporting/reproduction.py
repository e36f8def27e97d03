"""The reproduction report (``python report.py``, configuration ``configs/report.yaml``) and
the benchmark page, both generated from result files.

The report takes, for every figure of the reference papers that the project reproduces, the
paper's numbers from the configuration (each with the place in the paper it comes from) and
ours from the result files of the experiment that makes the figure. It writes one page,
``docs/report/index.md``: per figure a table (paper beside ours: mean and standard deviation
over seeds), the plot, the command, where, when and on which machine the result was made,
and why the numbers differ; figures the project does not reproduce are stated as such, and a
figure whose results are missing says so with the command that makes them. No number of
ours is ever written by hand: a value comes from a result file or is not shown.

Where results come from (``report.source``):

* ``latest``: the newest run under ``report.results_root`` (``outputs/``) of the
  experiment's command: ``outputs/<job>/<time>/`` for a single run, ``outputs/<job>/
  multirun_<time>/<n>/`` for a Hydra multirun. A run counts only when its Hydra overrides
  are the command's (runs with other settings, e.g. smoke runs, are skipped).
* ``committed``: the copies under ``report.committed_root`` (``results/<experiment>/``,
  kept in git with a ``provenance.json``), so that a fresh clone has a report.
* ``auto`` (default): ``latest`` where such a run exists, else ``committed``.

``report.collect=true`` copies the results a report used into ``results/`` (to commit).

A result file the report cannot read (not CSV/JSON, a missing column, no row for a value it
needs) is a :class:`ReportError` naming the file and what is wrong; the report is then not
written. Pages are written to a temporary directory first and swapped in at the end, so a
failed run leaves the previous report in place.

:func:`format_benchmarks` is the one formatter of benchmark results
(``bench/results/<name>.json``): ``bench/run_all.py`` writes ``SUMMARY.md`` with it, and the
report writes ``docs/benchmarks.md`` with it.
"""

from __future__ import annotations

import json
import math
import os
import platform
import re
import shlex
import shutil
import statistics
import tempfile
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from datetime import UTC, datetime
from pathlib import Path
from typing import TYPE_CHECKING, Any

from envs.stats import ci95

if TYPE_CHECKING:
    import pandas as pd

__all__ = [
    "ReportError",
    "Run",
    "Source",
    "benchmark_section",
    "build_report",
    "find_latest",
    "format_benchmarks",
    "load_committed",
    "machine_summary",
    "main",
    "row_values",
    "write_benchmarks",
]

#: override keys that do not change a result (ignored when matching a run to a command)
IGNORED_OVERRIDES = frozenset({"progress", "logger", "run_name", "tags", "hydra"})
PROVENANCE = "provenance.json"


class ReportError(ValueError):
    """A result file or a report configuration the report cannot use (the message names it)."""


# --------------------------------------------------------------------------- commands


@dataclass(frozen=True)
class Command:
    """An entry point command line: ``python <script>.py [-m] key=value ...``."""

    text: str
    script: str
    multirun: bool
    overrides: tuple[str, ...]

    @property
    def job(self) -> str:
        """Hydra's job name: the script's file name without ``.py``."""
        return Path(self.script).stem

    @classmethod
    def parse(cls, text: str, where: str) -> Command:
        try:
            words = shlex.split(text)
        except ValueError as e:
            raise ReportError(f"{where}: command {text!r} does not parse: {e}") from None
        if words and Path(words[0]).name.startswith("python"):
            words = words[1:]
        if not words or not words[0].endswith(".py"):
            raise ReportError(f"{where}: command {text!r} must be `python <script>.py ...`")
        script, rest = words[0], words[1:]
        multirun = any(w in ("-m", "--multirun") for w in rest)
        overrides = tuple(w for w in rest if not w.startswith("-"))
        return cls(text, script, multirun, overrides)


def _relevant(overrides: Iterable[str]) -> set[str]:
    """Overrides without whitespace, minus those that do not change results."""
    keep = set()
    for o in overrides:
        key = o.split("=", 1)[0].lstrip("+~")
        if key.split(".", 1)[0] in IGNORED_OVERRIDES:
            continue
        keep.add("".join(o.split()))
    return keep


def _read_overrides(path: Path) -> list[str]:
    from omegaconf import OmegaConf

    try:
        node = OmegaConf.to_container(OmegaConf.load(path))
    except Exception as e:
        raise ReportError(f"{path}: not a Hydra overrides file: {e}") from None
    if not isinstance(node, list):
        raise ReportError(f"{path}: expected a list of overrides, got {type(node).__name__}")
    return [str(x) for x in node]


def _multirun_overrides(path: Path) -> list[str]:
    from omegaconf import OmegaConf

    try:
        node = OmegaConf.load(path)
        task = OmegaConf.select(node, "hydra.overrides.task")
    except Exception as e:
        raise ReportError(f"{path}: not a Hydra multirun.yaml: {e}") from None
    if task is None:
        raise ReportError(f"{path}: has no hydra.overrides.task")
    return [str(x) for x in task]


# --------------------------------------------------------------------------- runs


@dataclass
class Run:
    """One result directory (a single run, or one job of a multirun)."""

    path: Path
    label: str
    _tables: dict[str, Any] = field(default_factory=dict, repr=False)

    def table(self, name: str) -> Any:
        """The CSV (a DataFrame) or JSON file ``name`` of this run, read once."""
        if name not in self._tables:
            self._tables[name] = read_result_file(self.path / name)
        return self._tables[name]


@dataclass
class Source:
    """The runs an experiment's figures are read from, and where they came from."""

    kind: str                   # "latest" | "committed" | "path"
    root: Path
    runs: list[Run]
    date: str                   # when the results were written (UTC)
    machine: str
    command: str


def read_result_file(path: Path) -> Any:
    """A CSV as a DataFrame, a JSON document as Python objects; errors name the file."""
    if not path.is_file():
        raise ReportError(f"{path}: missing")
    if path.suffix == ".json":
        try:
            return json.loads(path.read_text())
        except (OSError, ValueError) as e:
            raise ReportError(f"{path}: not valid JSON: {e}") from None
    if path.suffix == ".csv":
        import pandas as pd

        try:
            df = pd.read_csv(path)
        except Exception as e:
            raise ReportError(f"{path}: not a readable CSV: {e}") from None
        if df.empty:
            raise ReportError(f"{path}: has a header but no rows")
        return df
    raise ReportError(f"{path}: unknown result file type (expected .csv or .json)")


def _mtime(paths: Iterable[Path]) -> str:
    ts = max(p.stat().st_mtime for p in paths)
    return datetime.fromtimestamp(ts, UTC).strftime("%Y-%m-%d %H:%M UTC")


def machine_summary() -> str:
    """This machine in a few words: CPU model, CPU count, OS and architecture."""
    model = platform.processor() or "unknown CPU"
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                model = line.split(":", 1)[1].strip()
                break
    except OSError:
        pass
    return f"{model}, {os.cpu_count()} CPUs, {platform.system()} {platform.machine()}"


def _label(run_dir: Path, seed_key: str | None) -> str:
    """``<seed_key>=<value>`` from the run's resolved Hydra config, else the directory name."""
    cfg = run_dir / ".hydra" / "config.yaml"
    if seed_key and cfg.is_file():
        from omegaconf import OmegaConf

        try:
            val = OmegaConf.select(OmegaConf.load(cfg), seed_key)
        except Exception as e:
            raise ReportError(f"{cfg}: not a readable Hydra config: {e}") from None
        if val is not None:
            return f"{seed_key}={val}"
    return run_dir.name


def _has_files(d: Path, files: Sequence[str]) -> bool:
    return all((d / f).is_file() for f in files)


def find_latest(results_root: Path, command: Command, files: Sequence[str],
                seed_key: str | None) -> Source | None:
    """The newest run of ``command`` under ``results_root/<job>/`` that has every file in
    ``files``; ``None`` when there is none. Runs whose overrides differ are skipped."""
    job_dir = results_root / command.job
    if not job_dir.is_dir():
        return None
    want = _relevant(command.overrides)

    def stamp(d: Path) -> str:
        return d.name.removeprefix("multirun_")

    for d in sorted((p for p in job_dir.iterdir() if p.is_dir()), key=stamp, reverse=True):
        if command.multirun:
            spec = d / "multirun.yaml"
            if not d.name.startswith("multirun_") or not spec.is_file():
                continue
            if _relevant(_multirun_overrides(spec)) != want:
                continue
            jobs = sorted((j for j in d.iterdir() if j.is_dir() and j.name.isdigit()),
                          key=lambda j: int(j.name))
            if not jobs or not all(_has_files(j, files) for j in jobs):
                continue
            runs = [Run(j, _label(j, seed_key)) for j in jobs]
        else:
            ov = d / ".hydra" / "overrides.yaml"
            if d.name.startswith("multirun_") or not ov.is_file():
                continue
            if _relevant(_read_overrides(ov)) != want or not _has_files(d, files):
                continue
            runs = [Run(d, _label(d, seed_key))]
        date = _mtime(r.path / f for r in runs for f in files)
        return Source("latest", d, runs, date, f"{machine_summary()} (the machine that "
                      "generated the report; outputs/ is local)", command.text)
    return None


def load_committed(root: Path) -> Source | None:
    """The committed copy ``root`` (``results/<experiment>/``) with its provenance."""
    prov = root / PROVENANCE
    if not prov.is_file():
        return None
    doc = read_result_file(prov)
    try:
        runs = [Run(root / r["dir"], str(r["label"])) for r in doc["runs"]]
        return Source("committed", root, runs, str(doc["date"]), str(doc["machine"]),
                      str(doc["command"]))
    except (KeyError, TypeError) as e:
        raise ReportError(f"{prov}: missing or malformed field {e}") from None


def _explicit(path: Path, command: Command, files: Sequence[str], seed_key: str | None
              ) -> Source:
    """A result directory named by ``report.paths``: a committed copy, a multirun
    directory (its numbered jobs) or a single run directory."""
    if not path.is_dir():
        raise ReportError(f"report.paths: {path} is not a directory")
    if (path / PROVENANCE).is_file():
        src = load_committed(path)
        assert src is not None
        src.kind = "path"
        return src
    jobs = sorted((j for j in path.iterdir() if j.is_dir() and j.name.isdigit()),
                  key=lambda j: int(j.name))
    dirs = jobs or [path]
    for d in dirs:
        missing = [f for f in files if not (d / f).is_file()]
        if missing:
            raise ReportError(f"report.paths: {d} lacks {missing}")
    runs = [Run(d, _label(d, seed_key)) for d in dirs]
    return Source("path", path, runs, _mtime(r.path / f for r in runs for f in files),
                  f"{machine_summary()} (the machine that generated the report)",
                  command.text)


# --------------------------------------------------------------------------- values


def _select(df: Any, where: Mapping[str, Any], path: Path) -> Any:
    missing = [c for c in where if c not in df.columns]
    if missing:
        raise ReportError(f"{path}: no column {missing} (columns: {list(df.columns)})")
    mask = None
    for col, val in where.items():
        s = df[col]
        if isinstance(val, (int, float)) and not isinstance(val, bool):
            try:
                m = (s.astype(float) - float(val)).abs() < 1e-9
            except (TypeError, ValueError):
                raise ReportError(f"{path}: column {col!r} is not numeric") from None
        else:
            m = s.astype(str) == str(val)
        mask = m if mask is None else mask & m
    return df if mask is None else df[mask]


def _aggregate(values: Any, agg: Any, path: Path, what: str) -> float:
    import numpy as np

    try:
        x = np.asarray(values, dtype=float)
    except (TypeError, ValueError):
        raise ReportError(f"{path}: {what} is not numeric") from None
    if x.size == 0:
        raise ReportError(f"{path}: no value for {what}")
    if isinstance(agg, Mapping):
        (name, arg), = agg.items()
        if name == "fraction_at_least":
            return float(np.mean(x >= float(arg)))
        raise ReportError(f"unknown aggregation {name!r} for {what}")
    if agg in (None, "mean"):
        return float(np.mean(x))
    if agg == "std":  # sample standard deviation
        return float(np.std(x, ddof=1)) if x.size > 1 else float("nan")
    if agg == "pstd":  # population standard deviation (e.g. over all service nodes)
        return float(np.std(x, ddof=0))
    if agg in ("sum", "max", "min", "median"):
        return float(getattr(np, agg)(x))
    if agg == "one":
        if x.size != 1:
            raise ReportError(f"{path}: {what} matches {x.size} rows, expected one")
        return float(x[0])
    raise ReportError(f"unknown aggregation {agg!r} for {what}")


def _leaf_values(spec: Mapping[str, Any], runs: Sequence[Run], what: str
                 ) -> list[tuple[str, float]]:
    """One value per run, or per ``spec.per`` group of each run (e.g. per seed column)."""
    out = []
    file = spec.get("file")
    column = spec.get("column")
    if not file or not column:
        raise ReportError(f"{what}: `ours` needs `file` and `column`")
    for run in runs:
        path = run.path / file
        df = run.table(file)
        if isinstance(df, (dict, list)):
            raise ReportError(f"{path}: a JSON file; `ours` reads CSV tables")
        sel = _select(df, dict(spec.get("where") or {}), path)
        if column not in df.columns:
            raise ReportError(f"{path}: no column {column!r} (columns: {list(df.columns)})")
        if sel.empty:
            raise ReportError(f"{path}: no row with {dict(spec.get('where') or {})} "
                              f"(needed for {what})")
        label = f"{what} ({column})"
        per = spec.get("per")
        if per:
            if per not in df.columns:
                raise ReportError(f"{path}: no column {per!r} to group by")
            for key, g in sel.groupby(per, sort=True):
                out.append((f"{run.label}/{per}={key}" if len(runs) > 1 else f"{per}={key}",
                            _aggregate(g[column], spec.get("agg"), path, label)))
        else:
            out.append((run.label, _aggregate(sel[column], spec.get("agg", "one"), path,
                                              label)))
    return out


def row_values(ours: Mapping[str, Any], runs: Sequence[Run], what: str
               ) -> list[tuple[str, float]]:
    """Our values of one table row: a leaf (``file``, ``where``, ``column``, ``agg``,
    ``per``) or a ``ratio`` of two leaves, paired by run (and ``per`` group); then
    ``value * scale + offset``."""
    if "ratio" in ours:
        parts = ours["ratio"]
        if not isinstance(parts, Sequence) or len(parts) != 2:
            raise ReportError(f"{what}: `ratio` needs [numerator, denominator]")
        base = {k: v for k, v in ours.items() if k not in ("ratio", "scale", "offset")}
        num = _leaf_values({**base, **parts[0]}, runs, what)
        den = dict(_leaf_values({**base, **parts[1]}, runs, what))
        vals = [(k, v / den[k] if den.get(k) else float("nan")) for k, v in num]
    else:
        vals = _leaf_values(ours, runs, what)
    scale, offset = float(ours.get("scale", 1.0)), float(ours.get("offset", 0.0))
    return [(k, v * scale + offset) for k, v in vals]


def _stats(values: Sequence[float]) -> tuple[float, float, int]:
    vals = [v for v in values if not math.isnan(v)]
    if not vals:
        return float("nan"), float("nan"), 0
    sd = statistics.stdev(vals) if len(vals) > 1 else float("nan")
    return statistics.fmean(vals), sd, len(vals)


# --------------------------------------------------------------------------- page


def _heading(anchor: str, text: str) -> str:
    """A level-2 heading with a stable anchor (an HTML id, no markdown extension needed)."""
    return f'<a id="{anchor}"></a>\n\n## {text}'


def _fmt(v: float, fmt: str) -> str:
    return "n/a" if math.isnan(v) else fmt.format(v)


def _ours_cell(values: Sequence[tuple[str, float]], fmt: str, unit: str) -> tuple[str, str]:
    mean, sd, n = _stats([v for _, v in values])
    unit_s = f" {unit}" if unit else ""
    if n == 0:
        return "n/a", "0"
    if n == 1:
        return f"{_fmt(mean, fmt)}{unit_s}", "1"
    return f"{_fmt(mean, fmt)} ± {_fmt(sd, fmt)}{unit_s}", str(n)


def _paper_cell(paper: Mapping[str, Any], fmt: str, unit: str) -> str:
    if paper.get("value") is not None:
        val = paper["value"]
        text = f"{val:g}" if isinstance(val, (int, float)) else str(val)  # as the paper has it
        return f"{text} {unit}".strip()
    return str(paper.get("claim", "-"))


def _status(fig: Mapping[str, Any]) -> str:
    st = fig.get("reproduced", True)
    return {True: "reproduced", False: "not reproduced", "partly": "partly reproduced"}.get(
        st, str(st))


def _rel(path: Path, root: Path) -> str:
    try:
        return str(path.resolve().relative_to(root.resolve()))
    except ValueError:
        return str(path)


def _figure_section(fig: Mapping[str, Any], exp: Mapping[str, Any], src: Source | None,
                    img_dir: Path, root: Path) -> list[str]:
    fid = fig["id"]
    lines = [_heading(fid, f"{fig['paper']} {fig['figure']}: {fig['title']}"), ""]
    status = _status(fig)
    lines += [f"**Status: {status}.**" + (f" {fig['reason'].strip()}" if fig.get("reason")
                                          else ""), ""]
    if src is None:
        lines += ["**No results yet.** Run", "", "```bash", exp["command"], "```", "",
                  "then `make report`. The paper's numbers:", ""]
    rows = fig.get("rows") or []
    if rows:
        hdr = ["quantity", "paper", "where in the paper"]
        if src is not None:
            hdr += ["ours (mean ± std)", "n"]
        lines += ["| " + " | ".join(hdr) + " |", "|" + "---|" * len(hdr)]
        for i, row in enumerate(rows):
            what = str(row.get("what") or f"{fid} row {i}")
            fmt = str(row.get("fmt", "{:.2f}"))
            unit = str(row.get("unit", ""))
            paper = row.get("paper") or {}
            cells = [what, _paper_cell(paper, fmt, unit), str(paper.get("where", "-"))]
            if src is not None:
                if row.get("ours"):
                    vals = row_values(row["ours"], src.runs, f"{fid}: {what}")
                    cells += list(_ours_cell(vals, fmt, unit))
                else:
                    cells += ["-", "-"]
            lines.append("| " + " | ".join(c.replace("|", "\\|") for c in cells) + " |")
        lines.append("")
    if src is not None:
        lines += _plots(fid, str(fig["figure"]), fig.get("plots") or [], src, img_dir)
        seeds = ("runs: " + ", ".join(r.label for r in src.runs) + "." if len(src.runs) > 1
                 else "one run" + ("" if src.runs[0].label == src.root.name
                                   else f" ({src.runs[0].label})")
                 + " (where a row's n is above 1, its values are the seeds inside the run).")
        where = {"latest": "latest run", "committed": "committed copy", "path": "given path"}
        lines += ["Command:", "", "```bash", src.command, "```", "",
                  f"Result: `{_rel(src.root, root)}` ({where[src.kind]}); written "
                  f"{src.date}; machine: {src.machine}; {seeds}", ""]
        if exp.get("scale"):
            lines += [f"Scale: {' '.join(str(exp['scale']).split())}", ""]
    if fig.get("explanation"):
        lines += ["**Why the numbers differ.** " + str(fig["explanation"]).strip(), ""]
    return lines


def _plots(sid: str, caption: str, plots: Sequence[str], src: Source, img_dir: Path
           ) -> list[str]:
    """Each of ``plots`` of the source's first run copied into ``img_dir`` and embedded."""
    lines: list[str] = []
    first = src.runs[0]
    for p in plots:
        f = first.path / p
        if not f.is_file():
            raise ReportError(f"{f}: plot missing (listed in {sid}.plots)")
        name = f"{sid}__{Path(p).name}"
        shutil.copyfile(f, img_dir / name)
        lines += [f"![{caption}: {Path(p).stem}](img/{name})", "",
                  f"*Plot of {first.label}.*" if len(src.runs) > 1 else "", ""]
    return lines


def _project_section(item: Mapping[str, Any], src: Source | None, exp: Mapping[str, Any],
                     root: Path, img_dir: Path) -> list[str]:
    lines = [_heading(item["id"], str(item["title"])), "",
             str(item.get("text", "")).strip(), ""]
    if src is None:
        return [*lines, "**No results yet.** Run", "", "```bash", exp["command"], "```", "",
                "then `make report`.", ""]
    key = item.get("across_runs")
    df = (src.runs[0].table(item["file"]) if key is None
          else across_runs([r.table(item["file"]) for r in src.runs], str(key)))
    cols = list(item.get("columns") or df.columns)
    if key is not None:
        cols = [c for c in cols if c != "runs"] + ["runs"]
    missing = [c for c in cols if c not in df.columns]
    if missing:
        raise ReportError(f"{src.runs[0].path / item['file']}: no column {missing}")
    lines += ["| " + " | ".join(cols) + " |", "|" + "---|" * len(cols)]
    digits = int(item.get("digits", 3))
    for _, r in df.iterrows():
        cells = [_cell(r, c, digits) for c in cols]
        lines.append("| " + " | ".join(cells) + " |")
    if item.get("plots"):
        lines += ["", *_plots(str(item["id"]), str(item["title"]).split(":")[0],
                              item["plots"], src, img_dir)]
    if key is not None:
        lines += ["", f"Mean over the {len(src.runs)} runs ({', '.join(r.label for r in src.runs)})"
                  f" ± the 95% interval across them, where they differ.", ""]
    lines += ["", "Command:", "", "```bash", src.command, "```", "",
              f"Result: `{_rel(src.root, root)}`; written {src.date}; machine: {src.machine}.",
              ""]
    return lines


def across_runs(tables: Sequence[pd.DataFrame], key: str) -> pd.DataFrame:
    """One row per value of ``key`` (in first appearance): each numeric column's mean over
    the runs that have the row, its 95% interval across them in ``<column>±``, and ``runs``,
    how many; other columns from the first run."""
    import pandas as pd

    whole = pd.concat(tables, ignore_index=True)
    order = list(dict.fromkeys(whole[key]))
    rows = []
    for k in order:
        g = whole[whole[key] == k]
        row: dict[str, Any] = {key: k, "runs": len(g)}
        for c in whole.columns:
            if c == key:
                continue
            v = pd.to_numeric(g[c], errors="coerce")
            if v.notna().all() and pd.api.types.is_numeric_dtype(whole[c]):
                row[c] = float(v.mean())
                row[f"{c}±"] = ci95(v.to_numpy()) if v.nunique() > 1 else 0.0
            else:
                row[c] = g[c].iloc[0]
        rows.append(row)
    return pd.DataFrame(rows)


def _cell(r: pd.Series, c: str, digits: int) -> str:
    v = r[c]
    if not isinstance(v, float):
        return str(v)
    if math.isnan(v):
        return "n/a"
    half = r.get(f"{c}±")
    text = f"{v:,.{digits}f}"
    return text + (f" ± {half:,.{digits}f}" if isinstance(half, float) and half > 0 else "")


def resolve_source(name: str, exp: Mapping[str, Any], rep: Mapping[str, Any]) -> Source | None:
    """The runs of experiment ``name`` according to ``report.source`` and ``report.paths``."""
    where = f"experiments.{name}"
    if "command" not in exp:
        raise ReportError(f"{where}: needs a `command`")
    cmd = Command.parse(str(exp["command"]), where)
    files = [str(f) for f in (exp.get("files") or [])]
    seed_key = exp.get("seed_key")
    explicit = (rep.get("paths") or {}).get(name)
    if explicit:
        return _explicit(Path(str(explicit)), cmd, files, seed_key)
    mode = str(rep.get("source", "auto"))
    if mode not in ("auto", "latest", "committed"):
        raise ReportError(f"report.source must be auto, latest or committed, not {mode!r}")
    if mode in ("auto", "latest"):
        src = find_latest(Path(str(rep["results_root"])), cmd, files, seed_key)
        if src is not None or mode == "latest":
            return src
    return load_committed(Path(str(rep["committed_root"])) / name)


def collect(name: str, exp: Mapping[str, Any], src: Source, dest_root: Path) -> Path:
    """Copy the result files ``src`` holds for experiment ``name`` (and the first run's
    plots) into ``dest_root/<name>/`` with a ``provenance.json``; returns that directory."""
    dest = dest_root / name
    tmp = Path(tempfile.mkdtemp(prefix=f".{name}-", dir=dest_root))
    runs = []
    for i, run in enumerate(src.runs):
        plots = (exp.get("plots") or []) if i == 0 else []  # the page shows the first run's
        for f in [*(exp.get("files") or []), *plots]:
            s = run.path / f
            if s.is_file():
                (tmp / str(i) / f).parent.mkdir(parents=True, exist_ok=True)
                shutil.copy2(s, tmp / str(i) / f)
        runs.append({"dir": str(i), "label": run.label, "source": str(run.path)})
    (tmp / PROVENANCE).write_text(json.dumps(
        {"experiment": name, "command": src.command, "date": src.date,
         "machine": src.machine.split(" (the machine")[0], "source": str(src.root),
         "runs": runs}, indent=2) + "\n")
    _swap_dir(tmp, dest)
    return dest


def _swap_dir(new: Path, dest: Path) -> None:
    """Replace ``dest`` by ``new`` (the old one is removed only after the new is in place)."""
    old = dest.with_name(f".{dest.name}.old")
    if old.exists():
        shutil.rmtree(old)
    if dest.exists():
        dest.rename(old)
    new.rename(dest)
    if old.exists():
        shutil.rmtree(old)


def build_report(cfg: Mapping[str, Any], root: Path) -> dict[str, Any]:
    """Write the report page (and the benchmark page); returns what each figure used."""
    rep = cfg["report"]
    exps = cfg.get("experiments") or {}
    out_dir = Path(str(rep["out_dir"]))
    sources: dict[str, Source | None] = {}
    for name, exp in exps.items():
        sources[name] = resolve_source(name, exp, rep)
    out_dir.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=".report-", dir=out_dir.parent))
    try:
        img = tmp / "img"
        img.mkdir()
        body: list[str] = []
        index = ["| paper | figure | what | status | results |", "|---|---|---|---|---|"]
        for fig in cfg.get("figures") or []:
            for key in ("id", "paper", "figure", "title"):
                if key not in fig:
                    raise ReportError(f"figures: an entry lacks `{key}`: {dict(fig)}")
            exp_name = fig.get("experiment")
            if (fig.get("reproduced", True) is not False or exp_name) and exp_name not in exps:
                raise ReportError(f"figures.{fig['id']}: unknown experiment {exp_name!r}")
            exp = exps.get(exp_name, {}) if exp_name else {}
            src = sources.get(exp_name) if exp_name else None
            if exp_name:
                body += _figure_section(fig, exp, src, img, root)
            else:
                body += [_heading(fig["id"], f"{fig['paper']} {fig['figure']}: {fig['title']}"),
                         "", f"**Status: {_status(fig)}.** {str(fig.get('reason', '')).strip()}",
                         ""]
            res = "-" if not exp_name else ("missing" if src is None else src.kind)
            index.append(f"| {fig['paper']} | [{fig['figure']}](#{fig['id']}) | {fig['title']}"
                         f" | {_status(fig)} | {res} |")
        project = []
        for item in cfg.get("project") or []:
            exp = exps.get(item.get("experiment"))
            if exp is None:
                raise ReportError(f"project.{item.get('id')}: unknown experiment "
                                  f"{item.get('experiment')!r}")
            project += _project_section(item, sources[item["experiment"]], exp, root, img)
        head = [f"# {cfg.get('title', 'Reproduction report')}", "",
                str(cfg.get("intro", "")).strip(), "", *index, ""]
        if cfg.get("other_papers"):
            head += ["Papers without a reproduced figure:", ""]
            head += [f"* **{p['paper']}**: {' '.join(str(p['reason']).split())}"
                     for p in cfg["other_papers"]]
            head.append("")
        text = "\n".join(head + body + project).rstrip() + "\n"
        while "\n\n\n" in text:
            text = text.replace("\n\n\n", "\n\n")
        (tmp / "index.md").write_text(text)
        if rep.get("collect"):
            dest_root = Path(str(rep["committed_root"]))
            dest_root.mkdir(parents=True, exist_ok=True)
            for name, src in sources.items():
                if src is not None and src.kind == "latest":
                    collect(name, exps[name], src, dest_root)
        _swap_dir(tmp, out_dir)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    bench = rep.get("benchmarks")
    if bench:
        write_benchmarks([Path(str(d)) for d in bench["dirs"]], Path(str(bench["out"])),
                         collect_to=Path(str(bench["collect_to"])) if rep.get("collect")
                         and bench.get("collect_to") else None)
    return {name: (None if s is None else {"kind": s.kind, "root": str(s.root)})
            for name, s in sources.items()}


# --------------------------------------------------------------------------- benchmarks


def benchmark_section(name: str, doc: Mapping[str, Any] | None, rc: int = 0) -> list[str]:
    """The markdown section of one benchmark result (``bench/results/<name>.json``): when,
    on which machine, with which command, its table and notes."""
    lines = [f"## {name}", ""]
    if rc != 0 or doc is None:
        return [*lines, f"Failed (exit {rc}); see its output." if rc else
                f"No result yet: `python bench/{name}.py`.", ""]
    m = doc.get("machine") or {}
    quick = bool((doc.get("settings") or {}).get("quick"))
    cmd = doc.get("command") or f"python bench/{name}.py" + (" --quick" if quick else "")
    cpu = f"{m.get('cpu_model', '?')} ({m.get('cpu_count', '?')} CPUs"
    if m.get("affinity") is not None:
        cpu += f", affinity {m['affinity']}"
    cpu += ")"
    if doc.get("gpu"):
        cpu += f" with an {doc['gpu']} GPU"
    lines += [f"Measured {m.get('timestamp', '?')} on {cpu}; commit {m.get('git_commit', '?')}"
              + ("; **quick settings, not representative**" if quick else "") + ".", "",
              f"Command: `{cmd}`", "", str(doc.get("table_md", "")), ""]
    lines += [f"* {n}" for n in doc.get("notes", [])]
    return [*lines, ""] if doc.get("notes") else lines


def format_benchmarks(docs: Mapping[str, Mapping[str, Any] | None], title: str,
                      preamble: Sequence[str] = (),
                      status: Mapping[str, tuple[int, float]] | None = None) -> str:
    """A benchmark page: ``title``, ``preamble`` lines, an optional status table (exit code
    and run time per benchmark, from ``bench/run_all.py``) and one section per benchmark."""
    lines = [f"# {title}", "", *preamble]
    if status:
        lines += ["| benchmark | exit | run time s | quick |", "|---|---|---|---|"]
        for n, (rc, wall) in status.items():
            doc = docs.get(n)
            q = "-" if doc is None else (doc.get("settings") or {}).get("quick")
            lines.append(f"| {n} | {rc} | {wall:.0f} | {q} |")
    for name, doc in docs.items():
        lines += ["", *benchmark_section(name, doc, (status or {}).get(name, (0, 0.0))[0])]
    text = "\n".join(lines).rstrip() + "\n"
    while "\n\n\n" in text:
        text = text.replace("\n\n\n", "\n\n")
    return text


def load_benchmarks(dirs: Sequence[Path]) -> dict[str, dict[str, Any]]:
    """Benchmark results by name; a name found in several ``dirs`` is taken from the first
    (``bench/results`` before the committed copies)."""
    docs: dict[str, dict[str, Any]] = {}
    for d in dirs:
        if not d.is_dir():
            continue
        for p in sorted(d.glob("bench_*.json")):
            if p.stem in docs:
                continue
            doc = read_result_file(p)
            if not isinstance(doc, dict) or "table_md" not in doc or "machine" not in doc:
                raise ReportError(f"{p}: not a benchmark result (needs table_md and machine)")
            docs[p.stem] = doc
    return docs


# an absolute path that leads into a repository's own folders (on whatever machine or clone
# wrote it): the part before the folder goes, so pages name paths from the repository root
_ABS_INTO_REPO = re.compile(r"(?<![\w.:/~-])/(?:[^\s/,;()'\"`\[\]]+/)+?"
                            r"(?=(?:outputs|bench/results|results|checkpoints|datasets|mlruns)/)")


def repo_relative(text: str) -> str:
    """``text`` with every absolute path into a repository's ``outputs/``, ``results/``,
    ``bench/results/``, ``checkpoints/``, ``datasets/`` or ``mlruns/`` written from the
    repository root (URLs are left alone)."""
    return _ABS_INTO_REPO.sub("", text)


def write_benchmarks(dirs: Sequence[Path], out: Path, collect_to: Path | None = None) -> Path:
    """``docs/benchmarks.md`` from the benchmark results in ``dirs`` (temp file, then
    replace); with ``collect_to`` the result files found are copied there too."""
    docs = load_benchmarks(dirs)
    pre = ["Generated by `make report` from the benchmarks' result files "
           "(`bench/results/<name>.json`, written by `make bench` or `python bench/<name>.py`; "
           "committed copies in `results/bench/`). Each table gives the machine it was "
           "measured on; timings depend on it and on what else ran there.", ""]
    if not docs:
        pre += ["No benchmark results yet: run `make bench`.", ""]
    text = repo_relative(format_benchmarks(docs, "Benchmarks", pre))
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = out.with_name(f".{out.name}.tmp")
    tmp.write_text(text)
    os.replace(tmp, out)
    if collect_to is not None:
        collect_to.mkdir(parents=True, exist_ok=True)
        for d in dirs:
            for p in d.glob("bench_*.json") if d.is_dir() else ():
                if p.parent.resolve() != collect_to.resolve() and (
                        not (collect_to / p.name).exists()
                        or p.stat().st_mtime > (collect_to / p.name).stat().st_mtime):
                    shutil.copy2(p, collect_to / p.name)
    return out


def main(cfg: Mapping[str, Any], root: Path) -> int:
    """Build the report; print what each experiment used; 1 with the message on a
    :class:`ReportError`."""
    import sys

    try:
        used = build_report(cfg, root)
    except ReportError as e:
        print(f"report: error: {e}", file=sys.stderr, flush=True)
        return 1
    for name, u in used.items():
        print(f"report: {name}: " + ("no results (the page says how to make them)" if u is None
                                     else f"{u['kind']} {_rel(Path(u['root']), root)}"),
              flush=True)
    print(f"report: wrote {_rel(Path(str(cfg['report']['out_dir'])) / 'index.md', root)}",
          flush=True)
    return 0
