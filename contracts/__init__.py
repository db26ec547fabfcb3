"""Contracts: what both products of spotrl agree on, on the ground floor, importing nothing of ours.

spotrl is two products that share a bucket: the roles of a run (`app/`: learner, rollout, objectives, tasks) and
the fleet that serves it (`deployments/`: ingress, replicas, routing, api, control). Both stand on the base
(`core/`: config, bucket, model paths, the local Ray), which stands on this package; neither imports the other,
and only the entry points (`launch/`) import both. `tests/unit/test_layers.py` scans every import and fails on a
violation or on any import circle.

- `contracts.adapters`: one spelling for an adapter's fleet name, its bucket key and its run's prefix.
- `contracts.serving`: what crosses the Serve handle for a generation (request, answer, failures), the deployments'
  names, the wire's log-prob floor and the engines' scoring room.
- `contracts.control`: the fleet's control calls as typed commands and replies.
- `contracts.rollouts`: samples, groups and batches, as the rollout produces and the learner trains them.
- `contracts.auth`: which token applies and how it is checked; the fleet's signing secret and each lineage's key.
- `contracts.retry`: who retries what, with one backoff policy.
- `contracts.tinker`: what the Tinker API's HTTP side and its learner actor agree on (names, typed calls, losses).
- `contracts.notices`, `contracts.notice_sources`, `contracts.notice_watcher`: spot interruption notices, where
  each cloud says one, and the watcher thread that hears them first.
"""
