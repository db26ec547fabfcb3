"""Sessions, training clients and samplers of the Tinker API, per tenant, with the capacity they may take.

A `ServiceClient` opens a session and keeps it alive with a heartbeat every 10 s; a session silent for
`session_idle_s` is released (`take_idle`), and with it its training clients' adapters on the learner. A training
client (`Model`) belongs to one tenant and one session; its requests run in the order of their `seq_id`
(`Model.turn`), as the SDK numbers them, whatever order they arrive in. A sampler names what the fleet serves
(`<run>/policy-vN`, or the base model). Ids are unguessable where they are secret-ish (sessions, samplers) and what
the SDK expects where it computes them itself (`<session>:train:<n>`); every lookup checks the tenant: another
key's model is not there.
"""

from __future__ import annotations

import time
import uuid
from dataclasses import dataclass, field

from contracts.tinker import AdapterSpec
from deployments.tinker.turns import Turns

TURN_WAIT_S = 300.0  # how long a request waits for the ones numbered before it (`Turns`), unless Sessions says
MAX_SEQ_AHEAD = 1024  # how far ahead of its client's turn a request's seq_id may be, unless Sessions says


class NotFound(Exception):
    """A session, model or sampler this tenant does not have (404)."""


class OverCapacity(Exception):
    """One more training client than the service (or this tenant) may hold (429, which the SDK retries)."""


@dataclass
class Model:
    """A training client: its tenant, session, base model, LoRA rank, and the order of its requests."""

    model_id: str
    tenant: str
    session_id: str
    base_model: str
    rank: int
    learner: int = 0  # which of the service's learners holds its adapter
    spec: AdapterSpec | None = None  # its adapter as created or loaded (what its saved paths' records say of it)
    saved: int | None = None  # its last saved state's number: what a restarted learner restores it from
    saved_from: str | None = None  # the prefix of that state when another tenant's (a published one it started from)
    trained: bool = False  # changed since that state (a step, or a gradient accumulated): what a notice's save keeps
    pending: bool = False  # a gradient accumulated (forward_backward) and not yet applied (optim_step)
    restores: int = 0
    touched: float = field(default_factory=time.time)  # wall-clock time of its last request (training-run listings)
    turns: Turns = field(default_factory=lambda: Turns(TURN_WAIT_S, MAX_SEQ_AHEAD))  # its requests' order

    @property
    def adapter(self) -> AdapterSpec:
        """Its adapter's spec; its rank alone before the learner said more (a state being loaded)."""
        return self.spec or AdapterSpec(self.rank)

    def turn(self, seq_id: int):
        """Run the body when every request numbered below `seq_id` has had its turn (`Turns.turn`)."""
        return self.turns.turn(seq_id)


@dataclass
class Sampler:
    """A sampling session: what the fleet serves it as, its base model, the tinker path it came from, and the session
    it lives and dies with (the SDK never releases one: an RL loop makes one per step)."""

    sampler_id: str
    tenant: str
    fleet_model: str
    base_model: str
    model_path: str | None
    session_id: str = ""
    used: float = 0.0  # the clock of its creation or last lookup: the least recently used goes first


@dataclass
class Session:
    tenant: str
    seen: float
    models: set[str] = field(default_factory=set)


