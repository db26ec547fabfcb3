"""The admin token is a secret everywhere, and the fleet refuses to start where it would be open to others.

One known token value is looked for in everything that could show it: config dumps (trackio's run config is
`model_dump(mode="json")`), reprs, the arguments the fleet's deployments are built with (the run config the
replicas and the ingress get, which Serve keeps and shows), config errors, `serve run` overrides, and the log
records and error bodies of an app run whose errors quote the token.
"""

import json
import logging
import pickle

import pytest
from fastapi.testclient import TestClient

from contracts.auth import Secret, TokenError, admin_token
from contracts.serving import BadRequest
from core.config import ConfigError, load_config
from deployments.api import make_app
from tests.support.fake_fleet import FakeBackend, api_settings

KNOWN = "known-token-value-7c1e9a"


@pytest.fixture(autouse=True)
def no_env_token(monkeypatch):
    monkeypatch.delenv("SPOTRL_ADMIN_TOKEN", raising=False)


def _cfg(*overrides):
    return load_config(None, [f"fleet.admin_token={KNOWN}", *overrides])


def test_the_config_never_shows_the_token_but_auth_reads_it():
    cfg = _cfg()
    assert admin_token(cfg) == KNOWN  # app.auth unwraps the SecretStr: the one reader
    shown = [
        json.dumps(cfg.model_dump(mode="json")),  # trackio's run config, the deployments' config argument
        repr(cfg.model_dump()),
        repr(cfg),
        str(cfg),
        repr(cfg.fleet),
        cfg.fleet.model_dump_json(),
    ]
    assert not [text for text in shown if KNOWN in text]
    assert cfg.model_dump(mode="json")["fleet"]["admin_token"] is None


def test_short_tokens_are_refused_by_the_config_in_one_line_that_does_not_quote_them():
    with pytest.raises(ConfigError) as err:
        load_config(None, ["fleet.admin_token=short-token-1"])
    assert str(err.value) == "fleet.admin_token: the admin token must be at least 16 characters"
    cfg = _cfg()
    with pytest.raises(ValueError) as err:  # assignment is validated too, and hides its input
        cfg.fleet.admin_token = "short-token-2"
    assert "short-token-2" not in str(err.value)


def test_the_deployments_arguments_never_carry_the_token_in_the_clear():
    from deployments.fleet import fleet_app

    ingress = fleet_app(_cfg().own_fleet(), "/models/tiny")._bound_deployment
    replica = ingress.init_args[0]._bound_deployment
    # The replicas get the run config without the token; nothing of theirs holds it, pickled or not.
    assert KNOWN.encode() not in pickle.dumps(replica.init_args)
    assert KNOWN not in json.dumps(ingress.init_args[4])  # the ingress's run config (Serve keeps it)
    # The ingress gets it once, as a Secret, which shows no value in any repr or log line.
    (secret,) = [a for a in ingress.init_args if isinstance(a, Secret) and a.value == KNOWN]
    assert KNOWN not in repr(ingress.init_args) and KNOWN not in str(secret)
    # Beside it, and to every replica, the signing secret derived from it: one value, never the token's.
    (signing,) = [a for a in ingress.init_args if isinstance(a, Secret) and a.value != KNOWN]
    assert [a.value for a in replica.init_args if isinstance(a, Secret)] == [signing.value]


def test_serve_run_overrides_may_not_carry_the_token():
    from launch.serve import build_app

    with pytest.raises(ConfigError) as err:
        build_app({"config": "configs/tiny-cpu.yaml", "overrides": [f"fleet.admin_token={KNOWN}"]})
    assert KNOWN not in str(err.value) and "SPOTRL_ADMIN_TOKEN" in str(err.value)


class LeakyBackend(FakeBackend):
    """A backend whose errors quote the token, as a careless replica message might."""

    async def generate(self, request):
        if request.model == "boom":
            raise RuntimeError(f"engine state dump: token={KNOWN}")
        if request.model == "bad":
            raise BadRequest(f"refused {KNOWN}")
        return await super().generate(request)


def test_error_bodies_and_logs_of_an_app_run_never_show_the_token(caplog):
    caplog.set_level(logging.DEBUG)
    client = TestClient(make_app(LeakyBackend(), api_settings(admin_token=KNOWN)), raise_server_exceptions=False)
    body = {"prompt": [1, 2], "max_tokens": 1}
    responses = [
        client.post("/v1/completions", json={**body, "model": "boom"}),  # 500
        client.post("/v1/completions", json={**body, "model": "bad"}),  # 400
        client.post("/v1/completions", json={**body, "model": KNOWN}),  # 404 naming the model
        client.post("/resume", headers={"Authorization": f"Bearer {KNOWN}x"}),  # 401
        client.post("/resume", headers={"Authorization": f"Bearer {KNOWN}", "content-type": "text/plain"}),  # 415
    ]
    assert [r.status_code for r in responses] == [500, 400, 404, 401, 415]
    assert not [r.text for r in responses if KNOWN in r.text]
    assert caplog.records and KNOWN not in caplog.text


@pytest.mark.parametrize(
    ("overrides", "reason"),
    [
        (["fleet.host=0.0.0.0"], "fleet host 0.0.0.0 is reachable beyond this machine"),
        (["fleet.host=10.1.2.3"], "reachable beyond this machine"),
        (["fleet.protect_inference=true"], "fleet.protect_inference needs an admin token"),
    ],
)
def test_the_fleet_refuses_to_start_open_to_others(overrides, reason):
    from deployments.fleet import fleet_app

    with pytest.raises(TokenError) as err:
        fleet_app(load_config(None, overrides).own_fleet(), "/models/tiny")
    assert reason in str(err.value) and "SPOTRL_ADMIN_TOKEN" in str(err.value) and "\n" not in str(err.value)
    fleet_app(_cfg(*overrides).own_fleet(), "/models/tiny")  # with a token it starts


def test_the_fleet_refuses_a_short_token_from_the_environment(monkeypatch):
    from deployments.fleet import fleet_app

    monkeypatch.setenv("SPOTRL_ADMIN_TOKEN", "short-env-token")
    with pytest.raises(TokenError, match="SPOTRL_ADMIN_TOKEN: the admin token must be at least 16 characters"):
        fleet_app(load_config(None).own_fleet(), "/models/tiny")
