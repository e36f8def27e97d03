"""Shared fixtures and hypothesis strategies."""

from __future__ import annotations

import os

# gRPC's C core logs each refused TLS handshake (the negative tests make many) at INFO;
# set before anything imports grpc, inherited by the subprocesses tests start
os.environ.setdefault("GRPC_VERBOSITY", "ERROR")

import numpy as np
import pytest
from hypothesis import HealthCheck, settings
from hypothesis import strategies as st

from envs.dsmd.instance import DSMDInstance
from envs.dsmd.problems import build_problems
from envs.dsmd.scenarios import load_scenario


def pytest_configure(config) -> None:
    """One development PKI (:mod:`security.pki`) for the whole run, outside the user's own:
    set here in the controlling process, so every xdist worker and every subprocess a test
    starts inherits it (``$SMART_PKI_DIR``); and no server setting from the shell."""
    import os
    import tempfile

    from serving.api.settings import ServerSettings

    # the server's settings read SMART_<NAME> when not given: a shell's own (an exported
    # SMART_API_KEYS, SMART_AUTH) must not change what the tests construct
    for name in ServerSettings.model_fields:
        os.environ.pop(f"SMART_{name.upper()}", None)
    if os.environ.get("PYTEST_XDIST_WORKER") or os.environ.get("SMART_PKI_DIR"):
        return
    os.environ["SMART_PKI_DIR"] = tempfile.mkdtemp(prefix="smart-test-pki-")
    config._smart_pki_dir = os.environ["SMART_PKI_DIR"]


def pytest_unconfigure(config) -> None:
    import shutil

    d = getattr(config, "_smart_pki_dir", None)
    if d:
        shutil.rmtree(d, ignore_errors=True)


settings.register_profile("default", deadline=None, max_examples=60,
                          suppress_health_check=[HealthCheck.too_slow])
settings.load_profile("default")


@pytest.fixture(scope="session")
def tiny_problems():
    """The tiny scenario, generated in memory (no files)."""
    return build_problems(load_scenario("tiny"), cache_dir=None)


@pytest.fixture(scope="session")
def tiny_dataset(tiny_problems):
    return tiny_problems.dataset


@st.composite
def instances(draw, max_nodes: int = 8, max_types: int = 8, max_topics: int = 3,
              tight: bool = False) -> DSMDInstance:
    """Random small DSMD instances (optionally with binding capacities)."""
    n = draw(st.integers(1, max_nodes))
    m = draw(st.integers(1, max_types))
    k = draw(st.integers(0, max_topics))
    dests = [draw(st.lists(st.integers(0, n - 1), min_size=1, max_size=n, unique=True))
             for _ in range(m)]
    rates = [draw(st.integers(1, 10**7)) for _ in range(m)]
    fan = sum(len(d) for d in dests)
    if tight:
        cpu = draw(st.integers(m, max(m, fan)))
        fan_rate = sum(r * len(d) for r, d in zip(rates, dests))
        bw = draw(st.integers(max(sum(rates), 1), max(fan_rate, 1)))
        cap = draw(st.integers(10**6, 5 * 10**7))
    else:
        cpu, bw, cap = 10**9, 10**15, 10**12
    return DSMDInstance.from_sets(dests, rates, cap, k, bw, cpu, num_nodes=n)


def random_instance(seed: int, n: int = 30, m: int = 60, k: int = 5) -> DSMDInstance:
    rng = np.random.default_rng(seed)
    dests = [rng.choice(n, size=int(rng.integers(1, min(n, 8) + 1)), replace=False)
             for _ in range(m)]
    return DSMDInstance.from_sets(dests, rng.integers(1, 10**6, m), 3 * 10**6, k, 10**8, 400,
                                  num_nodes=n)


