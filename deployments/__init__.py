"""The fleet: one Ray Serve application of an ingress in front of vLLM replicas, above the base (`core/`).

In wings, as the architecture picture draws it:

- `deployments.ingress`: the Serve shell of the ingress (`shell`: the HTTP app on a Serve handle to the replicas),
  hand-back continuation of a draining replica's work (`handback`), the poison table (`poison`).
- `deployments.replica`: the Serve shell of a replica (`shell`) over its parts: the vLLM engine (`engine`,
  `engine_stats`, `engine_watchdog`, `scoring_temperature`), the LoRA slots (`adapter_slots`) and where adapters come from
  (`adapter_sources`), the in-flight table (`inflight`), spot notices (`notices`, `serve_state`), warm start
  (`warm_start`), a teacher deployment (`teacher`).
- `deployments.routing`: the prefix-hash request router (`router`) and its policy (`prefix`).
- `deployments.api`: the HTTP routes, by job; `deployments.control`: what they stand on, without HTTP.
- `deployments.tinker`: the Tinker API, a Serve application beside the fleet's (route prefix `/api`).
- at its root: the builder and lifecycle (`fleet`), autoscaling (`autoscaling`), a lock per key (`keyed_lock`).

It imports `core/` and `contracts/` only; `serve_config.yaml` builds it through `launch.serve`.
"""
