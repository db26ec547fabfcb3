"""Routing: the Ray Serve request router that keeps a group's samples on the replica holding its prefix.

- `router`: `PrefixHashRouter`, Serve's `RequestRouter` for the replicas, with its counters and metrics.
- `prefix`: the policy: chained block hashes seeded by the adapter, the bounded table, affinity or spill.
"""
