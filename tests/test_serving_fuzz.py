"""Fuzzing the OpenAPI document with schemathesis: no 5xx, no response outside the
documented status codes, content types and schemas, on every operation."""

from __future__ import annotations

import pytest
import schemathesis
from fastapi.testclient import TestClient
from hypothesis import HealthCheck, settings
from schemathesis.checks import not_a_server_error
from schemathesis.specs.openapi.checks import (
    content_type_conformance,
    response_schema_conformance,
    status_code_conformance,
)

from serving.app import ServerSettings, create_app
from serving.scenario import session_body

KEY, ADMIN = "fuzz-key-k7Qx2mW9pL4vR8nT3sY6bZ1cF5hJ0", "fuzz-admin-k7Qx2mW9pL4vR8nT3sY6bZ1cF5hJ0"
CHECKS = [not_a_server_error, status_code_conformance, content_type_conformance,
          response_schema_conformance]

_PS: list = []
APP = create_app(ServerSettings(api_keys=[KEY], admin_keys=[ADMIN], max_batch=50))
schema = schemathesis.openapi.from_asgi("/openapi.json", APP)


@pytest.fixture(scope="module")
def live_session(tiny_problems, tiny_bundles):
    """A policy and a session with rates, so fuzzed requests reach the decision code."""
    APP.state.store.load(tiny_bundles["a"])
    _PS.append(tiny_problems)
    with TestClient(APP) as c:
        r = c.post("/v1/sessions", json=session_body(tiny_problems,
                                                     tiny_problems.windows["test"][0]),
                   headers={"X-API-Key": ADMIN})  # the key the fuzzer uses: its own
        assert r.status_code == 201
        return r.json()["session_id"]


@schema.parametrize()
@settings(max_examples=25, deadline=None, suppress_health_check=list(HealthCheck))
def test_openapi_fuzz(case, live_session):
    if case.path_parameters and "session_id" in case.path_parameters:
        sid = live_session
        if case.method.upper() == "DELETE":  # a session of its own to delete
            with TestClient(APP) as c:
                sid = c.post("/v1/sessions", json=session_body(_PS[0]),
                             headers={"X-API-Key": ADMIN}).json()["session_id"]
        case.path_parameters["session_id"] = sid
    case.call_and_validate(headers={"X-API-Key": ADMIN}, checks=CHECKS)