def export_tiny_online_bundle(directory, signing_key):
    """A seeded (untrained) online actor with the default knob map and cost, exported as an
    online policy bundle signed by ``signing_key`` (skipped without torch)."""
    torch = pytest.importorskip("torch")
    from agents.bundle_export import export_online_bundle
    from envs.dsmd.online import OnlineCost
    from envs.dsmd.online_control import OBS_SIZE, KnobMap

    torch.manual_seed(0)
    actor = torch.nn.Sequential(torch.nn.Linear(OBS_SIZE, 3), torch.nn.Tanh())
    return export_online_bundle(actor, KnobMap(), OnlineCost(), directory,
                                signing_key=signing_key)


def _export_tiny_bundle(directory, problems, seed: int, num_topics: int | None = None,
                        overwrite: bool = False):
    """A seeded (untrained) actor for the tiny scenario, exported as a policy bundle."""
    import torch

    from agents.bundle_export import export_bundle
    from agents.ddpg.networks import mlp
    from envs.dsmd.observation import ObservationLayout

    torch.manual_seed(seed)
    k = problems.spec.num_topics if num_topics is None else num_topics
    layout = ObservationLayout("channel", problems.catalog_size, problems.num_nodes, k)
    actor = mlp(layout.size, [32, 32], k + 1, torch.nn.Tanh())
    sig = problems.signature() | {"num_topics": k}
    return export_bundle(actor, layout, sig, directory, decoding="feasible",
                         extra={"algorithm": f"test-seed{seed}"}, overwrite=overwrite)


@pytest.fixture(scope="session")
def tiny_bundles(tmp_path_factory, worker_id, tiny_problems):
    """Two tiny-scenario bundles (different weights) and one for another K (mismatched).

    Exported once per test session (the exporter's first call costs seconds): under
    pytest-xdist the workers share one directory beside their own temporary roots, the first
    to take its lock exports and the others read. Tests only read them."""
    from filelock import FileLock

    if worker_id == "master":  # no xdist: this process's own directory
        root = tmp_path_factory.mktemp("bundles")
    else:
        root = tmp_path_factory.getbasetemp().parent / "tiny-bundles"
    paths = {"a": root / "a", "b": root / "b", "mismatched": root / "other_k"}
    with FileLock(str(root) + ".lock"):
        if not (root / "complete").exists():
            _export_tiny_bundle(paths["a"], tiny_problems, 0, overwrite=True)
            _export_tiny_bundle(paths["b"], tiny_problems, 1, overwrite=True)
            _export_tiny_bundle(paths["mismatched"], tiny_problems, 2, overwrite=True,
                                num_topics=tiny_problems.spec.num_topics + 1)
            (root / "complete").touch()
    return paths


def no_broker(reason: str) -> None:
    """Skip a broker test where Java or Maven is missing, but fail where a broker is required
    (``SMART_REQUIRE_BROKER=1``, as ``.ci/run`` sets it): CI must never skip these silently."""
    import os

    if os.environ.get("SMART_REQUIRE_BROKER") == "1":
        pytest.fail(f"a real Pulsar broker is required here but: {reason}")
    pytest.skip(f"no real Pulsar broker here: {reason}")


def start_or_skip(broker):
    """Start ``broker`` (a ``PulsarStandalone``) and return it; where Java or Maven is
    missing, close it and skip (or fail, see :func:`no_broker`)."""
    from harness.broker import JavaNotFoundError, MavenNotFoundError

    try:
        broker.start()
    except (JavaNotFoundError, MavenNotFoundError) as exc:
        broker.close()
        no_broker(str(exc))
    return broker


@pytest.fixture(scope="session")
def pulsar_broker():
    """One real Pulsar standalone broker (``harness.broker``) for the whole test session.

    Tests share it: each uses its own topic prefix (a uuid) and its own metadata store and
    record directory under ``tmp_path``. Secure (the default): TLS only, mutual-TLS
    authentication and the grant model of :mod:`security.pulsar`, with the session's PKI
    (``$SMART_PKI_DIR``); a client connects as a principal with
    ``pulsar.Client(broker.service_url, **broker.client_args(principal))``. Skipped where
    there is no Java or Maven."""
    pytest.importorskip("pulsar")
    from harness.broker import PulsarStandalone

    broker = start_or_skip(PulsarStandalone(progress=None))
    try:
        yield broker
    finally:
        broker.close()
