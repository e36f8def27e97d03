"""Install what you use: the policy server and the controller adapters (``pip install
'.[serve]'``) import neither torch, Ray, gymnasium, MLflow nor the training package
``agents``, and run on the bundle runtime alone (:mod:`serving.bundles.static`, ONNX Runtime): the
static endpoints and a whole online session (the online policy's boundary plans through
its executor, the placements during an interval, each interval's close)."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
#: what the serve group must not need (top-level module names)
TRAINING_STACK = ("torch", "ray", "agents", "gymnasium", "mlflow")

_BLOCKER = textwrap.dedent("""
    import importlib.abc
    import sys

    BLOCKED = {blocked!r}

    class Blocker(importlib.abc.MetaPathFinder):
        def find_spec(self, name, path=None, target=None):
            if name.split(".")[0] in BLOCKED:
                raise ImportError(f"{{name}} is blocked: the serve group does not install it")
            return None

    sys.meta_path.insert(0, Blocker())
""")

_SERVE = textwrap.dedent("""
    import sys

    import numpy as np

    import json

    import envs
    import serving
    import serving.client.static
    import serving.app
    import serving.client.online
    import serving.scenario
    from fastapi.testclient import TestClient

    from serving.app import ServerSettings, create_app
    from serving.bundles.static import load_bundle
    from serving.online_schemas import OnlineSessionCreate
    from serving.schemas import SessionCreate, request_body
    from serving.bundles.signing import BundleTrust

    bundle_dir = {bundle!r}
    # the committed bundle's signer (the development PKI is not needed for it)
    trust = BundleTrust.from_security(keys=[{key!r}], pki_key=False)
    app = create_app(ServerSettings(bundle=bundle_dir, auth=False, watch=False,
                                    freeze_gc=False, bundle_trust=trust))
    with TestClient(app) as client:  # the lifespan loads the bundle
        policy = client.get("/v1/policy").json()
        assert policy["loaded"] and policy["hash"], policy
    bundle = load_bundle(bundle_dir, trust=trust)
    assert bundle.signed_by in trust.keys, bundle.signed_by
    scores = bundle(np.zeros(bundle.layout.size, np.float32))
    assert scores.shape == (bundle.layout.num_topics + 1,), scores.shape
    assert np.isfinite(scores).all()
    # an online session served by the online policy, interval by interval
    online = json.loads({online!r})
    otrust = BundleTrust.from_security(keys=[{key!r}], pki_key=True)  # the run's PKI signed it
    app = create_app(ServerSettings(online_bundle=online["bundle"], auth=False, watch=False,
                                    freeze_gc=False, bundle_trust=otrust))
    step = int(online["interval_s"] * 1e9)
    t0 = online["messages"][0]["timestamp_ns"]
    with TestClient(app) as client:
        assert client.get("/v1/online/policy").json()["loaded"]
        r = client.post("/v1/online/sessions", json=online["create"] | {{"start_ns": t0}})
        assert r.status_code == 201, r.text
        base = f"/v1/online/sessions/{{r.json()['session_id']}}/intervals"
        placed = 0
        for w in range(online["windows"]):
            plan = client.get(f"{{base}}/{{w}}/plan").json()
            assert plan["source"] == "policy" and plan["knobs"] is not None, plan
            batch = [m for m in online["messages"]
                     if t0 + w * step <= m["timestamp_ns"] < t0 + (w + 1) * step]
            if batch:
                r = client.post(f"{{base}}/{{w}}/messages", json={{"messages": batch}})
                assert r.status_code == 200, r.text
                placed += len(r.json()["placed"])
            r = client.post(f"{{base}}/{{w}}/close")
            assert r.status_code == 200 and "cost" in r.json()["terms"], r.text
        assert placed > 0  # the executor placed types during the intervals
    loaded = sorted({{m.split(".")[0] for m in sys.modules}} & set({blocked!r}))
    assert not loaded, loaded
    print("serve group ok:", bundle.layout, scores.shape, "online intervals:",
          online["windows"], "placed:", placed)
