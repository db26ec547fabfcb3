"""The fleet's control calls as types: what the ingress asks of every replica, and what each one answers.

An admin call (load an adapter, pause, ...) reaches every live replica as one `Command`, through a single
replica method (`CONTROL_METHOD`), and each replica answers the command's own reply type. So a command
or a field renamed on one side fails loudly on the other instead of a string-named call and a dict
answer drifting apart, and the unit tests of either side build the same objects the other side sends.

Nothing here imports Ray or vLLM; Ray pickles these classes by reference on both sides of the handle.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass
from typing import Any

# The VLLMReplica method every Command goes through (`VLLMReplica.control`).
CONTROL_METHOD = "control"


@dataclass(frozen=True)
class Command:
    """A call the ingress makes on every live replica (`FleetControl.broadcast`)."""


# ---- replies ----------------------------------------------------------------------------------------


@dataclass(frozen=True)
class Pong:
    """The replica is alive and its engine with it."""

    replica: str


@dataclass(frozen=True)
class AdapterInfo:
    """One adapter a replica serves: under which name, loaded from where, which files, with how many requests."""

    name: str
    source: str  # the bucket URL of the version (credentials redacted), or the trusted local folder
    sha256: str  # of its files (`core.bucket.manifest.folder_digest`): what "already loaded" is checked against
    inflight: int


@dataclass(frozen=True)
class AdapterListing:
    """What one replica serves now."""

    replica: str
    adapters: tuple[AdapterInfo, ...]


@dataclass(frozen=True)
class Loaded:
    """The answer to `LoadAdapter`: whether this replica added the adapter, and whether it replaced other files."""

    replica: str
    loaded: bool
    replaced: bool = False


@dataclass(frozen=True)
class Unloaded:
    """The answer to `UnloadAdapter` and `UndoLoad`: whether the name left, and requests that still finish on it."""

    replica: str
    unloaded: bool
    draining: int = 0


@dataclass(frozen=True)
class RunForgotten:
    """The answer to `ForgetRun`: the run's adapters this replica unloaded, and those still draining requests."""

    replica: str
    unloaded: tuple[str, ...]
    draining: int = 0


@dataclass(frozen=True)
class PauseState:
    """The answer to `Pause` and `Resume`: whether the replica's engine is paused, and for how long at most."""

    replica: str
    paused: bool
    lease_s: float | None = None


@dataclass(frozen=True)
class HandedBack:
    """The answer to `HandBack`: how many generations this replica cut short and handed back."""

    replica: str
    requests: int


@dataclass(frozen=True)
class Cut:
    """The answer to `CutGenerations`: how many generations this replica cut."""

    replica: str
    requests: int


@dataclass(frozen=True)
class CacheReset:
    replica: str
    success: bool


@dataclass(frozen=True)
class ReplicaTables:
    """What a replica keeps per adapter name, per run and on disk, counted: on a fleet that runs for weeks while runs
    come and go, each comes back down when they leave (`tests/integration/test_fleet_soak.py`)."""

    name_locks: int  # loads in flight, by name
    unloaded: int  # bucket versions explicitly unloaded, not loaded again on demand (the newest few hundred)
    evicted: int  # names evicted for a slot, remembered for a clear 404 (the newest few hundred)
    run_prefixes: int  # bucket prefixes the replica reads from: the fleet's own and its runs'
    known_versions: int  # committed versions listed or fetched, over every prefix
    leaving_runs: int  # runs gone whose cached folders still hold adapters draining their requests
    cached_versions: int  # adapter folders in the replica's disk cache (its prefixes')
    cache_bytes: int


@dataclass(frozen=True)
class EngineReport:
    """A replica's engine numbers (vLLM's own counters), adapter bookkeeping and the sizes of its tables."""

    replica: str
    pid: int  # the replica's process; its engines run in child processes
    paused: bool
    counters: dict[str, float]  # prefix-cache queries and hits, tokens, running and waiting requests, KV usage
    adapters: tuple[str, ...]  # served now
    engine_adapters: int  # vLLM's own count: adapters + draining, unless vLLM dropped one by itself
    draining: int
    tables: ReplicaTables

    def as_json(self) -> dict[str, Any]:
        """The shape `GET /engine/stats` answers per replica: the counters beside the other fields."""
        return {
            "replica": self.replica,
            "pid": self.pid,
            "paused": self.paused,
            **self.counters,
            "adapters": list(self.adapters),
            "engine_adapters": self.engine_adapters,
            "draining": self.draining,
            "tables": asdict(self.tables),
        }


# ---- commands ---------------------------------------------------------------------------------------


@dataclass(frozen=True)
class Ping(Command):
    """Answer `Pong` if the engine is alive (`/health` counts the live replicas)."""


@dataclass(frozen=True)
class ListAdapters(Command):
    """Answer the `AdapterListing` of this replica."""


@dataclass(frozen=True)
class LoadAdapter(Command):
    """Load adapter `name` from `ref` (a bucket version's path or URL, or a trusted folder); answer `Loaded`.

    `load_id` names the broadcast, so that a failed broadcast undoes only its own loads (`UndoLoad`)."""

    name: str
    ref: str
    load_id: str | None = None


@dataclass(frozen=True)
class UndoLoad(Command):
    """Unload `name` only if the broadcast `load_id` loaded it here; answer `Unloaded`."""

    name: str
    load_id: str


@dataclass(frozen=True)
class UnloadAdapter(Command):
    """Stop serving `name` (requests in flight finish on it first); answer `Unloaded`."""

    name: str


@dataclass(frozen=True)
class ForgetRun(Command):
    """Run `run` left the fleet (removed, or released for its silence): unload its adapters (requests in flight finish
    first) and forget what this replica keeps of it, its bucket prefix, committed versions, names and cached folders;
    answer `RunForgotten`. A replica that starts later never knew the run."""

    run: str


@dataclass(frozen=True)
class Pause(Command):
    """Stop scheduling (vLLM's `mode`: keep, wait or abort) for at most the replica's pause lease; answer `PauseState`."""

    mode: str = "keep"


@dataclass(frozen=True)
class Resume(Command):
    """Schedule again; answer `PauseState`."""


@dataclass(frozen=True)
class HandBack(Command):
    """Cut every generation in flight short and hand it back: the ingress continues each on another replica from
    its tokens so far (`contracts.serving.Generated.handed_back`) and its caller never sees the cut. A draining
    replica does this before its node goes. Answer `HandedBack`."""


@dataclass(frozen=True)
class CutGenerations(Command):
    """Cut every generation in flight under one of `models` (adapter names) now: each answers its caller at once,
    finish reason `abort`, with the tokens it had and their log-probs, for the caller to continue (partial rollouts:
    under a newer version). Answer `Cut`."""

    models: tuple[str, ...]


@dataclass(frozen=True)
class ResetPrefixCache(Command):
    """Drop the engine's prefix cache; answer `CacheReset`."""


@dataclass(frozen=True)
class ReportEngine(Command):
    """Answer this replica's `EngineReport`."""


@dataclass(frozen=True)
class DescribeEngine(Command):
    """Answer the engine's resolved vLLM config as JSON (a dict: the shape vLLM's own `/server_info` returns)."""
