"""Runs as tenants of one fleet: who may use which adapters, and whether one more run still fits.

A team starts one fleet and many experiments use it; each is a run, registered by the admin
(`POST /v1/runs`), with a token of its own. A run token may sample the base model and its own adapters
(`<run>/...`, `deployments.names`), load and unload its own versions, and sees only those in
`/v1/models`; anything of another run is a 403. The admin token may do everything. A fleet without an
admin token is open to everyone on its machine, runs or not: tokens mean something only beside one.

The registry lives in the ingress and holds only each token's sha256 (`app.auth`): the token itself
is answered once, to the admin who registered the run. Each registration is also recorded in the
fleet's bucket (`app.bucket.store.RunRecords`, name, sha256 and weight), so an ingress that restarts
(its head node lost, the application redeployed) knows its runs, and their tokens, again. Replicas
know nothing of runs: a run's adapters come back from the bucket on demand, so a replica that
restarts loses nothing either.

A run that says nothing for `fleet.run_idle_timeout_s` (no request with its token, no
`POST /v1/runs/NAME/heartbeat`) is taken to be dead: killed, preempted, or ended without a DELETE.
The first request after that releases it (`take_idle`): its token stops working and its adapters
leave every replica, so its slots serve the others and its place is free for a new run.

Registration is refused (409) when the pinned LoRA slots of every run, plus the fleet's own
`policy-vN` lineage, would no longer fit `max_loras` (`deployments.slots.slots_needed`): better a
clear refusal than runs that evict each other's live versions on every request.

Each run has a weight (`POST /v1/runs {"name", "weight"}`, `fleet.default_run_weight` when not given): its
share of the fleet's in-flight generations under contention (`deployments.fair_share`).
"""

from __future__ import annotations

import hmac
import time
from collections.abc import Callable
from dataclasses import dataclass

from app.auth import mint_run_token, token_digest
from deployments.api_schema import ApiError
from deployments.names import RUN_NAME, split_run
from deployments.slots import slots_needed

# The fleet's own learner (`policy-vN` at the bucket's root) pins a window too, whether or not it runs now.
OWN_LINEAGES = 1


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
        """An adapter this caller may load or unload: any for the admin, `<run>/...` for a run."""
        if self.admin:
            return
        owner, _ = split_run(name)
        if self.run is None or owner != self.run:
            mine = f"{self.run}/<name>" if self.run else "none"
            raise ApiError(403, f"lora_name {name!r}: this token may load and unload only its own adapters ({mine})")

    def check_admin(self, what: str) -> None:
        if not self.admin:
            raise ApiError(403, f"{what} needs the admin token (it affects every run on the fleet)")


ADMIN = Caller(admin=True)
ANONYMOUS = Caller()


class Runs:
    """The registered runs of a fleet, by name, each with the sha256 of its token and when it was last heard of."""

    def __init__(
        self,
        max_loras: int,
        window: int,
        idle_timeout_s: float = 600.0,
        clock: Callable[[], float] = time.monotonic,
        default_weight: float = 1.0,
    ):
        self.max_loras, self.window, self.idle_timeout_s, self._clock = max_loras, window, idle_timeout_s, clock
        self.default_weight = default_weight
        self._weights: dict[str, float] = {}  # run -> its weight, when registered with one
        self._digests: dict[str, str] = {}  # run -> sha256 of its token
        self._seen: dict[str, float] = {}  # run -> clock of its latest request or heartbeat

    def __repr__(self) -> str:  # names only: there is nothing secret to show, and no reason to try
        return f"Runs({sorted(self._digests)})"

    def names(self) -> list[str]:
        return sorted(self._digests)

    def register(self, name: str, weight: float | None = None) -> str:
        """Register run `name` (with `weight`, else the default) and return its token (the only time anyone sees it)."""
        if not RUN_NAME.fullmatch(name):
            raise ApiError(
                400, f"name {name[:64]!r}: expected 1-32 of a-z, 0-9, '_', '-', starting with a letter or digit"
            )
        if name in self._digests:
            raise ApiError(409, f"run {name!r} is already registered; DELETE /v1/runs/{name} first")
        lineages = len(self._digests) + 1 + OWN_LINEAGES
        needed = slots_needed(lineages, self.window)
        if needed > self.max_loras:
            raise ApiError(
                409,
                f"run {name!r} would not fit: {len(self._digests) + 1} runs and the fleet's own lineage pin "
                f"{self.window} versions each (max_staleness + 1), {needed} LoRA slots per engine with one to load "
                f"into, more than fleet.max_loras={self.max_loras}; remove a run or redeploy with more slots",
            )
        if weight is not None and not (0 < weight < float("inf")):  # the API's schema says so too; Python callers
            raise ApiError(400, f"weight: {weight}, expected a positive finite number")
        token = mint_run_token()
        if weight is not None:
            self._weights[name] = weight
        self._digests[name] = token_digest(token)
        self._seen[name] = self._clock()
        return token

    def remove(self, name: str) -> None:
        if self._digests.pop(name, None) is None:
            raise ApiError(404, f"run {name[:64]!r} is not registered")
        self._seen.pop(name, None)
        self._weights.pop(name, None)

    def weight(self, name: str) -> float:
        """Run `name`'s weight; the default for one registered without and for the admin's pseudo-run."""
        return self._weights.get(name, self.default_weight)

    def run_of(self, token: str) -> str | None:
        """The run whose token this is, or None; a request with it counts as the run's heartbeat."""
        digest = token_digest(token)
        for name, known in self._digests.items():
            if hmac.compare_digest(digest, known):
                self._seen[name] = self._clock()
                return name
        return None

    def restore(self, records: dict[str, tuple[str, float | None]]) -> None:
        """Runs recorded before this registry existed (an ingress restart): {name: (token sha256, weight or None)},
        each heard of from now on."""
        for name, (digest, weight) in records.items():
            self._digests[name], self._seen[name] = digest, self._clock()
            if weight is not None:
                self._weights[name] = weight

    def digest(self, name: str) -> str:
        return self._digests[name]

    def heartbeat(self, name: str) -> None:
        if name not in self._digests:
            raise ApiError(404, f"run {name[:64]!r} is not registered")
        self._seen[name] = self._clock()

    def take_idle(self) -> list[str]:
        """Remove and return the runs not heard of for `idle_timeout_s` (at once: no two requests release one)."""
        now = self._clock()
        idle = sorted(name for name, seen in self._seen.items() if now - seen > self.idle_timeout_s)
        for name in idle:
            self.remove(name)
        return idle
