"""The registry of a shared fleet's runs: who is registered, with which token, and whether one more fits.

A team starts one fleet and many experiments use it; each is a run, registered by the admin
(`POST /v1/runs`), with a token of its own (what that token may do: `deployments.api.callers`).

The registry lives in the ingress and holds only each token's sha256 (`contracts.auth`): the token itself
is answered once, to the admin who registered the run. Each registration is also recorded in the
fleet's bucket (`deployments.control.tenancy`), so an ingress that restarts knows its runs, and their
tokens, again (`restore`).

A run that says nothing for `fleet.run_idle_timeout_s` (no request that uses the fleet with its token, no
`POST /v1/runs/NAME/heartbeat`) is taken to be dead: killed, preempted, or ended without a DELETE.
`take_idle` hands such runs over to be released (`deployments.control.upkeep`). Reading is no sign of
life: resolving a token (`run_of`) changes nothing, and the routes say when a run was heard of
(`heard_from`).

A run states its LoRA rank, its staleness window and how many lineages it publishes when it registers
(`POST /v1/runs {"name", "lora_rank", "max_staleness", "lineages"}`; the fleet's `max_staleness` when it says
none; one lineage, its policy, when it says none, two when its learner also publishes an `ema-vN` average for a
self-distilling teacher): a rank above the fleet's `max_lora_rank` is refused (400), and so is a run whose windows
would no longer fit: a window per lineage of every run, plus the fleet's own `policy-vN` lineage's if it has a committed version (a fleet that nobody trains under
itself pins nothing for it), plus one slot to load into, must fit `max_loras` (`core.config.slots_needed`; 409 of
type `conflict`, with the arithmetic). Better a clear refusal than runs that evict each other's live versions on
every request.

Each run has a weight (`POST /v1/runs {"name", "weight"}`, `fleet.default_run_weight` when not given): its
share of the fleet's in-flight generations under contention (`deployments.control.fair_share`).
"""

from __future__ import annotations

import hmac
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass

from contracts.adapters import RUN_NAME
from contracts.auth import mint_run_token, token_digest
from core.config import slots_needed
from deployments.control.errors import ApiError


@dataclass(frozen=True)
class Registration:
    """What the fleet keeps of a run: its token's sha256 (never the token), and what it registered with."""

    token_sha256: str
    weight: float | None = None  # None: the fleet's default weight, whatever it is when asked
    max_staleness: int | None = None  # None: the fleet's own max_staleness
    lora_rank: int | None = None  # None: not stated (any rank up to the fleet's max_lora_rank)
    lineages: int | None = None  # None: one (its policy); two with its ema average (`contracts.adapters.EMA_STEM`)

    def as_record(self) -> dict:
        return asdict(self)

    @classmethod
    def from_record(cls, record: dict) -> Registration:
        return cls(**{k: record.get(k) for k in ("token_sha256", "weight", "max_staleness", "lora_rank", "lineages")})


