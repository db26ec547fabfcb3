"""The ingress: the fleet's one front door, on the head node, in front of the replicas.

- `shell`: the Serve deployment class (`Ingress`) hosting the HTTP app (`deployments.api`) over a Serve handle to the
  replicas (`ServeBackend`): generations retried where a replica died, continued where one handed them back.
- `handback`: a draining replica's unfinished generations continued elsewhere and stitched, token-exact.
- `poison`: requests that killed engines, refused for a while.
"""
