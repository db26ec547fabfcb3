"""Tokens and secrets in one place: which token applies, how a request proves it, and how text loses secrets.

Every part of spotrl that needs the admin token (the driver, the learner's fleet calls, the rollout's
inference calls, the ingress) asks `admin_token` here, so the precedence is decided once: the
environment of the process (`SPOTRL_ADMIN_TOKEN`) wins, then a token handed over by whoever started
the process, then the run config. `redact` is what error messages and logs go through.
"""

from __future__ import annotations

import base64
import binascii
import hmac
import os
import re

ADMIN_TOKEN_ENV = "SPOTRL_ADMIN_TOKEN"

_SECRET_ENV = ("AWS_SECRET_ACCESS_KEY", "AWS_SESSION_TOKEN", "AWS_SECURITY_TOKEN", "AWS_ACCESS_KEY_ID", ADMIN_TOKEN_ENV)
_USERINFO = re.compile(r"(?<=://)[^/@\s]+@")


class Secret:
    """A token that never shows itself in a repr, a log line or an error message."""

    def __init__(self, value: str):
        self.value = value

    def __repr__(self) -> str:
        return "Secret(***)"

    __str__ = __repr__


def admin_token(cfg=None, handed_over: Secret | str | None = None) -> str | None:
    """The admin token: the process's environment, then a token handed over at start, then `fleet.admin_token`."""
    if isinstance(handed_over, Secret):
        handed_over = handed_over.value
    configured = cfg.fleet.admin_token if cfg is not None else None
    return os.environ.get(ADMIN_TOKEN_ENV) or handed_over or configured or None


def inference_token(cfg) -> str | None:
    """The token inference calls carry: the admin token, when the fleet protects inference too."""
    return admin_token(cfg) if cfg.fleet.protect_inference else None


def presented_token(authorization: str | None) -> str | None:
    """The secret in an Authorization header: a Bearer token, or the password of HTTP Basic auth.

    Basic is there for clients that send no header of their own but honour `~/.netrc` (TRL's
    `requests`-based client): a netrc line `machine HOST login any password TOKEN` authenticates it.
    """
    if not authorization:
        return None
    scheme, _, credentials = authorization.strip().partition(" ")
    credentials = credentials.strip()
    if scheme.lower() == "bearer":
        return credentials or None
    if scheme.lower() == "basic":
        try:
            decoded = base64.b64decode(credentials, validate=True).decode("utf-8")
        except (binascii.Error, UnicodeDecodeError):
            return None
        _, sep, password = decoded.partition(":")
        return password if sep else None
    return None


def token_matches(authorization: str | None, token: str) -> bool:
    given = presented_token(authorization)
    # Constant-time comparison: a timing side channel must not spell the token out.
    return given is not None and hmac.compare_digest(given.encode(), token.encode())


def redact(text: str, *secrets: str | None) -> str:
    """`text` without credentials: URL user-info, the values of the credential variables, and `secrets`."""
    text = _USERINFO.sub("***@", text)
    values = [os.environ.get(var) for var in _SECRET_ENV] + list(secrets)
    for value in values:
        if value and len(value) >= 8:  # shorter values would blank out innocent words of the message
            text = text.replace(value, "***")
    return text
