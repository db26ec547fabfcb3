"""PrefixHashRouter: Ray Serve's request router for the vLLM replicas, routing on prompt token ids.

Serve's default router (power of two choices) balances load but scatters the G samples of a prompt
across replicas, so each replica prefills the same prompt again. This router hashes the prompt's
token blocks the way vLLM's prefix cache does (`deployments.routing.prefix`) and sends a request to the
replica that already holds the longest run of them, spilling to the least loaded replica when the
preferred one is too far ahead. It sees only the arguments of the handle call, which is why the
ingress calls `VLLMReplica.generate` with a `GenerateRequest` (`contracts.serving`) that carries
token ids, never raw text: the router reads its `prompt_ids` and `model` (of a `GenerateBundle`'s first request: its
others share model and first block, and their blocks are recorded with it).

Settings (block size, spill threshold, table bound) come from the replicas' own metadata, which the
replicas take from the run config: the block size is then by construction the engines' KV block
size, and `serve_config.yaml` need only name this class. Explicit `request_router_kwargs` win.

A request that names its session (verifiers' `X-Session-ID`) goes to the replica of its session's last request
(`deployments.routing.prefix.SessionTable`), counted under `sessions` (kept / spilled / new) besides the outcomes.

Counters (routed / affinity / spilled / unmatched, per replica) are Ray metrics and, for
`GET /router/stats`, a snapshot that the ingress reads in-process: the router lives inside the
ingress replica, as part of its handle to the vLLM deployment. A replica that leaves takes its row
with it (its counts join one `retired` sum), so the snapshot's size follows the live fleet.

A replica whose node is going (a spot notice) is routed nothing more while another one is live: the
ingress marks it the moment the replica says so (`mark_draining`, `deployments.replica.notices`), and the
replica's routing stats say so too. Serve keeps it among the candidates until its replacement runs. The last drains
stay in the snapshot (`drains`) after their replicas leave: when each was heard, what had been routed to it by then,
and what was routed to it while it drained (only while no other replica was live).
"""

from __future__ import annotations

import importlib
import logging
import random
import threading
import time
import weakref
from collections import deque
from dataclasses import asdict, dataclass
from typing import Any

from ray.serve.request_router import PendingRequest, ReplicaID, RequestRouter, RunningReplica

from contracts.serving import BUNDLE_METHOD, GENERATE_METHOD, GenerateBundle, GenerateRequest
from core.config import RouterConfig
from deployments.routing.prefix import (
    OUTCOMES,
    SESSION_DEPTH,
    SESSION_OUTCOMES,
    Decision,
    PrefixTable,
    SessionTable,
    block_hashes,
    decide,
    session_outcome,
)

log = logging.getLogger("ray.serve")

# Used until the replicas publish theirs (they do before any request can be routed to them).
DEFAULT_SETTINGS = RouterConfig().model_dump()

_ROUTERS: weakref.WeakSet[PrefixHashRouter] = weakref.WeakSet()
KEPT_DRAINS = 32  # drains the snapshot remembers after their replicas left (spot churn would otherwise grow it)


@dataclass
class Drain:
    """One replica's drain as this router heard it: Serve stops the replica within seconds of the notice on a busy
    node, and its row leaves the stats with it, so the drain is kept apart."""

    replica: str
    at: float  # unix time the router heard it
    routed_before: int  # routed to the replica by then
    routed_while_draining: int = 0  # routed to it while it drained (no other replica was live)


def _rid(replica: RunningReplica | ReplicaID) -> str:
    replica_id = replica.replica_id if isinstance(replica, RunningReplica) else replica
    return replica_id.unique_id


