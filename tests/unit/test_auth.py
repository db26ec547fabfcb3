"""app.auth: token precedence, Authorization headers, redaction."""

import base64
from types import SimpleNamespace

from app.auth import Secret, admin_token, inference_token, presented_token, redact, token_matches


def _cfg(token=None, protect=False):
    return SimpleNamespace(fleet=SimpleNamespace(admin_token=token, protect_inference=protect))


def test_admin_token_precedence_environment_then_handed_over_then_config(monkeypatch):
    monkeypatch.delenv("SPOTRL_ADMIN_TOKEN", raising=False)
    assert admin_token(_cfg()) is None
    assert admin_token(_cfg("from-config")) == "from-config"
    assert admin_token(_cfg("from-config"), Secret("handed-over")) == "handed-over"
    monkeypatch.setenv("SPOTRL_ADMIN_TOKEN", "from-env")
    assert admin_token(_cfg("from-config"), Secret("handed-over")) == "from-env"


def test_inference_token_only_when_inference_is_protected(monkeypatch):
    monkeypatch.setenv("SPOTRL_ADMIN_TOKEN", "from-env")
    assert inference_token(_cfg(protect=False)) is None
    assert inference_token(_cfg(protect=True)) == "from-env"


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
