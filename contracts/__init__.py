"""Contracts: what both sides of spotrl agree on, below both of them.

spotrl is two products that share a bucket: the roles of a run (`app/`: driver, learner, rollout, tasks)
and the fleet that serves it (`deployments/`: ingress, replicas, router). Both import this package and
the config and bucket layers of `app/` (`core.config`, `core.bucket`, `core.models`); neither imports the
other's roles, and the driver (`launch.train`) is the one module that wires both. `tests/unit/test_layers.py`
scans every import and fails on a violation.

- `contracts.adapters`: one spelling for an adapter's fleet name, its bucket key and its run's prefix.
- `contracts.serving`: what crosses the Serve handle for a generation (request, answer, failures).
- `contracts.control`: the fleet's control calls as typed commands and replies.
- `contracts.rollouts`: samples, groups and batches, as the rollout produces and the learner trains them.
- `contracts.auth`, `contracts.retry`: which token applies and how it is checked; who retries what.
"""
