"""The ingress's control layer: what the fleet's HTTP routes (`deployments.api`) stand on, without HTTP.

- `backend`: the fleet as one `Backend` (Ray Serve in production, a fake in unit tests).
- `broadcast`: `contracts.control` commands to every live replica, all or none (the load with its rollback).
- `membership`: the replicas the fleet is meant to have, and those that answer.
- `runs`, `tenancy`: the registry of a shared fleet's runs; runs registered, removed and released with their
  bucket records and their adapters.
- `fair_share`, `run_metrics`: the runs' weighted share of in-flight generations, and its per-run metrics.
- `upkeep`: the background task that releases idle runs and refreshes the slots gauges.
- `errors`, `offload`: refusals with an HTTP status; worker threads for blocking work.
"""