class Sessions:
    """Every tenant's sessions, training clients and samplers, and the capacity limits."""

    def __init__(
        self,
        max_models: int,
        max_models_per_tenant: int,
        idle_s: float,
        learners: int = 1,
        clock=time.monotonic,
        max_samplers_per_tenant: int = 64,
        turn_wait_s: float = TURN_WAIT_S,
        max_seq_ahead: int = MAX_SEQ_AHEAD,
    ):
        """`max_models` training clients on each of `learners` learners; `max_samplers_per_tenant` sampling clients per
        tenant, beyond which its least recently used one is released. A training client's request waits for its turn
        `turn_wait_s` at most, and may be numbered up to `max_seq_ahead` past that turn (`Turns`)."""
        self.max_models, self.max_models_per_tenant, self.idle_s = max_models, max_models_per_tenant, idle_s
        self.turn_wait_s, self.max_seq_ahead = turn_wait_s, max_seq_ahead
        self.max_samplers_per_tenant = max_samplers_per_tenant
        self.learners = learners
        self._clock = clock
        self.sessions: dict[str, Session] = {}
        self.models: dict[str, Model] = {}
        self.samplers: dict[str, Sampler] = {}
        self.sampler_paths: dict[str, tuple[str, int]] = {}  # tinker path of sampler weights -> (tenant, version)
        self.state_paths: dict[str, tuple[str, int]] = {}  # tinker path of a saved state -> (tenant, number)

    def open(self, tenant: str) -> str:
        session_id = f"{tenant}-{uuid.uuid4().hex[:16]}"
        self.sessions[session_id] = Session(tenant, self._clock())
        return session_id

    def session(self, session_id: str, tenant: str) -> Session:
        return _owned(
            self.sessions,
            session_id,
            tenant,
            f"session {session_id[:80]!r} is not open for this API key (released after silence?)",
        )

    def heartbeat(self, session_id: str, tenant: str) -> None:
        self.session(session_id, tenant).seen = self._clock()

    def reserve_model(self, session_id: str, tenant: str, seq: int, base_model: str, rank: int) -> Model:
        """A new training client on the learner holding fewest, or OverCapacity; its id is the SDK's
        `<session>:train:<seq>`."""
        session = self.session(session_id, tenant)
        model_id = f"{session_id}:train:{seq}"
        if model_id in self.models:
            return self.models[model_id]
        loads = [0] * self.learners
        for held in self.models.values():
            loads[held.learner] += 1
        learner = min(range(self.learners), key=lambda i: (loads[i], i))
        if loads[learner] >= self.max_models:
            raise OverCapacity(
                f"the service's {self.learners} learner(s) hold {self.max_models} training clients each, their capacity; "
                "try again later"
            )
        mine = sum(1 for m in self.models.values() if m.tenant == tenant)
        if mine >= self.max_models_per_tenant:
            raise OverCapacity(
                f"this API key holds {mine} training clients, its limit ({self.max_models_per_tenant}); "
                "close a ServiceClient or wait for an idle session to be released"
            )
        turns = Turns(self.turn_wait_s, self.max_seq_ahead, f"model {model_id}")
        model = Model(model_id, tenant, session_id, base_model, rank, learner=learner, turns=turns)
        self.models[model_id] = model
        session.models.add(model_id)
        return model

    def forget_model(self, model_id: str) -> None:
        model = self.models.pop(model_id, None)
        if model is not None and model.session_id in self.sessions:
            self.sessions[model.session_id].models.discard(model_id)

    def model(self, model_id: str, tenant: str) -> Model:
        model = _owned(self.models, model_id, tenant, f"model {model_id[:120]!r} does not exist for this API key")
        self.sessions[model.session_id].seen = self._clock()
        model.touched = time.time()
        return model

    def add_sampler(
        self, tenant: str, session_id: str, fleet_model: str, base_model: str, model_path: str | None
    ) -> Sampler:
        """A sampling client of session `session_id`, released with it; a tenant over `max_samplers_per_tenant` loses
        its least recently used one (a 404 if it is ever used again)."""
        mine = sorted((s.used, s.sampler_id) for s in self.samplers.values() if s.tenant == tenant)
        for _, old in mine[: max(0, len(mine) + 1 - self.max_samplers_per_tenant)]:
            del self.samplers[old]
        sampler = Sampler(
            f"sampler-{uuid.uuid4().hex}", tenant, fleet_model, base_model, model_path, session_id, self._clock()
        )
        self.samplers[sampler.sampler_id] = sampler
        return sampler

    def sampler(self, sampler_id: str, tenant: str) -> Sampler:
        sampler = _owned(
            self.samplers, sampler_id, tenant, f"sampler {sampler_id[:80]!r} does not exist for this API key"
        )
        sampler.used = self._clock()
        return sampler

    def close(self, session_id: str, tenant: str) -> list[str]:
        """End a session; the ids of its training clients, for the learner to drop."""
        session = self.session(session_id, tenant)
        del self.sessions[session_id]
        for model_id in session.models:
            self.models.pop(model_id, None)
        for sampler_id in [s for s, v in self.samplers.items() if v.session_id == session_id]:
            del self.samplers[sampler_id]
        return sorted(session.models)

    def close_tenant(self, tenant: str) -> list[str]:
        """End every session of `tenant` (a key the fleet revoked) and forget its samplers and paths; the ids of its
        training clients, for the learner to drop."""
        dropped = sorted(m for m, v in self.models.items() if v.tenant == tenant)
        for session_id in [s for s, v in self.sessions.items() if v.tenant == tenant]:
            self.close(session_id, tenant)
        for table in (self.samplers, self.models):
            for key in [k for k, v in table.items() if v.tenant == tenant]:
                del table[key]
        for paths in (self.sampler_paths, self.state_paths):
            for path in [p for p, (owner, _) in paths.items() if owner == tenant]:
                del paths[path]
        return dropped

    def take_idle(self) -> list[str]:
        """End every session silent for `idle_s`; the ids of their training clients."""
        now = self._clock()
        dropped: list[str] = []
        for session_id in [s for s, v in self.sessions.items() if now - v.seen > self.idle_s]:
            dropped += self.close(session_id, self.sessions[session_id].tenant)
        return dropped


def _owned(table: dict, key: str, tenant: str, missing: str):
    """`table[key]` where it belongs to `tenant`; NotFound(`missing`) else: another tenant's session, model or sampler
    is not there for this key, the same answer as one that never was."""
    item = table.get(key)
    if item is None or item.tenant != tenant:
        raise NotFound(missing)
    return item
