"""Malformed request bodies are the client's error (400, category "user"), never a 500: the Tinker SDK retries a
server error without end, so a body that is not JSON, not a JSON object, or not a protobuf ForwardBackwardRequest
would otherwise hang its future for ever (issue 49). The app's routes parse the body before the service does
anything, so a stand-in service serves; forward_backward and retrieve_future are the real Service's."""

from __future__ import annotations

import types

import pytest

pytestmark = pytest.mark.quick


@pytest.fixture(scope="module")
def client():
    from fastapi.testclient import TestClient

    from mlora.service.app import Service, build_app

    class Standin:
        sampler = None

        def create_model(self, owner, body):  # a JSON object reaches the service; others stop before
            return {"owner": owner, "got": body}

        def __getattr__(self, name):  # every other call: a malformed body must never get this far
            def called(*args):
                raise AssertionError(f"service.{name} was called")
            return called

    service = Standin()
    service.forward_backward = types.MethodType(Service.forward_backward, service)
    service.retrieve_future = types.MethodType(Service.retrieve_future, service)
    return TestClient(build_app(service))


KEY = {"X-API-Key": "tml-malformed"}


@pytest.mark.parametrize("route,body,says", [
    ("create_model", b"{not json", "the body is not JSON"),
    ("session_heartbeat", b"[]", "session_id (a string) is missing"),
    ("session_heartbeat", b'{"session_id": 5}', "session_id (a string) is missing"),
    ("forward_backward", b"\xff\xff\xff\x0f", "the body is not a ForwardBackwardRequest"),
    ("retrieve_future", b"[1]", "malformed request: TypeError"),
    ("retrieve_future", b"{}", "malformed request: KeyError"),
])
def test_malformed_bodies_are_user_errors(client, route, body, says):
    r = client.post(f"/api/v1/{route}", content=body, headers=KEY)
    assert r.status_code == 400, r.text
    assert r.json()["category"] == "user" and says in r.json()["error"]


def test_a_well_formed_body_reaches_the_service(client):
    r = client.post("/api/v1/create_model", json={"base_model": "x"}, headers=KEY)
    assert r.status_code == 200 and r.json()["got"] == {"base_model": "x"}
