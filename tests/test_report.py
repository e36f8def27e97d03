"""The reproduction report (``report.py``, ``reporting/reproduction.py``): built from result
directories in a temporary tree, it lists every figure of ``configs/report.yaml``, reads ours
from the files (mean and spread over seeds), states the figures that are not reproduced and
those whose results are missing, picks the latest run of each command, keeps the previous
page when a result file is malformed, and needs neither torch nor Ray.

The fast tests write result files with the schema the entry points write; the slow test
runs the real ``shaping.py`` and ``trees.py`` with tiny settings (the CI smoke run)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import numpy as np
import pandas as pd
import pytest
from omegaconf import OmegaConf

from reporting.reproduction import ReportError, build_report, format_benchmarks

ROOT = Path(__file__).resolve().parents[1]
PNG = b"\x89PNG\r\n\x1a\n"  # the report copies plots; it does not decode them

if not OmegaConf.has_resolver("project_root"):
    OmegaConf.register_new_resolver("project_root", lambda: str(ROOT))


def _config(tmp: Path) -> dict:
    cfg = OmegaConf.load(ROOT / "configs" / "report.yaml")
    cfg.paths = {"root_dir": str(tmp)}
    del cfg["defaults"]
    out = OmegaConf.to_container(cfg, resolve=True)
    assert isinstance(out, dict)
    return out


def _hydra(run: Path, overrides: list[str], config: dict | None = None) -> None:
    (run / ".hydra").mkdir(parents=True, exist_ok=True)
    (run / ".hydra" / "overrides.yaml").write_text(OmegaConf.to_yaml(overrides))
    (run / ".hydra" / "config.yaml").write_text(OmegaConf.to_yaml(config or {}))


def _plots(run: Path, names: list[str]) -> None:
    for n in names:
        (run / n).parent.mkdir(parents=True, exist_ok=True)
        (run / n).write_bytes(PNG)


def _sweep(outputs: Path, cfg: dict, stamp: str = "2030-01-01_00-00-00") -> Path:
    exp = cfg["experiments"]["sweep"]
    words = exp["command"].split()[3:]  # python sweep.py -m <overrides>
    d = outputs / "sweep" / f"multirun_{stamp}"
    d.mkdir(parents=True)
    (d / "multirun.yaml").write_text(OmegaConf.to_yaml(
        {"hydra": {"overrides": {"task": [*words, "progress=false"]}}}))
    for seed in range(3):
        run = d / str(seed)
        _hydra(run, [w.replace("0,1,2", str(seed)) for w in words],
               {"scenario": {"seed": seed}})
        rows = [{"multicast_share": s, "policy": p, "ctrl_traffic_mbps": 1000.0 * (1 + i + seed),
                 "sent_msgs_per_s": 10.0 + i, "total_node_mbps": 2000.0 + 100 * i,
                 "max_node_mbps": 30.0 + i}
                for s in (0.0, 0.5, 1.0)
                for i, p in enumerate(("rpc", "vita", "idcs", "alcor", "greedy"))]
        pd.DataFrame(rows).to_csv(run / "sweep_summary.csv", index=False)
        _plots(run, exp["plots"])
    return d


def _shaping(outputs: Path, cfg: dict, stamp: str = "2030-01-01_00-00-00",
             overrides: list[str] | None = None, drop: str | None = None) -> Path:
    run = outputs / "shaping" / stamp
    _hydra(run, overrides or [])
    rng = np.random.default_rng(0)
    rows = [{"tenants": t, "policy": p, "seed": s, "setup_time_mean_s": 0.003 * t * (1 + j),
             "setup_time_first_tenant_s": 0.003, "setup_time_last_tenant_s": 0.003 * t,
             "read_tput_std_Bps": 2e4 + 1e3 * rng.random(),
             "write_tput_std_Bps": 2e4 + 1e3 * rng.random()}
            for t in (1, 2, 3, 4) for j, p in enumerate(("none", "static", "sincon"))
            for s in (11, 12, 13)]
    df = pd.DataFrame(rows)
    (df.drop(columns=[drop]) if drop else df).to_csv(run / "runs.csv", index=False)
    _plots(run, cfg["experiments"]["shaping"]["plots"])
    return run


def _trees(outputs: Path, cfg: dict) -> Path:
    run = outputs / "trees" / "2030-01-01_00-00-00"
    _hydra(run, [])
    pd.DataFrame([{"topology": t, "hypervisors": n, "receiving_rate_gbps": v * n / 14}
                  for t, v in (("path", 7.2), ("binary", 5.5), ("ternary", 4.4), ("star", 1.6))
                  for n in (2, 14)]).to_csv(run / "fig8.csv", index=False)
    schemes = ("algorithm1", "algorithm1_paper", "random10", "nvp", "binary")
    groups = [{"scheme": sc, "seed": s, "group": g, "ratio": min(1.0, 0.5 + 0.1 * g),
               "k": 1 + g % 3} for sc in schemes for s in (0, 1) for g in range(6)]
    pd.DataFrame(groups).to_csv(run / "groups.csv", index=False)
    loads = [{"scheme": sc, "seed": s, "service_node": n, "workload_gbps": 1.0 + n * (i + 1)}
             for i, sc in enumerate(schemes) for s in (0, 1) for n in range(4)]
    pd.DataFrame(loads).to_csv(run / "workloads.csv", index=False)
    lam = [{**r, "lam": v} for v in (0.3, 30.0) for r in groups if r["scheme"] == "algorithm1"]
    pd.DataFrame(lam).to_csv(run / "fig11_groups.csv", index=False)
    lw = [{**r, "lam": v} for v in (0.3, 30.0) for r in loads if r["scheme"] == "algorithm1"]
    pd.DataFrame(lw).to_csv(run / "fig11_workloads.csv", index=False)
    _plots(run, cfg["experiments"]["trees"]["plots"])
    return run


def _bench(tmp: Path) -> None:
    d = tmp / "bench" / "results"
    d.mkdir(parents=True)
    doc = {"benchmark": "bench_x", "machine": {"timestamp": "2030-01-01T00:00:00+00:00",
                                                "cpu_model": "Test CPU", "cpu_count": 2},
           "settings": {"quick": False}, "table_md": "| a |\n|---|\n| 1 |",
           "notes": ["a note"]}
    (d / "bench_x.json").write_text(json.dumps(doc))


@pytest.fixture
def tree(tmp_path: Path) -> tuple[Path, dict]:
    cfg = _config(tmp_path)
    outputs = tmp_path / "outputs"
    _sweep(outputs, cfg)
    _shaping(outputs, cfg)
    _trees(outputs, cfg)
    _bench(tmp_path)
    return tmp_path, cfg


def test_every_figure_with_paper_and_ours(tree):
    tmp, cfg = tree
    used = build_report(cfg, tmp)
    page = (tmp / "docs" / "report" / "index.md").read_text()
    for fig in cfg["figures"]:
        assert f'<a id="{fig["id"]}"></a>' in page
        assert f"[{fig['figure']}](#{fig['id']})" in page
    # ours from the files: RPC's controller traffic at 50% over the 3 seeds = 1, 2, 3 Gbps
    assert ("| RPC, 50% multicast | 5.82 Gbps | Section VII-C, text on Figs. 5-8 "
            "| 2.00 ± 1.00 Gbps | 3 |") in page
    # a ratio per seed, then scale and offset: 100 (1 - greedy / rpc)
    assert "| -244.4 ± 138.8 % | 3 |" in page
    # Sincon: per-seed rows of one run give n = 3
    assert "| setup time, no shaping over Sincon, 4 tenants | 2.9 x |" in page
    assert "scenario.seed=0, scenario.seed=1, scenario.seed=2" in page
    # not reproduced, stated as such, with the reason
    sincon6 = page.split('<a id="sincon-fig6"></a>')[1].split("<a id=")[0]
    assert "**Status: not reproduced.**" in sincon6
    trees9 = page.split('<a id="trees-fig9"></a>')[1].split("<a id=")[0]
    assert "**Status: not reproduced.**" in trees9 and "nearly half" in trees9
    # missing results: the command to run, the paper's numbers, no number of ours
    smart9 = page.split('<a id="smart-fig9"></a>')[1].split("<a id=")[0]
    assert "**No results yet.**" in smart9 and "python testbed.py" in smart9
    assert "ours (mean" not in smart9 and "| 3.1 x |" in smart9
    assert "**No results yet.**" in page.split('<a id="online-yardstick"></a>')[1]
    assert "python train.py agent=baselines" in page
    assert used["testbed_fig9"] is None and used["sweep"]["kind"] == "latest"
    assert (tmp / "docs" / "report" / "img" / "smart-fig5__fig5_controller_traffic.png").is_file()
    bench = (tmp / "docs" / "benchmarks.md").read_text()
    assert "## bench_x" in bench and "Test CPU (2 CPUs)" in bench
    assert "Command: `python bench/bench_x.py`" in bench and "* a note" in bench


def test_project_results_table(tree):
    tmp, cfg = tree
    run = tmp / "outputs" / "train" / "2030-01-01_00-00-00"
    _hydra(run, ["agent=baselines"])
    cols = cfg["project"][0]["columns"]
    pd.DataFrame([{c: (p if c == "policy" else 1.5) for c in cols}
                  for p in ("oracle", "greedy")]).to_csv(run / "summary.csv", index=False)
    build_report(cfg, tmp)
    page = (tmp / "docs" / "report" / "index.md").read_text()
    section = page.split('<a id="online-yardstick"></a>')[1].split("<a id=")[0]
    assert "| " + " | ".join(cols) + " |" in section and "| greedy | 1.500 |" in section
    assert "**No results yet.**" in page.split('<a id="main-job"></a>')[1]


def test_latest_run_of_the_command(tree):
    tmp, cfg = tree
    outputs = tmp / "outputs"
    # a newer smoke run with other settings is not the figure's run; a newer matching one is
    _shaping(outputs, cfg, "2030-02-01_00-00-00", overrides=["seeds=1", "logger=none"])
    build_report(cfg, tmp)
    page = (tmp / "docs" / "report" / "index.md").read_text()
    assert "outputs/shaping/2030-01-01_00-00-00" in page
    _shaping(outputs, cfg, "2030-03-01_00-00-00", overrides=["progress=false"])
    build_report(cfg, tmp)
    page = (tmp / "docs" / "report" / "index.md").read_text()
    assert "outputs/shaping/2030-03-01_00-00-00" in page


def test_collect_then_committed(tree):
    tmp, cfg = tree
    cfg["report"]["collect"] = True
    build_report(cfg, tmp)
    prov = json.loads((tmp / "results" / "sweep" / "provenance.json").read_text())
    assert prov["command"].startswith("python sweep.py -m")
    assert [r["label"] for r in prov["runs"]] == [f"scenario.seed={s}" for s in range(3)]
    assert (tmp / "results" / "bench" / "bench_x.json").is_file()
    first = (tmp / "docs" / "report" / "index.md").read_text()
    cfg["report"].update(collect=False, source="committed")
    used = build_report(cfg, tmp)
    assert used["shaping"]["kind"] == "committed"
    page = (tmp / "docs" / "report" / "index.md").read_text()
    assert "(committed copy)" in page
    # the same numbers from the copies as from the runs
    strip = [ln for ln in first.splitlines() if ln.startswith("| RPC, 50%")]
    assert strip and all(ln in page for ln in strip)


def test_malformed_result_keeps_the_previous_page(tree):
    tmp, cfg = tree
    build_report(cfg, tmp)
    index = tmp / "docs" / "report" / "index.md"
    before = index.read_text()
    _shaping(tmp / "outputs", cfg, "2030-04-01_00-00-00", drop="write_tput_std_Bps")
    with pytest.raises(ReportError,
                       match=r"2030-04-01_00-00-00/runs\.csv: no column 'write_tput_std_Bps'"):
        build_report(cfg, tmp)
    assert index.read_text() == before
    assert not list((tmp / "docs").glob(".report-*"))
    (tmp / "outputs" / "shaping" / "2030-04-01_00-00-00" / "runs.csv").write_text("")
    with pytest.raises(ReportError, match=r"runs\.csv: not a readable CSV"):
        build_report(cfg, tmp)


def test_report_py_exits_nonzero_without_torch_or_ray(tree):
    """The entry point: a clear message and exit 1 on a malformed file; torch and Ray are
    never imported."""
    tmp, _ = tree
    (tmp / "outputs" / "trees" / "2030-01-01_00-00-00" / "fig8.csv").write_text("a,b\n1,2\n")
    code = ("import runpy, sys\n"
            f"sys.argv = ['report.py', 'paths.root_dir={tmp}', 'hydra.run.dir={tmp}/r']\n"
            "try:\n    runpy.run_path('report.py', run_name='__main__')\n"
            "except SystemExit as e:\n    rc = e.code\nelse:\n    rc = 0\n"
            "print('HEAVY', sorted(m for m in ('torch', 'ray') if m in sys.modules))\n"
            "sys.exit(rc)\n")
    r = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True,
                       timeout=120, check=False)
    assert r.returncode == 1, r.stdout + r.stderr
    assert "fig8.csv: no column ['topology', 'hypervisors']" in r.stderr
    assert "HEAVY []" in r.stdout


def test_benchmark_formatter_shared_with_run_all():
    docs = {"bench_a": None, "bench_b": {"machine": {"timestamp": "t", "cpu_model": "C",
                                                     "cpu_count": 4}, "table_md": "T",
                                         "settings": {"quick": True}}}
    text = format_benchmarks(docs, "Benchmark summary", ["pre"],
                             status={"bench_a": (2, 1.0), "bench_b": (0, 3.0)})
    assert "| bench_a | 2 | 1 | - |" in text and "Failed (exit 2)" in text
    assert "Command: `python bench/bench_b.py --quick`" in text and "quick settings" in text


def test_the_benchmarks_page_names_paths_from_the_repository_root(tmp_path: Path):
    """A result written on another machine or clone names its files by absolute path; the
    page names them from the repository root (URLs and paths outside a repository's
    folders stay as they are)."""
    from reporting.reproduction import write_benchmarks

    res = tmp_path / "bench" / "results"
    res.mkdir(parents=True)
    (res / "bench_x.json").write_text(json.dumps({
        "benchmark": "bench_x", "machine": {"timestamp": "t", "cpu_model": "C", "cpu_count": 2},
        "table_md": "| a |\n|---|\n| /work/main/bench/results/x/raw.csv |",
        "notes": ["outputs: /srv/clone-2/outputs/testbed/run_1 (merged from "
                  "/work/main/results/testbed_fig9/0)", "see https://host/results/page",
                  "kept under /tmp/soak_hour/seed4"]}))
    text = write_benchmarks([res], tmp_path / "docs" / "benchmarks.md").read_text()
    assert "| bench/results/x/raw.csv |" in text
    assert "outputs: outputs/testbed/run_1 (merged from results/testbed_fig9/0)" in text
    assert "https://host/results/page" in text and "/tmp/soak_hour/seed4" in text
    assert "/work/main" not in text and "/srv/clone-2" not in text


@pytest.mark.slow
def test_smoke_from_the_real_entry_points(tmp_path: Path):
    """CI smoke: tiny real runs of ``shaping.py`` and ``trees.py``, then the report."""
    cfg = _config(tmp_path)
    small = {"shaping": ["tenants=[1,4]", "fig5_tenants=4", "seeds=2", "sim.duration_s=2.5"],
             "trees": ["seeds=[0,1]", "groups.num_groups=15", "lambdas=[0.3,30]",
                       "fig8.hypervisors=[2,14]"]}
    for job, ov in small.items():
        run = tmp_path / "outputs" / job / "2030-01-01_00-00-00"
        subprocess.run([sys.executable, f"{job}.py", *ov, "logger=none",
                        f"hydra.run.dir={run}"], cwd=ROOT, check=True, capture_output=True,
                       timeout=300)
        cfg["experiments"][job]["command"] = f"python {job}.py " + " ".join(ov)
    used = build_report(cfg, tmp_path)
    assert used["shaping"]["kind"] == used["trees"]["kind"] == "latest"
    page = (tmp_path / "docs" / "report" / "index.md").read_text()
    for fig in ("sincon-fig5", "sincon-fig6", "trees-fig8", "trees-fig9", "trees-fig11"):
        section = page.split(f'<a id="{fig}"></a>')[1].split("<a id=")[0]
        assert "ours (mean ± std)" in section and "n/a" not in section.split("Command:")[0]


def test_a_table_across_runs_gives_the_mean_and_the_interval_over_them():
    """``across_runs``: per key, each numeric column's mean over the runs and its 95%
    interval (0 where the runs agree), the other columns from the first run."""
    from reporting.reproduction import _cell, across_runs

    runs = [pd.DataFrame({"policy": ["greedy", "ddpg"], "mbps": [10.0, x], "status": ["ok"] * 2})
            for x in (20.0, 22.0, 24.0)]
    df = across_runs(runs, "policy").set_index("policy")
    assert list(df.index) == ["greedy", "ddpg"] and df.loc["ddpg", "runs"] == 3
    assert df.loc["greedy", "mbps"] == 10.0 and df.loc["greedy", "mbps±"] == 0.0
    assert df.loc["ddpg", "mbps"] == 22.0
    assert abs(df.loc["ddpg", "mbps±"] - 4.303 * 2 / 3 ** 0.5) < 1e-3  # t(0.975, 2) s / sqrt(n)
    assert df.loc["ddpg", "status"] == "ok"
    assert _cell(df.reset_index().iloc[1], "mbps", 1) == "22.0 ± 5.0"
    assert _cell(df.reset_index().iloc[0], "mbps", 1) == "10.0"
