"""A replica: one vLLM engine per Ray Serve replica, serving the base model and LoRA versions from the bucket.

- `shell`: the Serve deployment class (`VLLMReplica`) over `Replica`, the request path and control calls.
- `engine`, `engine_stats`, `engine_watchdog`: the vLLM engine, what it counts, what ends its processes;
  `scoring_temperature`: its workers score prompt tokens at the request's temperature, as they sample.
- `adapter_slots`, `adapter_sources`, `warm_start`: the LoRA slots, where versions come from (verified and signed),
  what a starting replica loads before it takes traffic.
- `inflight`: the generations in flight, cut or handed back; `notices`, `serve_state`: a spot notice for its node.
- `teacher`: a teacher model's own replicas beside the base model's.
"""