""")


def online_case(directory: Path, windows: int = 3) -> str:
    """An online bundle (a seeded, untrained actor over the default executor, exported with
    torch here, signed with the run's PKI) and the ``tiny`` scenario's first messages, for
    a serve-only interpreter to serve (JSON)."""
    import json

    import torch

    from agents.bundle_export import export_online_bundle
    from envs.dsmd.message import messages_from_trace
    from envs.dsmd.online import OnlineCost
    from envs.dsmd.online_control import OBS_SIZE, KnobMap
    from envs.dsmd.problems import build_problems
    from envs.dsmd.scenarios import load_scenario
    from serving.online_schemas import MessageIn

    torch.manual_seed(0)
    actor = torch.nn.Sequential(torch.nn.Linear(OBS_SIZE, 3), torch.nn.Tanh())
    path = export_online_bundle(actor, KnobMap(), OnlineCost(), directory / "online",
                                overwrite=True)
    spec = load_scenario("tiny")
    ps = build_problems(spec, cache_dir=None)
    msgs = messages_from_trace(ps.dataset.trace)
    end = msgs[0].timestamp_ns + windows * int(spec.interval_s * 1e9)
    topo = ps.dataset.topology
    create = {"nodes": [{"id": int(i), "capacity_bps": int(c)} for i, c in
                        zip(topo.node_ids.tolist(), topo.bandwidth_bps.tolist())],
              "controller": {"bandwidth_bps": spec.controller_bw_bps,
                             "cpu": spec.controller_cpu},
              "num_topics": spec.num_topics, "interval_s": spec.interval_s}
    return json.dumps({"bundle": str(path), "interval_s": spec.interval_s, "windows": windows,
                       "create": create,
                       "messages": [MessageIn.of(m) for m in msgs if m.timestamp_ns < end]})


def _script(blocked: tuple[str, ...], bundle: Path, online: str) -> str:
    key = ROOT / "configs" / "keys" / "example-bundle.pub"
    return _BLOCKER.format(blocked=blocked) + _SERVE.format(blocked=blocked, bundle=str(bundle),
                                                            key=str(key), online=online)


def test_serving_runs_without_the_training_stack(tmp_path):
    """In a fresh interpreter where torch, Ray, ``agents``, gymnasium and MLflow cannot be
    imported: ``serving`` and its server and adapters import, the app starts and loads
    ``checkpoints/default`` (its signature verified against the committed example key), the
    bundle scores an observation, an online session is served interval by interval by an
    online bundle (plans, placements, closes), and none of the blocked packages was
    imported."""
    script = _script(TRAINING_STACK, ROOT / "checkpoints" / "default", online_case(tmp_path))
    r = subprocess.run([sys.executable, "-c", script], cwd=ROOT, capture_output=True,
                       text=True, timeout=300, check=False)
    assert r.returncode == 0, r.stdout + r.stderr
    assert "serve group ok" in r.stdout


@pytest.mark.slow
def test_serve_group_installs_without_torch_and_ray(tmp_path):
    """``uv pip install '.[serve]'`` (the lock as constraints) into a new virtual environment:
    torch, Ray, gymnasium and MLflow are not installed, and the server, the adapters, the
    bundle runtime and ``serve.py``'s configuration work there (run from outside the
    repository, so the installed package is what is imported)."""
    uv = [sys.executable, "-m", "uv"]  # `make setup` installs uv into the venv
    venv = tmp_path / "venv"
    py = venv / "bin" / "python"
    env = {k: v for k, v in os.environ.items() if k not in ("VIRTUAL_ENV", "PYTHONPATH")}
    subprocess.run([*uv, "venv", "-q", "--python", sys.executable, str(venv)], check=True,
                   env=env, timeout=300)
    r = subprocess.run([*uv, "pip", "install", "-q", "--python", str(py), "-c",
                        str(ROOT / "requirements.lock"), f"{ROOT}[serve]"],
                       capture_output=True, text=True, env=env, timeout=1200, check=False)
    assert r.returncode == 0, r.stdout + r.stderr
    absent = ("torch", "ray", "gymnasium", "mlflow")
    probe = ("import importlib.util as u; "
             f"print([m for m in {absent!r} if u.find_spec(m) is not None])")
    out = subprocess.run([str(py), "-c", probe], cwd=tmp_path, capture_output=True,
                         text=True, env=env, timeout=120, check=False)
    assert out.returncode == 0 and out.stdout.strip() == "[]", out.stdout + out.stderr
    # the installed package (cwd outside the repository), agents blocked as well
    script = _script(TRAINING_STACK, ROOT / "checkpoints" / "default", online_case(tmp_path))
    r = subprocess.run([str(py), "-c", script], cwd=tmp_path, capture_output=True, text=True,
                       env=env, timeout=600, check=False)
    assert r.returncode == 0, r.stdout + r.stderr
    where = subprocess.run([str(py), "-c", "import serving; print(serving.__file__)"],
                           cwd=tmp_path, capture_output=True, text=True, env=env, check=False)
    assert str(venv) in where.stdout, where.stdout + where.stderr
    # serve.py's Hydra configuration composes (it prints the job config without serving)
    r = subprocess.run([str(py), str(ROOT / "serve.py"), "--cfg", "job"], cwd=tmp_path,
                       capture_output=True, text=True, env=env, timeout=300, check=False)
    assert r.returncode == 0 and "bundle:" in r.stdout, r.stdout + r.stderr
