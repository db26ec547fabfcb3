"""Tokens and secrets in one place: which token applies, how a request proves it, and how text loses secrets.

Every part of spotrl that needs the admin token (the driver, the learner's fleet calls, the rollout's
inference calls, the ingress) asks `admin_token` here, so the precedence is decided once: the
environment of the process (`SPOTRL_ADMIN_TOKEN`) wins, then a token handed over by whoever started
the process, then the run config. `redact` is what error messages and logs go through.

What a token must be (`check_token`: 16 characters or more, a guessable one is no protection) and
when the fleet needs one at all (`check_exposure`: reachable beyond loopback, or inference
protected) are decided here too, so the config, the builder and the ingress refuse the same things.

Run tokens (a shared fleet's tenants, `deployments.control.runs`) are minted here too. They carry a fixed
prefix, so `redact` recognises one wherever it shows up, without having to know it; and the fleet
keeps only their sha256 (`token_digest`), so nothing it holds or logs can give a run's token away.

Whoever can write the bucket can write any run's prefix of it, so the fleet does not take a version's place in the
bucket as proof of whose it is: each lineage's versions are signed (`core.bucket.manifest`) with a key only the fleet
can derive (`lineage_key`, from its `signing_secret`), which it hands each run at its registration; replicas load
only what verifies under the key of the lineage it claims to be of.
"""

from __future__ import annotations

import base64
import binascii
import hashlib
import hmac
import ipaddress
import os
import re
import secrets

ADMIN_TOKEN_ENV = "SPOTRL_ADMIN_TOKEN"
MIN_TOKEN_CHARS = 16

_SECRET_ENV = ("AWS_SECRET_ACCESS_KEY", "AWS_SESSION_TOKEN", "AWS_SECURITY_TOKEN", "AWS_ACCESS_KEY_ID", ADMIN_TOKEN_ENV)
_USERINFO = re.compile(r"(?<=://)[^/@\s]+@")
RUN_TOKEN_PREFIX = "spotrl-run-"
_RUN_TOKEN = re.compile(re.escape(RUN_TOKEN_PREFIX) + r"[A-Za-z0-9_-]+")


class Secret:
    """A token that never shows itself in a repr, a log line or an error message."""

    def __init__(self, value: str):
        self.value = value

    def __repr__(self) -> str:
        return "Secret(***)"

    __str__ = __repr__


class TokenError(ValueError):
    """A missing or unusable admin token, with a one-line reason that never contains the token."""


def check_token(token: str, source: str) -> str:
    """`token` if it is usable as the admin token, else TokenError naming `source` (never the token)."""
    where = f"{source}: " if source else ""
    if len(token) < MIN_TOKEN_CHARS:
        raise TokenError(f"{where}the admin token must be at least {MIN_TOKEN_CHARS} characters")
    if token != token.strip():  # clients strip what they send: such a token could never match
        raise TokenError(f"{where}the admin token must not begin or end with whitespace")
    return token


def admin_token(cfg=None, handed_over: Secret | str | None = None) -> str | None:
    """The admin token: the process's environment, then a token handed over at start, then `fleet.admin_token`.

    `fleet.admin_token` is a pydantic SecretStr (unwrapped here, and only here); a token shorter than
    `MIN_TOKEN_CHARS` raises TokenError, wherever it comes from."""
    if isinstance(handed_over, Secret):
        handed_over = handed_over.value
    configured = cfg.fleet.admin_token if cfg is not None else None
    if configured is not None and not isinstance(configured, str):
        configured = configured.get_secret_value()
    for source, token in ((ADMIN_TOKEN_ENV, os.environ.get(ADMIN_TOKEN_ENV)), ("handed-over token", handed_over)):
        if token:
            return check_token(token, source)
    return check_token(configured, "fleet.admin_token") if configured else None


def is_loopback(host: str) -> bool:
    """Whether an HTTP server bound to `host` is reachable from this machine only (0.0.0.0 is every interface)."""
    if host.strip("[]").lower() == "localhost":
        return True
    try:
        return ipaddress.ip_address(host.strip("[]")).is_loopback
    except ValueError:  # a host name: it may resolve to anything
        return False


def check_exposure(host: str, protect_inference: bool, token: str | None) -> None:
    """Refuse (TokenError) a fleet that would be open to others: one bound beyond loopback, or one whose
    inference is to be protected, needs a token; without one, anyone who reaches it could load adapters."""
    hint = f"set {ADMIN_TOKEN_ENV} ({MIN_TOKEN_CHARS}+ characters) where the fleet is deployed"
    if protect_inference and not token:
        raise TokenError(f"fleet.protect_inference needs an admin token: {hint}")
    if not token and not is_loopback(host):
        raise TokenError(f"fleet host {host} is reachable beyond this machine: {hint}, or bind 127.0.0.1")


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


def mint_run_token() -> str:
    """A new run token: the prefix `redact` knows, then 256 random bits."""
    return RUN_TOKEN_PREFIX + secrets.token_urlsafe(32)


def token_digest(token: str) -> str:
    """What the fleet keeps of a run token: its sha256 (a 256-bit random token needs no slow hash)."""
    return hashlib.sha256(token.encode()).hexdigest()


def redact(text: str, *hidden: str | None) -> str:
    """`text` without credentials: URL user-info, the values of the credential variables, run tokens, `hidden`."""
    text = _RUN_TOKEN.sub("***", _USERINFO.sub("***@", text))
    values = [os.environ.get(var) for var in _SECRET_ENV] + list(hidden)
    for value in values:
        if value and len(value) >= 8:  # shorter values would blank out innocent words of the message
            text = text.replace(value, "***")
    return text


def signing_secret(admin_token: str | None) -> Secret:
    """The fleet's signing secret, from its admin token: the same across redeploys with that token, known to nobody
    without it. A fleet without an admin token protects nothing from its local callers (every one of them is its
    admin), so its secret is a fixed one: signatures there only keep a version's lineage straight."""
    key = (admin_token or "").encode()
    return Secret(hmac.new(key, b"spotrl fleet signing secret v1", hashlib.sha256).hexdigest())


def lineage_key(secret: Secret, run: str | None) -> Secret:
    """The key that run `run`'s versions are signed with (None: the fleet's own lineage `policy-vN`)."""
    return Secret(hmac.new(bytes.fromhex(secret.value), f"lineage:{run or ''}".encode(), hashlib.sha256).hexdigest())
