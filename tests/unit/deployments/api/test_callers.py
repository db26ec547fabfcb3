"""Who a caller is and what it may do (`deployments.api.callers`): the admin token as Bearer or Basic, inference
open or protected, a run's token reaching its own adapters only, and admin calls never from a browser."""

import base64

from fastapi.testclient import TestClient

from deployments.api import make_app
from tests.support.fake_fleet import ADMIN, BASE, TOKEN, FakeBackend, api_settings, bearer, load, register, sample


def _basic(password, user="trl"):
    return {"Authorization": "Basic " + base64.b64encode(f"{user}:{password}".encode()).decode()}


def test_admin_calls_need_the_token_as_bearer_or_basic(client):
    body = {"lora_name": "policy-v1", "lora_path": "adapters/policy-v1"}
    for headers in (
        {},
        {"Authorization": "Bearer wrong"},
        _basic("wrong"),
        {"Authorization": "Token " + TOKEN},
        {"Authorization": "Basic !!notbase64"},
    ):
        r = client.post("/v1/load_lora_adapter", json=body, headers=headers)
        assert r.status_code == 401, headers
        assert TOKEN not in r.text
        assert "Basic" in r.headers["www-authenticate"]
    assert client.post("/pause", headers={"Authorization": "Bearer wrong"}).status_code == 401
    assert (
        client.post("/v1/load_lora_adapter", json=body, headers={"Authorization": f"Bearer {TOKEN}"}).status_code == 200
    )
    assert client.post("/v1/load_lora_adapter", json=body, headers=_basic(TOKEN)).status_code == 200
    # Inference stays open unless the config switch closes it.
    assert client.post("/v1/completions", json={"model": BASE, "prompt": [1], "max_tokens": 1}).status_code == 200


def test_protect_inference_puts_generation_behind_the_token(backend):
    client = TestClient(make_app(backend, api_settings(protect_inference=True)))
    body = {"model": BASE, "prompt": [1], "max_tokens": 1}
    assert client.post("/v1/completions", json=body).status_code == 401
    assert client.get("/v1/models").status_code == 401
    assert client.post("/v1/completions", json=body, headers=_basic(TOKEN)).status_code == 200
    assert client.get("/health").status_code == 200  # liveness stays open for load balancers


def test_without_a_token_admin_calls_are_open(backend):
    client = TestClient(make_app(backend, api_settings(admin_token=None)))
    assert client.post("/resume").status_code == 200


def test_admin_posts_must_declare_json(client):
    """A web page cannot send a CORS "simple" request that changes the fleet (text/plain, a form, or a body-less
    fetch, which always carries Origin); clients that are no browser send JSON, or nothing at all (TRL's /pause)."""
    auth = {"Authorization": f"Bearer {TOKEN}"}
    body = '{"lora_name": "policy-v1", "lora_path": "adapters/policy-v1"}'
    for headers, content in (
        ({"content-type": "text/plain"}, body),
        ({"content-type": "application/x-www-form-urlencoded"}, "lora_name=policy-v1&lora_path=x"),
        ({"content-type": "multipart/form-data; boundary=x"}, "--x--"),
        ({}, body),  # a body with no type at all
    ):
        r = client.post("/v1/load_lora_adapter", content=content, headers={**auth, **headers})
        assert r.status_code == 415, (headers, r.text)
    for path in ("/pause", "/resume", "/reset_prefix_cache", "/v1/unload_lora_adapter"):
        assert client.post(path, headers={**auth, "content-type": "text/plain"}).status_code == 415, path
        assert client.post(path, headers={**auth, "Origin": "http://evil.example"}).status_code == 415, path
    json_type = {**auth, "content-type": "application/json; charset=utf-8"}
    assert client.post("/v1/load_lora_adapter", content=body, headers=json_type).status_code == 200
    assert client.post("/pause", headers=auth).status_code == 200  # TRL: requests.post(url, params=...)
    assert client.post("/resume", headers=auth).status_code == 200
    # Without a token the content type is the only guard, and it holds.
    open_fleet = TestClient(make_app(FakeBackend(), api_settings(admin_token=None)))
    assert open_fleet.post("/pause", headers={"content-type": "text/plain"}).status_code == 415


def test_a_run_token_reaches_the_base_model_and_its_own_adapters_only(fleet):
    backend, client = fleet
    alice, bob = register(client, "alice"), register(client, "bob")
    backend.adapters = {0: {"policy-v1", "alice/policy-v1", "bob/policy-v1"}, 1: {"alice/policy-v1", "bob/policy-v1"}}
    mine = bearer(alice)
    assert sample(client, BASE, mine).status_code == 200
    assert sample(client, "tiny", mine).status_code == 200  # the base model's alias
    assert sample(client, "alice/policy-v1", mine).status_code == 200
    for other in ("bob/policy-v1", "policy-v1"):
        r = sample(client, other, mine)
        assert r.status_code == 403 and "only its own adapters" in r.json()["error"]["message"], other
    chat = {"model": "bob/policy-v1", "messages": [{"role": "user", "content": "ab"}], "max_tokens": 1}
    assert client.post("/v1/chat/completions", json=chat, headers=mine).status_code == 403
    assert [m["id"] for m in client.get("/v1/models", headers=mine).json()["data"]] == [BASE, "alice/policy-v1"]
    assert all(s["adapters"] == [] for s in client.get("/engine/stats", headers=mine).json()["replicas"])

    assert load(client, "alice/policy-v2", mine).status_code == 200
    for other in ("bob/policy-v2", "policy-v2", "trl-policy-v2"):
        r = load(client, other, mine)
        assert r.status_code == 403 and "own adapters (alice/<name>)" in r.json()["error"]["message"], other
        r = client.post("/v1/unload_lora_adapter", json={"lora_name": other}, headers=mine)
        assert r.status_code == 403, other
    assert (
        client.post("/v1/unload_lora_adapter", json={"lora_name": "alice/policy-v2"}, headers=mine).status_code == 200
    )
    for path in ("/pause", "/resume", "/reset_prefix_cache"):  # they stop or change every run's work
        assert client.post(path, headers=mine).status_code == 403, path
    assert "bob/policy-v1" in {a for r in backend.adapters.values() for a in r}  # bob's untouched throughout

    # Without a token (inference is open): the fleet's own adapters, never a run's.
    assert sample(client, "policy-v1").status_code == 200
    assert sample(client, "alice/policy-v1").status_code == 403
    assert [m["id"] for m in client.get("/v1/models").json()["data"]] == [BASE, "policy-v1"]
    # The admin: everything.
    assert sample(client, "bob/policy-v1", ADMIN).status_code == 200
    assert len(client.get("/v1/models", headers=ADMIN).json()["data"]) == 4
    assert load(client, "bob/policy-v2", ADMIN).status_code == 200
    assert sample(client, "bob/policy-v1", bearer(bob)).status_code == 200