class Runs:
    """The registered runs of a fleet, by name, each with its `Registration` and when it was last heard of."""

    def __init__(
        self,
        max_loras: int,
        max_staleness: int,
        idle_timeout_s: float = 600.0,
        clock: Callable[[], float] = time.monotonic,
        default_weight: float = 1.0,
        max_lora_rank: int | None = None,
    ):
        self.max_loras, self.max_staleness = max_loras, max_staleness
        self.idle_timeout_s, self._clock = idle_timeout_s, clock
        self.default_weight, self.max_lora_rank = default_weight, max_lora_rank
        self._runs: dict[str, Registration] = {}
        self._seen: dict[str, float] = {}  # run -> clock of its latest sign of life (`heard_from`)

    @classmethod
    def of(cls, settings) -> Runs:
        """The registry of an ingress of these `deployments.api.settings.ApiSettings`."""
        return cls(
            settings.max_loras,
            settings.max_staleness,
            settings.run_idle_timeout_s,
            default_weight=settings.default_run_weight,
            max_lora_rank=settings.max_lora_rank,
        )

    def __repr__(self) -> str:  # names only: there is nothing secret to show, and no reason to try
        return f"Runs({sorted(self._runs)})"

    def names(self) -> list[str]:
        return sorted(self._runs)

    def __contains__(self, name: object) -> bool:
        return name in self._runs

    def sizes(self) -> dict[str, int]:
        """How many runs the registry keeps, and idle clocks (`/server_info`'s tables)."""
        return {"runs": len(self._runs), "idle_clocks": len(self._seen)}

    def window(self, name: str) -> int:
        """The versions of run `name`'s lineage that samples may still use, and its slots pin: max_staleness + 1."""
        staleness = self._runs[name].max_staleness
        return (self.max_staleness if staleness is None else staleness) + 1

    def lineages(self, name: str) -> int:
        """The lineages of adapter versions run `name` publishes, each pinning its window of slots."""
        return self._runs[name].lineages or 1

    def register(
        self,
        name: str,
        weight: float | None = None,
        max_staleness: int | None = None,
        lora_rank: int | None = None,
        own_lineage: bool = True,
        lineages: int | None = None,
    ) -> str:
        """Register run `name` and return its token (the only time anyone sees it). `own_lineage`: whether the
        fleet's own `policy-vN` lineage has a committed version, and so pins its window too."""
        if not RUN_NAME.fullmatch(name):
            raise ApiError(
                400, f"name {name[:64]!r}: expected 1-32 of a-z, 0-9, '_', '-', starting with a letter or digit"
            )
        if name in self._runs:
            raise ApiError(409, f"run {name!r} is already registered; DELETE /v1/runs/{name} first")
        if weight is not None and not (0 < weight < float("inf")):  # the API's schema says so too; Python callers
            raise ApiError(400, f"weight: {weight}, expected a positive finite number")
        if lora_rank is not None and self.max_lora_rank is not None and lora_rank > self.max_lora_rank:
            raise ApiError(
                400,
                f"lora_rank: {lora_rank} exceeds the fleet's max_lora_rank {self.max_lora_rank} (its engines' LoRA "
                "buffers are sized for it); train a smaller rank or redeploy the fleet with a larger fleet.max_lora_rank",
            )
        if lineages is not None and lineages not in (1, 2):  # the API's schema says so too; Python callers
            raise ApiError(400, f"lineages: {lineages}, expected 1 (its policy) or 2 (its policy and its ema average)")
        registration = Registration("", weight, max_staleness, lora_rank, lineages)
        self._check_fits(name, registration, own_lineage)
        token = mint_run_token()
        self._runs[name] = Registration(token_digest(token), weight, max_staleness, lora_rank, lineages)
        self._seen[name] = self._clock()
        return token

    def _check_fits(self, name: str, registration: Registration, own_lineage: bool) -> None:
        """409 (conflict) with the arithmetic when one more run of this window would overflow the slots."""
        staleness = self.max_staleness if registration.max_staleness is None else registration.max_staleness
        windows = {
            **{run: (self.window(run), self.lineages(run)) for run in self._runs},
            name: (staleness + 1, registration.lineages or 1),
        }
        own = self.max_staleness + 1 if own_lineage else 0  # the fleet's own learner (`policy-vN` at the bucket's root)
        needed = slots_needed([*(w * n for w, n in windows.values()), own])
        if needed > self.max_loras:
            pins = ", ".join(
                f"{run} {w}" + (f" x {n} lineages" if n > 1 else "") for run, (w, n) in sorted(windows.items())
            )
            lineage = f"the fleet's own lineage {own}" if own else "the fleet's own lineage none (nothing committed)"
            raise ApiError(
                409,
                f"run {name!r} would not fit: runs pin a window per lineage (max_staleness + 1: {pins}) and {lineage}, "
                f"{needed} LoRA slots per engine with one to load into, more than fleet.max_loras={self.max_loras}; "
                "remove a run, register with a smaller max_staleness, or redeploy with more slots",
            )

    def remove(self, name: str) -> None:
        if self._runs.pop(name, None) is None:
            raise ApiError(404, f"run {name[:64]!r} is not registered")
        self._seen.pop(name, None)

    def registration(self, name: str) -> Registration:
        if name not in self._runs:
            raise ApiError(404, f"run {name[:64]!r} is not registered")
        return self._runs[name]

    def weight(self, name: str) -> float:
        """Run `name`'s weight; the default for one registered without and for the admin's pseudo-run."""
        registration = self._runs.get(name)
        return registration.weight if registration and registration.weight is not None else self.default_weight

    def run_of(self, token: str) -> str | None:
        """The run whose token this is, or None."""
        digest = token_digest(token)
        for name, registration in self._runs.items():
            if hmac.compare_digest(digest, registration.token_sha256):
                return name
        return None

    def restore(self, records: dict[str, Registration]) -> None:
        """Runs recorded before this registry existed (an ingress restart), each heard of from now on."""
        for name, registration in records.items():
            self._runs[name], self._seen[name] = registration, self._clock()

    def digest(self, name: str) -> str:
        return self._runs[name].token_sha256

    def heartbeat(self, name: str) -> None:
        """Run `name` is alive (`POST /v1/runs/NAME/heartbeat`); a 404 if it is not registered."""
        if name not in self._runs:
            raise ApiError(404, f"run {name[:64]!r} is not registered")
        self.heard_from(name)

    def heard_from(self, name: str) -> None:
        """Run `name` used the fleet just now: its idle clock starts again (no-op for a run since removed)."""
        if name in self._runs:
            self._seen[name] = self._clock()

    def take_idle(self) -> list[str]:
        """Remove and return the runs not heard of for `idle_timeout_s` (at once: each is released only once)."""
        now = self._clock()
        idle = sorted(name for name, seen in self._seen.items() if now - seen > self.idle_timeout_s)
        for name in idle:
            self.remove(name)
        return idle