class PrefixHashRouter(RequestRouter):
    """Longest prefix match over chained block hashes, bounded by a load-spill threshold.

    No `FIFOMixin`: it would hand a replica chosen for one request to whichever request is oldest,
    which breaks the one-prompt-one-replica mapping this router exists for.
    """

    def initialize_state(
        self,
        block_size: int | None = None,
        spill_threshold: int | None = None,
        max_table_entries: int | None = None,
        seed: int | None = None,
    ) -> None:
        self._explicit = {
            k: v
            for k, v in {
                "block_size": block_size,
                "spill_threshold": spill_threshold,
                "max_table_entries": max_table_entries,
            }.items()
            if v is not None
        }
        self._settings = {**DEFAULT_SETTINGS, **self._explicit}
        self._table = PrefixTable(self._settings["max_table_entries"])
        self._sessions = SessionTable(self._settings["max_table_entries"])
        self._session_counts: dict[str, int] = dict.fromkeys(("routed", *SESSION_OUTCOMES), 0)
        self._rng = random.Random(seed)
        self._inflight: dict[str, int] = {}
        # Replicas whose node is going (routed nothing while another is live), each with its drain's record; the
        # records of the last drains, ended or not, stay in `_drains` after their replicas leave.
        self._draining: dict[str, Drain] = {}
        self._drains: deque[Drain] = deque(maxlen=KEPT_DRAINS)
        self._lock = threading.Lock()  # counters are read by the ingress's loop, written by the router's
        self._counts: dict[str, dict[str, int]] = {}
        # What replicas that left (died, drained, scaled down) had counted: kept as one sum, so that the totals and
        # the affinity share stay whole while the per-replica table holds the live replicas alone (spot churn
        # would otherwise grow it for ever).
        self._retired: dict[str, int] = dict.fromkeys(("routed", *OUTCOMES), 0)
        self._turns: dict[int, dict[str, int]] = {}  # the same outcomes by episode turn, for requests that say theirs
        self._metrics = _RouterMetrics(self.app_name)
        # Serve ships this class to the ingress by value (cloudpickle), with its own copy of this
        # module's globals: register with the module as imported there, which `router_stats` reads.
        importlib.import_module(__name__)._ROUTERS.add(self)

    # ---- the decision ----------------------------------------------------------------------------

    async def choose_replicas(
        self,
        candidate_replicas: list[RunningReplica],
        pending_request: PendingRequest | None = None,
    ) -> list[list[RunningReplica]]:
        if not candidate_replicas:
            return []
        staying = [r for r in candidate_replicas if not self._is_draining(r)]
        candidate_replicas = staying or candidate_replicas
        by_id = {_rid(r): r for r in candidate_replicas}
        loads = {rid: self._inflight.get(rid, 0) for rid in by_id}
        requests = _generate_requests(pending_request)
        if pending_request is not None:
            # Back off between rounds when every replica is full, instead of spinning.
            pending_request.routing_context.should_backoff = True
        if not requests:  # a call that is not a generation: plain least-loaded order
            return [sorted(candidate_replicas, key=lambda r: loads[_rid(r)])]
        context = pending_request.routing_context
        chosen = getattr(context, "spotrl_replica", None)
        if chosen not in by_id:
            # First attempt (or the replica chosen before has died): decide and record now, so the
            # rest of the group, arriving a moment later, matches these blocks.
            # A bundle's requests share their model, session and first block: the first decides for all, and the
            # others' deeper blocks are recorded there too, so that what comes after them matches.
            decision = self._decide(requests[0], loads)
            for other in requests[1:]:
                self._table.record(self._hashes(other), decision.replica)
            chosen = context.spotrl_replica = decision.replica
        rest = sorted((r for rid, r in by_id.items() if rid != chosen), key=lambda r: loads[_rid(r)])
        # If the chosen replica is full, Serve falls through to the next rank: the least loaded others.
        return [[by_id[chosen]], rest] if rest else [[by_id[chosen]]]

    def _decide(self, request: GenerateRequest, loads: dict[str, int]) -> Decision:
        # The adapter name seeds the chain: a prefix cached under policy-v3 is no match for policy-v4.
        hashes = self._hashes(request)
        depths = self._table.match(hashes, loads)
        held = self._sessions.replica(request.session) if request.session is not None else None
        if held in loads:  # the session's replica holds its turns so far: the deepest match there is
            depths = {**depths, held: SESSION_DEPTH}
        decision = decide(depths, loads, self._settings["spill_threshold"], self._rng)
        self._table.record(hashes, decision.replica)
        if request.session is not None:
            self._sessions.record(request.session, decision.replica)
        with self._lock:
            if request.session is not None:
                self._session_counts["routed"] += 1
                self._session_counts[session_outcome(held, loads, decision)] += 1
            counts = self._counts.setdefault(decision.replica, dict.fromkeys(("routed", *OUTCOMES), 0))
            counts["routed"] += 1
            if decision.replica in self._draining:
                self._draining[decision.replica].routed_while_draining += 1
            counts[decision.outcome] += 1
            if request.turn is not None:
                turn = self._turns.setdefault(request.turn, dict.fromkeys(("routed", *OUTCOMES), 0))
                turn["routed"] += 1
                turn[decision.outcome] += 1
        self._metrics.record(decision, len(self._table))
        return decision

    def _hashes(self, request: GenerateRequest) -> list[int]:
        return block_hashes(request.prompt_ids, self._settings["block_size"], request.model)

    def _is_draining(self, replica: RunningReplica) -> bool:
        stats = getattr(replica, "routing_stats", None) or {}
        return _rid(replica) in self._draining or bool(stats.get("draining"))

    def mark_draining(self, replica_id: str, draining: bool = True) -> None:
        """The replica's node is going: route nothing more to it while another replica is live (`draining` False:
        its node outlived the notice, it serves again)."""
        if draining and replica_id not in self._draining:
            with self._lock:
                routed = self._counts.get(replica_id, {}).get("routed", 0)
                self._draining[replica_id] = drain = Drain(replica_id, time.time(), routed)
                self._drains.append(drain)
            log.warning("PrefixHashRouter: replica %s drains (its node is going); routing around it", replica_id)
        elif not draining and replica_id in self._draining:
            del self._draining[replica_id]
            log.warning("PrefixHashRouter: replica %s serves again (its node outlived the notice)", replica_id)

    # ---- load bookkeeping: requests this router has in flight on each replica ----------------------

    def on_send_request(self, replica_id: ReplicaID) -> None:
        super().on_send_request(replica_id)
        rid = _rid(replica_id)
        self._inflight[rid] = self._inflight.get(rid, 0) + 1

    def on_request_completed(self, replica_id: ReplicaID, internal_request_id: str) -> None:
        super().on_request_completed(replica_id, internal_request_id)
        rid = _rid(replica_id)
        # Clamped: Serve also reports completion of a send that raised before it was counted.
        self._inflight[rid] = max(0, self._inflight.get(rid, 0) - 1)

    # ---- membership ------------------------------------------------------------------------------

    def update_replicas(self, replicas: list[RunningReplica]) -> None:
        before = {_rid(r) for r in self._replica_id_set}
        super().update_replicas(replicas)
        now = {_rid(r) for r in replicas}
        self._drop(before - now)
        self._adopt_replica_settings(replicas)

    def on_replica_actor_died(self, replica_id: ReplicaID) -> None:
        super().on_replica_actor_died(replica_id)
        self._drop({_rid(replica_id)})

    def _drop(self, gone: set[str]) -> None:
        if not gone:
            return
        self._table.forget(gone)
        self._sessions.forget(gone)
        for rid in gone:
            self._draining.pop(rid, None)
        with self._lock:
            for rid in gone:
                self._inflight.pop(rid, None)
                for key, value in self._counts.pop(rid, {}).items():
                    self._retired[key] += value

    def _adopt_replica_settings(self, replicas: list[RunningReplica]) -> None:
        """Take block size and thresholds from what the replicas publish (their engine and run config)."""
        published = [r.replica_metadata.get("router") or {} for r in replicas]
        published = [p for p in published if p]
        if not published:
            return
        if any(p != published[0] for p in published[1:]):
            log.warning("PrefixHashRouter: replicas publish different router settings %s; using the first", published)
        settings = {**DEFAULT_SETTINGS, **published[0], **self._explicit}
        if settings != self._settings:
            if settings["block_size"] != self._settings["block_size"] and len(self._table):
                self._table = PrefixTable(settings["max_table_entries"])  # hashes of another block size
            self._table.max_entries = settings["max_table_entries"]
            self._settings = settings
            log.info("PrefixHashRouter settings: %s", settings)

    # ---- stats -----------------------------------------------------------------------------------

    def stats(self) -> dict[str, Any]:
        live = {_rid(r) for r in self._replica_id_set}
        with self._lock:
            replicas = {
                rid: {
                    **counts,
                    "inflight": self._inflight.get(rid, 0),
                    "live": rid in live,
                    "draining": rid in self._draining,
                }
                for rid, counts in self._counts.items()
            }
            turns = {k: dict(v) for k, v in self._turns.items()}
            sessions = {**self._session_counts, "table_entries": len(self._sessions)}
            retired = dict(self._retired)
            drains = [asdict(drain) for drain in self._drains]
        for rid in live - set(replicas):
            replicas[rid] = {
                **dict.fromkeys(("routed", *OUTCOMES), 0),
                "inflight": self._inflight.get(rid, 0),
                "live": True,
                "draining": rid in self._draining,
            }
        return {
            "settings": dict(self._settings),
            "table_entries": len(self._table),
            "replicas": replicas,
            "retired": retired,
            "turns": turns,
            "sessions": sessions,
            "drains": drains,
        }


