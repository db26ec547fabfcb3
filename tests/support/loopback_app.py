"""The smallest Serve application, for `make serve`'s head in tests/integration/test_loopback.py.

`serve run` on it starts what the fleet's would on the head (the Serve controller, the HTTP proxy, a
replica with Serve's per-replica gRPC server) without a vLLM engine's minute of start-up.
"""

from ray import serve


@serve.deployment(num_replicas=1, ray_actor_options={"num_cpus": 0})
class Echo:
    async def __call__(self, request) -> str:
        return "ok"


app = Echo.bind()
