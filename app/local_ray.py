"""Start or join Ray for a run: the one place that decides what a Ray of ours listens on."""

from __future__ import annotations

import os


def start_ray(address: str | None) -> bool:
    """Join `address`, or start a loopback-only local Ray; True when we started it (so we stop it)."""
    import ray

    if address:
        ray.init(address=address)
        return False
    # Actor and replica logs stay in Ray's session folder (and the dashboard), so the terminal shows the run.
    ray.init(
        address="local",
        num_cpus=max(8, os.cpu_count() or 1),
        include_dashboard=True,
        dashboard_host="127.0.0.1",
        _node_ip_address="127.0.0.1",
        log_to_driver=False,
        runtime_env={
            "env_vars": {"HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1", "TOKENIZERS_PARALLELISM": "false"}
        },
    )
    return True
