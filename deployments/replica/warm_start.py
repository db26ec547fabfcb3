"""The adapters a replica loads before it takes traffic: every lineage's pinned versions, from the bucket alone.

A replica that starts (a spot replacement, one the autoscaler added mid-run, a restart) missed every load
broadcast before it, so it reads what to serve from the bucket, the durable record: the fleet's own newest
versions (`AdapterSources.to_serve`) of each of its lineages (the policy's, and the `ema-vN` average a learner with
an `ema` self teacher publishes beside it), and for every run registered on the fleet (its record under
`<bucket>/fleet/runs/`, `core.bucket.records.RunRecords`) the newest versions of its window (its
`max_staleness` + 1, the fleet's when it registered none) under the run's own prefix, of each lineage it registered
(its policy; its ema average too when it registered two). A version it still lacks
is loaded on the first request that names it (`deployments.replica.adapter_slots`), so a bucket that cannot be listed
right now delays the first requests, never fails them.
"""

from __future__ import annotations

import asyncio
import logging

from contracts.adapters import BUCKET_STEMS, EMA_STEM, POLICY_STEM, AdapterRef, adapter_name, run_prefix
from core.bucket.records import RunRecords
from core.bucket.store import adapter_store
from core.config import FleetConfig
from deployments.replica.adapter_sources import AdapterSources, newest

log = logging.getLogger("ray.serve")


async def adapters_to_serve(cfg: FleetConfig, sources: AdapterSources, bucket_url: str) -> list[tuple[str, str]]:
    """(name, ref) of every adapter to load, oldest first per lineage: the fleet's own, then each run's."""
    own = [(adapter_name(version), adapter_name(version)) for version in await sources.to_serve()]
    try:
        averages = await sources.to_serve(EMA_STEM)
    except Exception as e:  # noqa: BLE001 - loaded on demand instead
        log.warning("replica: the fleet's ema versions cannot be listed (%r); they load on demand", e)
        averages = []
    own += [(adapter_name(v, stem=EMA_STEM), adapter_name(v, stem=EMA_STEM)) for v in averages]
    try:
        records = await asyncio.to_thread(RunRecords.from_config(cfg, bucket_url).load)
    except Exception as e:  # noqa: BLE001 - loaded on demand instead
        log.warning("replica: the fleet's run records cannot be read (%r); runs' adapters load on demand", e)
        return own
    runs = []
    for run, record in sorted(records.items()):
        staleness = record.get("max_staleness")
        window = (cfg.max_staleness if staleness is None else staleness) + 1
        for stem in BUCKET_STEMS if (record.get("lineages") or 1) > 1 else (POLICY_STEM,):
            store = adapter_store(stem).at(run_prefix(bucket_url, run), cfg.bucket)
            try:
                versions = await asyncio.to_thread(store.versions)
            except Exception as e:  # noqa: BLE001
                log.warning("replica: run %s's %s versions cannot be listed (%r); they load on demand", run, stem, e)
                continue
            refs = [AdapterRef(v, run, stem) for v in newest(versions, window)]
            runs += [(ref.name, ref.key) for ref in refs]
    return own + runs
