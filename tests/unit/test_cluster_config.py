"""cluster.yaml is a valid `ray up` config for the layout the design promises, checked without launching."""

from pathlib import Path

import yaml

from app.config import load_config

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
        assert node["resources"][resource] >= 1
        assert "IamInstanceProfile" in node["node_config"]  # bucket access without keys on disk
    assert nodes["learner"]["min_workers"] == 1 and nodes["learner"]["resources"]["learner_node"] == 1
    assert any("metrics-export-port" in c for c in cfg["head_start_ray_commands"])
    assert any("make setup" in c for c in cfg["setup_commands"])


def test_rollout_nodes_are_h200_with_one_replica_per_gpu_and_the_seed_config_fills_them():
    rollout = load_cluster()["available_node_types"]["rollout"]
    assert rollout["node_config"]["InstanceType"] in ("p5e.48xlarge", "p5en.48xlarge")  # 8x H200
    assert rollout["resources"]["rollout_node"] == 8
    seed = load_config(REPO / "configs" / "qwen2.5-math-1.5b.yaml")
    assert seed.fleet.replica_resources == {"rollout_node": 1} and seed.fleet.num_gpus_per_replica == 1
    assert seed.fleet.num_replicas == rollout["min_workers"] * rollout["resources"]["rollout_node"]


def test_only_the_learner_writes_the_bucket():
    nodes = load_cluster()["available_node_types"]
    profiles = {name: node["node_config"]["IamInstanceProfile"]["Arn"] for name, node in nodes.items()}
    assert profiles["learner"].endswith("-rw")
    assert all(arn.endswith("-ro") for name, arn in profiles.items() if name != "learner")


def test_ray_token_auth_on_every_node_and_ssh_not_open_to_the_world():
    cfg = load_cluster()
    for command in cfg["head_start_ray_commands"] + cfg["worker_start_ray_commands"]:
        assert "ray start" not in command or "RAY_AUTH_MODE=token" in command
    assert "~/.ray/auth_token" in cfg["file_mounts"]  # the head's token, shipped to the workers
    rules = cfg["provider"]["security_group"]["IpPermissions"]
    ranges = [r["CidrIp"] for rule in rules for r in rule.get("IpRanges", [])]
    assert ranges and "0.0.0.0/0" not in ranges


def test_cluster_nodes_install_a_python_the_pinned_stack_supports():
    setup = " ".join(load_cluster()["setup_commands"])
    assert "python3.11" in setup and "PYTHON=python3.11" in setup
    seed = load_config(REPO / "configs" / "qwen2.5-math-1.5b.yaml")
    assert f"hf download {seed.model.name_or_path}" in setup  # the model fetched once per node
