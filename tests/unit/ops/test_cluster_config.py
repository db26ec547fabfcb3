"""cluster.yaml is a valid `ray up` config for the layout the design promises, checked without launching."""

import yaml

from core.config import load_config
from tests.support import REPO


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


def test_the_rollout_group_is_diversified_8_gpu_spot_nodes_one_replica_per_gpu_and_the_seed_config_fills_it():
    nodes = load_cluster()["available_node_types"]
    rollout = {name: node for name, node in nodes.items() if "rollout_node" in node["resources"]}
    types = {node["node_config"]["InstanceType"] for node in rollout.values()}
    assert len(types) >= 3 and types <= {"p5e.48xlarge", "p5en.48xlarge", "p5.48xlarge"}  # 8x H200 or H100
    assert all(node["resources"]["rollout_node"] == 8 for node in rollout.values())
    assert all(node["node_config"]["InstanceMarketOptions"]["MarketType"] == "spot" for node in rollout.values())
    assert all(node["max_workers"] > node["min_workers"] for node in rollout.values())  # room for the autoscaler
    assert len(load_cluster()["provider"]["availability_zone"].split(",")) >= 3
    seed = load_config(REPO / "configs" / "qwen2.5-math-1.5b.yaml")
    assert seed.fleet.replica_resources == {"rollout_node": 1} and seed.fleet.num_gpus_per_replica == 1
    assert seed.fleet.num_replicas == sum(n["min_workers"] * n["resources"]["rollout_node"] for n in rollout.values())


def test_only_the_learner_writes_runs_and_only_the_head_writes_the_fleets_records():
    """The head (the fleet's ingress) writes exactly `<bucket>/fleet/*`, where the records of runs lie; the learner writes
    the rest and never that prefix; the rollout nodes read (ops/aws/bucket-policies.json)."""
    import json

    from contracts.adapters import RECORDS_PREFIX

    nodes = load_cluster()["available_node_types"]
    profiles = {
        name: node["node_config"]["IamInstanceProfile"]["Arn"].rsplit("/", 1)[1] for name, node in nodes.items()
    }
    assert profiles["learner"] == "spotrl-bucket-rw" and profiles["head"] == "spotrl-bucket-ro-records"
    assert all(p == "spotrl-bucket-ro" for name, p in profiles.items() if name not in ("learner", "head"))
    policies = json.loads((REPO / "ops" / "aws" / "bucket-policies.json").read_text())

    def writes(profile: str) -> dict[str, set[str]]:
        out: dict[str, set[str]] = {"Allow": set(), "Deny": set()}
        for s in policies[profile]["Statement"]:
            if {"s3:PutObject", "s3:DeleteObject"} & set(s["Action"]):
                out[s["Effect"]].add(s["Resource"])
        return out

    records = f"arn:aws:s3:::BUCKET/{RECORDS_PREFIX}/*"
    assert writes("spotrl-bucket-ro-records") == {"Allow": {records}, "Deny": set()}
    assert writes("spotrl-bucket-rw") == {"Allow": {"arn:aws:s3:::BUCKET/*"}, "Deny": {records}}
    assert writes("spotrl-bucket-ro") == {"Allow": set(), "Deny": set()}


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
