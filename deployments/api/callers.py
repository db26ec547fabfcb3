"""Who sent a request, and what they may do: the admin, a registered run, or anonymous.

A run's token (`deployments.control.runs`) may sample the base model and its own adapters (`<run>/...`,
`contracts.adapters`), load, unload and cut its own versions, and sees only those in `/v1/models`; anything of
another run is a 403. The admin token may do everything. A fleet without an admin token is open to
everyone on its machine, runs or not: tokens mean something only beside one.

Finding out who a caller is changes nothing. A run's request that uses the fleet (anything but a GET:
generations, loads, unloads, heartbeats) is its sign of life (`Runs.heard_from`); reading is not.

Admin calls are not for browsers: a web page the operator visits can send a CORS "simple" request
(a form, or a body-less `fetch`) to 127.0.0.1 without asking, with any cached Basic credentials;
it cannot send `Content-Type: application/json` cross-site without a preflight, which the fleet
never grants. So an admin call must declare JSON, except a body-less one (TRL's `/pause`,
`/resume`) from a client that is no browser: browsers always add `Origin` to a POST.
"""

from __future__ import annotations

from dataclasses import dataclass

from fastapi import Request
from starlette.datastructures import Headers

from contracts.adapters import split_run
from contracts.auth import presented_token, token_matches
from deployments.control.errors import ApiError
from deployments.control.fair_share import FLEET_TENANT
from deployments.control.runs import Runs


@dataclass(frozen=True)
class Caller:
    """Who sent a request: the admin (`admin`), a run (`run`), or neither (anonymous, open inference only)."""

    admin: bool = False
    run: str | None = None

    def may_use(self, model: str, base_model: str) -> bool:
        """Whether this caller may sample `model` (the base model's name, or an adapter's)."""
        if self.admin or model == base_model:
            return True
        owner, _ = split_run(model)
        return owner == self.run  # a run its own adapters; anonymous callers the un-namespaced ones

    def check_use(self, model: str, base_model: str) -> None:
        if not self.may_use(model, base_model):
            owner, _ = split_run(model)
            whose = f"run {owner!r}" if owner else "the fleet, not to a run"
            raise ApiError(403, f"model {model!r} belongs to {whose}; this token may use only its own adapters")

    def check_owns(self, name: str) -> None:
        """An adapter this caller may load, unload or cut: any for the admin, `<run>/...` for a run."""
        if self.admin:
            return
        owner, _ = split_run(name)
        if self.run is None or owner != self.run:
            mine = f"{self.run}/<name>" if self.run else "none"
            raise ApiError(403, f"adapter {name!r}: this token may load, unload and cut only its own adapters ({mine})")

    def check_admin(self, what: str) -> None:
        if not self.admin:
            raise ApiError(403, f"{what} needs the admin token (it affects every run on the fleet)")

    def check_run(self, name: str, what: str) -> None:
        """The admin, or run `name` itself (`what` it may do only for itself)."""
        if not self.admin and self.run != name:
            raise ApiError(403, f"run {name[:64]!r}: a run's token {what}")

    @property
    def tenant(self) -> str:
        """Whose share its generations count against: its run's, or the fleet's (the admin's and anonymous)."""
        return self.run or FLEET_TENANT


ADMIN = Caller(admin=True)
ANONYMOUS = Caller()


class Callers:
    """The callers of one fleet: its admin token (None: everyone is the admin), its runs, whether inference is
    behind the token too."""

    def __init__(self, admin_token: str | None, runs: Runs, protect_inference: bool = False):
        self.admin_token, self.runs, self.protect_inference = admin_token, runs, protect_inference

    def resolve(self, request: Request) -> Caller:
        """Who sent `request`: the admin token's holder, a registered run, or anonymous (everyone is the admin
        of a fleet that has no admin token, except a caller who presents a run's token)."""
        header = request.headers.get("authorization")
        if self.admin_token and token_matches(header, self.admin_token):
            return ADMIN
        presented = presented_token(header)
        run = self.runs.run_of(presented) if presented else None
        if run is not None:
            return Caller(run=run)
        return ANONYMOUS if self.admin_token else ADMIN

    def authorize(self, request: Request, admin_call: bool = False) -> Caller:
        """The caller, once it may call at all: a 401 for an anonymous admin call (or any anonymous call, with
        `protect_inference`), a 415 for an admin call that does not declare JSON (`require_json`)."""
        caller = self.resolve(request)
        if caller.run is not None and request.method != "GET":
            self.runs.heard_from(caller.run)
        if caller is ANONYMOUS and (admin_call or self.protect_inference):
            raise ApiError(401, "missing or invalid token (send Authorization: Bearer <token>, or Basic auth)")
        if admin_call:
            require_json(request)
        return caller


def require_json(request: Request) -> None:
    """415 unless the request declares a JSON body, or has no body, no Content-Type and no `Origin`
    (what `requests` and `httpx` send for a body-less POST; a browser always adds `Origin`)."""
    content_type = request.headers.get("content-type")
    if content_type is None and not has_body(request.headers) and "origin" not in request.headers:
        return
    if (content_type or "").split(";")[0].strip().lower() != "application/json":
        raise ApiError(415, "admin calls take Content-Type: application/json")


def has_body(headers: Headers) -> bool:
    """Whether a request with these headers sends a body (a length above 0, or chunks)."""
    length = headers.get("content-length")
    return "transfer-encoding" in headers or (length is not None and length.strip() != "0")
