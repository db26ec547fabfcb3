"""cluster.yaml is a valid `ray up` config for the layout the design promises, checked without launching."""

from pathlib import Path

import yaml

REPO = Path(__file__).resolve().parents[2]


def load_cluster() -> dict:
    return yaml.safe_load((REPO / "cluster.yaml").read_text())


def test_cluster_yaml_passes_rays_schema():
    from ray.autoscaler._private.util import fillout_defaults, validate_config

    # What `ray up` does before launching: merge the provider's defaults, then validate (no cloud call).
    validate_config(fillout_defaults(load_cluster()))  # raises on any schema violation


def test_cluster_layout_on_demand_head_and_spot_workers():
    cfg = load_cluster()
    nodes = cfg["available_node_types"]
    head = nodes[cfg["head_node_type"]]
    assert "InstanceMarketOptions" not in head["node_config"]  # the head must not be preempted
    for name, resource in (("learner", "learner_node"), ("rollout", "rollout_node")):
        node = nodes[name]
        assert node["node_config"]["InstanceMarketOptions"]["MarketType"] == "spot"
        assert node["resources"][resource] == 1
        assert "IamInstanceProfile" in node["node_config"]  # bucket access without keys on disk
    assert nodes["rollout"]["min_workers"] >= 2 and nodes["learner"]["min_workers"] == 1
    assert any("metrics-export-port" in c for c in cfg["head_start_ray_commands"])
    assert any("make setup" in c for c in cfg["setup_commands"])
