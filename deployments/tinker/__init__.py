"""The Tinker API: the HTTP side of a self-hosted, spot-native Tinker, beside the fleet ([docs](../../docs/tinker-api.md)).

- `deployments.tinker.service`: the app, its state and upkeep; `deployments.tinker.shell`: the Serve application;
- routes by job, over the service's parts (`routes`): `session_routes` (client config, sessions, keys, futures),
  `training_routes`, `sampling_routes`, `checkpoint_routes` (the `RestClient`'s);
- `callers` (API key -> tenant, its clients), `recovery` (lost learners, restores, notice saves, orphans), `records`
  (the key's tinker paths in the bucket), `http` (bodies, the SDK's error shape);
- `wire` (protobuf, zstd), `futures`, `sessions`, `turns`, `tenants`, `lanes`, `limits`, `paths`, `exports`;
- `fleet_calls`: what it asks the fleet; `learner_handle`: the learner actor as a `contracts.tinker.TinkerBackend`;
- `settings`: the fleet's `tinker:` section and what the service derives from the fleet.
"""
