"""The API contract under schemathesis as a new user would run it: the CLI, every check
(``--checks all``) and every phase, the stateful one included (it follows the OpenAPI links
from session creation to the session operations), against a live server (``serve.py``
under uvicorn, HTTPS with the test run's PKI, a loaded bundle, a real key), at the default
body limit and resource limits. It must find nothing. Non-standard numbers, lone surrogates
and the other hostile inputs a schema-driven fuzzer does not send are
``tests/test_serving_hostile.py``'s."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from serving.local import LocalServer

pytestmark = pytest.mark.slow

KEY, ADMIN = (f"{n}-k7Qx2mW9pL4vR8nT3sY6bZ1cF5hJ0" for n in ("fuzz-live-key", "fuzz-live-admin"))
EXAMPLES = int(os.environ.get("SMART_FUZZ_EXAMPLES", "30"))


def test_schemathesis_all_checks_and_stateful_against_the_live_server(tmp_path, tiny_bundles):
    exe = Path(sys.executable).with_name("schemathesis")
    if not exe.exists():  # a test dependency: missing, this is a broken install, not a skip
        pytest.fail(f"the schemathesis CLI is not installed at {exe} "
                    f"(pip install -e '.[test]')")
    # the per-address limit on requests without a valid key (tested on its own) is lifted:
    # schemathesis sends hundreds of them, and a 429 where it checks for 401 is no finding
    with LocalServer(tiny_bundles["a"], tmp_path / "server", api_key=KEY,
                     admin_key=ADMIN, overrides=["max_batch=50", "max_sessions=200",
                                                 "auth_failures=null"]) as srv:
        # the admin key: the policy swap is fuzzed too (and its sessions are its own)
        cmd = [str(exe), "run", f"{srv.url}/openapi.json", "--checks", "all",
               "--phases", "examples,coverage,fuzzing,stateful",
               "--header", f"X-API-Key: {ADMIN}",
               "--tls-verify", str(srv.security.pki.ca_cert),
               "--max-examples", str(EXAMPLES), "--seed", "21", "--workers", "1",
               "--request-timeout", "30", "--suppress-health-check", "all",
               "--report", "junit", "--report-dir", str(tmp_path / "report")]
        run = subprocess.run(cmd, check=False, capture_output=True, text=True, timeout=1500,
                             cwd=tmp_path, env=os.environ | {"NO_COLOR": "1"})
    out = run.stdout + run.stderr
    assert run.returncode == 0, out[-20000:]
    assert "Stateful" in out or "stateful" in out, out[-5000:]
    assert srv.proc is not None and srv.proc.returncode is not None