def _generate_requests(pending_request: PendingRequest | None) -> tuple[GenerateRequest, ...]:
    """The GenerateRequests of a generation call (one, or a `GenerateBundle`'s, passed by position or by keyword);
    none for any other call."""
    if pending_request is None or pending_request.metadata.call_method not in (GENERATE_METHOD, BUNDLE_METHOD):
        return ()
    for argument in (*pending_request.args, *pending_request.kwargs.values()):
        if isinstance(argument, GenerateRequest):
            return (argument,)
        if isinstance(argument, GenerateBundle):
            return argument.requests
    return ()


class _RouterMetrics:
    """The counters as Ray metrics (Prometheus via Ray's metrics export), tagged by replica."""

    def __init__(self, application: str):
        from ray.util import metrics

        tags = ("application", "replica")
        self._counters = {
            name: metrics.Counter(f"spotrl_router_{name}", description=text, tag_keys=tags)
            for name, text in {
                "routed": "Requests the prefix-hash router sent to the replica.",
                "affinity": "Requests sent to the replica holding their longest prefix match.",
                "spilled": "Requests that matched a prefix elsewhere but spilled here (the holder was overloaded).",
                "unmatched": "Requests with no specific prefix match, sent to the least loaded replica.",
            }.items()
        }
        self._entries = metrics.Gauge(
            "spotrl_router_table_entries",
            description="Block hashes in the router's LRU table.",
            tag_keys=("application",),
        )
        self._application = application

    def record(self, decision: Decision, table_entries: int) -> None:
        tags = {"application": self._application, "replica": decision.replica}
        self._counters["routed"].inc(1, tags)
        self._counters[decision.outcome].inc(1, tags)
        self._entries.set(table_entries, {"application": self._application})


