"""The Tinker API: the HTTP side of a self-hosted, spot-native Tinker, beside the fleet ([docs](../../docs/tinker-api.md)).

- `deployments.tinker.service`: the routes the unchanged `tinker` SDK calls, answered with its own types;
- `deployments.tinker.wire`: its protobuf bodies both ways (`tinker_public_pb2`), zstd;
- `deployments.tinker.futures`: accepted requests and their results by id;
- `deployments.tinker.sessions`: sessions, training clients (in `seq_id` order), samplers, capacity, idle release;
- `deployments.tinker.fleet_calls`: API keys to run tokens, and what it asks the fleet (samples, loads, lineages);
- `deployments.tinker.learner_handle`: the learner actor, by name (`contracts.tinker`);
- `deployments.tinker.settings`: capacity and limits; `deployments.tinker.shell`: the Serve application.
"""
