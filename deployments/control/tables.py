"""What the ingress keeps per run and per request, counted, as one typed report (`GET /server_info` → `spotrl.ingress`).

A fleet stays up for weeks while runs come and go: every table the ingress keeps must come back down when they
leave (the registry and its idle clocks, the fair share's tenants and slots gauges) or be bounded by a setting (the
poison table: `fleet.poison_max_entries`, each entry for `fleet.poison_ttl_s`). The report shows an operator that
they do, and so does the soak test (`tests/integration/test_fleet_soak.py`); the replicas report theirs in
`GET /engine/stats` (`contracts.control.ReplicaTables`).
"""

from __future__ import annotations

import os
from dataclasses import dataclass

from deployments.control.backend import Backend
from deployments.control.fair_share import FairShare
from deployments.control.runs import Runs


@dataclass(frozen=True)
class IngressTables:
    pid: int  # the ingress's process (its memory is the operator's to watch)
    runs: int  # registrations
    idle_clocks: int  # when each run was last heard of
    fair_share_tenants: int  # runs with counters in the fair share (those registered, or with generations in flight)
    slots_gauges: int  # runs whose slots gauge is not 0
    poison_entries: int  # fingerprints of requests that killed two engines, refused for a while


def ingress_tables(runs: Runs, gate: FairShare, backend: Backend) -> IngressTables:
    return IngressTables(pid=os.getpid(), **runs.sizes(), **gate.sizes(), **backend.sizes())
