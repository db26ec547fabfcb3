"""The route recipe (`examples/route_tokenize.py`): its endpoint on the fleet's app (over the fake backend), named as
`fleet.routes` names it, beside the shipped routes and never in their place. A real fleet answers it in
tests/integration/test_fleet.py."""

import pytest
from fastapi.testclient import TestClient

from core.config import ConfigError, load_fleet_config
from deployments.api import make_app
from deployments.api.routing import Routes, route, route_factories
from examples.route_tokenize import Config, fleet_sets, parse, tokenize_routes
from tests.support.fake_fleet import ADMIN, FakeBackend, api_settings

NAME = "examples.route_tokenize:tokenize_routes"


def app(**settings):
    return TestClient(make_app(FakeBackend(), api_settings(**settings), routes=route_factories([NAME])))


def test_the_endpoint_counts_tokens_as_the_fleets_tokenizer_does():
    reply = app().post("/v1/tokenize", json={"text": "abc d"})
    assert reply.status_code == 200
    assert reply.json() == {"tokens": [0, 1, 2, 26, 3], "count": 5, "max_model_len": 32}


def test_it_checks_callers_and_bodies_as_every_inference_call_does():
    protected = app(protect_inference=True)
    assert protected.post("/v1/tokenize", json={"text": "a"}).status_code == 401
    assert protected.post("/v1/tokenize", json={"text": "a"}, headers=ADMIN).status_code == 200
    refused = app().post("/v1/tokenize", json={"text": "a", "extra": 1})
    assert refused.status_code == 400 and "extra" in refused.json()["error"]["message"]
    assert app().get("/health").status_code == 200  # the shipped routes are all still there


def test_a_route_that_would_shadow_the_fleets_own_is_refused():
    class Shadow(Routes):
        @route("GET", "/health")
        async def health(self):
            return {"status": "mine"}

    with pytest.raises(ValueError, match="Shadow answers GET /health, which the fleet does"):
        make_app(FakeBackend(), api_settings(), routes=[lambda parts: Shadow()])


def test_fleet_routes_names_it_and_a_name_that_does_not_import_is_refused():
    cfg = load_fleet_config("configs/fleet-tiny-cpu.yaml", fleet_sets(parse(["sets=[fleet.num_replicas=1]"])))
    assert cfg.fleet.routes == [NAME] and cfg.fleet.num_replicas == 1
    assert route_factories(cfg.fleet.routes) == [tokenize_routes]
    with pytest.raises(ValueError, match="'examples.nowhere:routes' cannot be imported"):
        route_factories(["examples.nowhere:routes"])
    with pytest.raises(ConfigError, match="fleet.routes: .*expected module:callable"):
        load_fleet_config(None, ["fleet.routes=[just_a_name]"])
    assert Config().keep_serving is False