def mark_draining(replica_id: str, draining: bool = True) -> None:
    """Tell every PrefixHashRouter in this process (the ingress's) that replica `replica_id` drains (or, `draining`
    False, serves again)."""
    for router in list(_ROUTERS):
        router.mark_draining(replica_id, draining)


def router_stats() -> dict[str, Any]:
    """Counters of every PrefixHashRouter in this process (the ingress has one per vLLM handle)."""
    merged: dict[str, Any] = {"router": "PrefixHashRouter", "settings": None, "table_entries": 0, "replicas": {}}
    retired = dict.fromkeys(("routed", *OUTCOMES), 0)
    turns: dict[int, dict[str, int]] = {}
    sessions = dict.fromkeys(("routed", *SESSION_OUTCOMES, "table_entries"), 0)
    drains: dict[tuple[str, int], dict[str, Any]] = {}  # every router heard each drain: one row, its counts summed
    for router in list(_ROUTERS):
        snap = router.stats()
        seen: dict[str, int] = {}
        for drain in snap["drains"]:
            nth = seen[drain["replica"]] = seen.get(drain["replica"], -1) + 1
            into = drains.setdefault((drain["replica"], nth), {**drain, "routed_before": 0, "routed_while_draining": 0})
            into["at"] = min(into["at"], drain["at"])
            into["routed_before"] += drain["routed_before"]
            into["routed_while_draining"] += drain["routed_while_draining"]
        for key in sessions:
            sessions[key] += snap["sessions"][key]
        merged["settings"] = snap["settings"]
        merged["table_entries"] += snap["table_entries"]
        for key in retired:
            retired[key] += snap["retired"][key]
        for turn, counts in snap["turns"].items():
            into = turns.setdefault(turn, dict.fromkeys(("routed", *OUTCOMES), 0))
            for key in into:
                into[key] += counts[key]
        for rid, counts in snap["replicas"].items():
            into = merged["replicas"].setdefault(
                rid, {**dict.fromkeys(("routed", *OUTCOMES, "inflight"), 0), "live": False, "draining": False}
            )
            for key in ("routed", *OUTCOMES, "inflight"):
                into[key] += counts[key]
            into["live"] = into["live"] or counts["live"]
            into["draining"] = into["draining"] or counts["draining"]
    merged["retired"] = retired  # the counts of replicas no longer in the fleet, summed
    merged["drains"] = sorted(drains.values(), key=lambda drain: drain["at"])
    totals = dict(retired)
    for counts in merged["replicas"].values():
        for key in totals:
            totals[key] += counts[key]
    merged["totals"] = totals
    merged["affinity_share"] = totals["affinity"] / totals["routed"] if totals["routed"] else 0.0
    # Per episode turn (requests that said theirs): a trajectory that stays on its replica scores affinity from turn 2.
    merged["turns"] = {
        str(turn): {**counts, "affinity_share": counts["affinity"] / counts["routed"]}
        for turn, counts in sorted(turns.items())
    }
    # Requests that named their session (X-Session-ID): the share that stayed on their session's replica, of those
    # whose session had one (its first request has none to stay on).
    continued = sessions["kept"] + sessions["spilled"]
    merged["sessions"] = {**sessions, "kept_share": sessions["kept"] / continued if continued else 0.0}
    return merged
