"""app.auth: token precedence and strength, when the fleet needs a token, Authorization headers, redaction."""

import base64
from types import SimpleNamespace

import pytest
from pydantic import SecretStr

from contracts.auth import (
    Secret,
    TokenError,
    admin_token,
    check_exposure,
    inference_token,
    presented_token,
    redact,
    token_matches,
)

FROM_CONFIG, HANDED_OVER, FROM_ENV = "from-config-0123456789", "handed-over-0123456789", "from-env-0123456789"


def _cfg(token=None, protect=False):
    secret = SecretStr(token) if token is not None else None  # as core.config.FleetConfig holds it
    return SimpleNamespace(fleet=SimpleNamespace(admin_token=secret, protect_inference=protect))


def test_admin_token_precedence_environment_then_handed_over_then_config(monkeypatch):
    monkeypatch.delenv("SPOTRL_ADMIN_TOKEN", raising=False)
    assert admin_token(_cfg()) is None
    assert admin_token(_cfg(FROM_CONFIG)) == FROM_CONFIG  # the config's SecretStr, unwrapped
    assert admin_token(_cfg(FROM_CONFIG), Secret(HANDED_OVER)) == HANDED_OVER
    monkeypatch.setenv("SPOTRL_ADMIN_TOKEN", FROM_ENV)
    assert admin_token(_cfg(FROM_CONFIG), Secret(HANDED_OVER)) == FROM_ENV


def test_inference_token_only_when_inference_is_protected(monkeypatch):
    monkeypatch.setenv("SPOTRL_ADMIN_TOKEN", FROM_ENV)
    assert inference_token(_cfg(protect=False)) is None
    assert inference_token(_cfg(protect=True)) == FROM_ENV


def test_short_tokens_are_refused_wherever_they_come_from_without_showing_them(monkeypatch):
    monkeypatch.setenv("SPOTRL_ADMIN_TOKEN", "short-env-tok")
    with pytest.raises(TokenError, match="SPOTRL_ADMIN_TOKEN: the admin token must be at least 16") as err:
        admin_token(_cfg())
    assert "short-env-tok" not in str(err.value)
    monkeypatch.delenv("SPOTRL_ADMIN_TOKEN")
    with pytest.raises(TokenError, match="at least 16"):
        admin_token(_cfg(), Secret("short-handed"))
    with pytest.raises(TokenError, match="whitespace"):
        admin_token(_cfg(), Secret(" padded-token-0123456789"))
    monkeypatch.setenv("SPOTRL_ADMIN_TOKEN", "")  # set but empty: no token, as before
    assert admin_token(_cfg()) is None


@pytest.mark.parametrize("host", ["127.0.0.1", "127.0.0.2", "localhost", "::1", "[::1]"])
def test_a_loopback_fleet_may_run_without_a_token(host):
    check_exposure(host, protect_inference=False, token=None)


@pytest.mark.parametrize("host", ["0.0.0.0", "::", "10.0.0.5", "fleet.example.com"])
def test_a_fleet_reachable_from_other_machines_needs_a_token(host):
    with pytest.raises(TokenError, match="reachable beyond this machine.*SPOTRL_ADMIN_TOKEN") as err:
        check_exposure(host, protect_inference=False, token=None)
    assert "\n" not in str(err.value)
    check_exposure(host, protect_inference=False, token=FROM_ENV)


def test_protect_inference_needs_a_token():
    with pytest.raises(TokenError, match="protect_inference needs an admin token"):
        check_exposure("127.0.0.1", protect_inference=True, token=None)
    check_exposure("127.0.0.1", protect_inference=True, token=FROM_ENV)


def test_secret_never_shows_itself():
    assert "abc" not in repr(Secret("abc")) and "abc" not in str(Secret("abc"))


def test_redact_removes_credentials_and_url_userinfo(monkeypatch):
    monkeypatch.setenv("AWS_SECRET_ACCESS_KEY", "super-secret-value-123")
    monkeypatch.setenv("AWS_ACCESS_KEY_ID", "AKIAEXAMPLEKEYID")
    text = redact("s3://user:pw@bkt/x signed with AKIAEXAMPLEKEYID and super-secret-value-123")
    assert "super-secret" not in text and "AKIAEXAMPLE" not in text and "pw@" not in text
    assert text.startswith("s3://***@bkt/x")


def test_redact_removes_given_secrets():
    assert redact("token hunter2-hunter2 leaked", "hunter2-hunter2") == "token *** leaked"


def _basic(password, user="trl"):
    return "Basic " + base64.b64encode(f"{user}:{password}".encode()).decode()


def test_presented_token_parsing():
    assert presented_token("Bearer abc") == "abc"
    assert presented_token("bearer   abc ") == "abc"
    assert presented_token(_basic("pw:with:colons")) == "pw:with:colons"
    assert presented_token("Basic " + base64.b64encode(b"no-colon").decode()) is None
    assert presented_token(None) is None and presented_token("Bearer") is None
    assert token_matches("Bearer abc", "abc") and not token_matches("Bearer abd", "abc")
