"""Config: YAML + overrides validate, and every mistake is one line naming the field."""

import subprocess
import sys

import pytest

from core.config import CONFIG_DIR, ConfigError, load_config, slots_needed


def test_shipped_configs_validate():
    tiny = load_config(CONFIG_DIR / "tiny-cpu.yaml")
    assert tiny.model.name_or_path == "tiny" and tiny.learner.device == "cpu"
    seed = load_config(CONFIG_DIR / "qwen2.5-math-1.5b.yaml")
    assert (seed.lora.rank, seed.lora.alpha, seed.train.learning_rate) == (1, 2.0, 4e-5)
    assert seed.rollout.max_staleness == 4 and seed.own_fleet().max_loras >= seed.rollout.max_staleness + 2


def test_overrides_are_typed_and_nested():
    cfg = load_config(
        None, ["lora.rank=4", "train.learning_rate=3e-4", "fleet.router.block_size=64", "task.reward_funcs=[a, b]"]
    )
    assert cfg.lora.rank == 4 and cfg.train.learning_rate == 3e-4
    assert cfg.fleet.router.block_size == 64 and cfg.task.reward_funcs == ["a", "b"]


@pytest.mark.parametrize(
    "override, field",
    [
        ("lora.rank=-1", "lora.rank"),
        ("lora.rnak=4", "lora.rnak"),
        ("rollout.max_staleness=many", "rollout.max_staleness"),
        ("learner.batching=sorted", "learner.batching"),
        ("lora.rank.x=1", "lora.rank"),
        ("fleet.max_loras=1", "fleet.max_loras"),
        ("objectives=[{kind: dpo}]", "objectives.0"),
        ("objectives=[{kind: grpo, weight: 0}]", "objectives.0.grpo.weight"),
        ("objectives=[{kind: distill}]", "objectives.0.distill"),
        (
            "objectives=[{kind: distill, teachers: {a: base, b: {adapter: /x}, c: {adapter: /y}}}]",
            "objectives.0.distill",
        ),
        ("objectives=[{kind: distill, teacher: self}]", "objectives.0.distill.teacher"),
        ("objectives=[{kind: distill, teacher: {url: x, adapter: y}}]", "objectives.0.distill.teacher"),
        ("objectives=[{kind: distill, teacher: {served_model: m}}]", "objectives.0.distill.teacher"),
        ("objectives=[]", "objectives"),
        ("objectives=[{kind: grpo}, {kind: grpo}]", "objectives"),
        ("task.name=reasoning_gym", "task.datasets"),
        ("task.datasets={leg_counting: {}}", "task.datasets"),  # datasets of a task that would ignore them
        ("task.datasets={leg_counting: {weight: 0}}", "task.datasets.leg_counting.weight"),
        ("task.datasets={leg_counting: {config: {seed: 1}}}", "task.datasets.leg_counting.config"),
        ("task.datasets={leg_counting: {config: [1]}}", "task.datasets.leg_counting.config"),
        ("task.reward_weights=[1.0, 2.0]", "task.reward_weights"),  # two weights for one reward function
    ],
)
def test_bad_override_names_the_field(override, field):
    with pytest.raises(ConfigError) as err:
        load_config(None, [override])
    assert field in str(err.value) and "\n" not in str(err.value)


def test_the_held_out_split_scored_by_its_own_reward_funcs_weighs_each_one():
    from core.config.evaluation import scored_as_evaluated

    weighed = ["task.reward_funcs=[j, exact_answer]", "task.reward_weights=[0.5, 2.0]"]
    assert scored_as_evaluated(load_config(None, weighed)).task.weights() == [0.5, 2.0]
    judged_apart = scored_as_evaluated(load_config(None, [*weighed, "eval.reward_funcs=[exact_answer]"])).task
    assert judged_apart.reward_funcs == ["exact_answer"] and judged_apart.weights() == [1.0]


def test_malformed_yaml_and_bad_shapes(tmp_path):
    bad = tmp_path / "bad.yaml"
    bad.write_text("lora:\n  rank: [1,\n")
    with pytest.raises(ConfigError, match="malformed YAML"):
        load_config(bad)
    bad.write_text("- just\n- a list\n")
    with pytest.raises(ConfigError, match="mapping"):
        load_config(bad)
    with pytest.raises(ConfigError, match="KEY=VALUE"):
        load_config(None, ["lora.rank"])
    with pytest.raises(ConfigError, match="cannot read"):
        load_config(tmp_path / "missing.yaml")


@pytest.mark.parametrize(
    "args, needle",
    [
        (["--set", "lora.rank=-1"], "lora.rank"),
        (["--set", "bogus.key=1"], "bogus"),
        (["--config", "MALFORMED"], "malformed YAML"),
        (["--set", "env.factory=no_such_module_xyz:Env"], "env.factory"),
        (["--set", "env.verifiers={taskset: 'no_such_module_xyz:Taskset'}"], "env.verifiers.taskset"),
        (["--set", "env.verifiers={taskset: no-such-taskset-v1}"], "env.verifiers.taskset"),
    ],
)
def test_train_cli_exits_2_with_one_line(args, needle, tmp_path):
    if "MALFORMED" in args:
        bad = tmp_path / "bad.yaml"
        bad.write_text("grpo: {max_steps: 3\n")
        args = ["--config", str(bad)]
    proc = subprocess.run([sys.executable, "-m", "launch.train", *args], capture_output=True, text=True, timeout=120)
    assert proc.returncode == 2, proc.stderr
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1 and needle in lines[0] and "Traceback" not in proc.stderr


def test_one_node_gpu_config_needs_no_custom_resources_and_shares_one_gpu():
    cfg = load_config("configs/qwen2.5-math-1.5b-1node.yaml")
    assert not cfg.fleet.replica_resources and not cfg.learner.ray_resources  # nothing a single box lacks
    gpus = cfg.learner.num_workers * cfg.learner.num_gpus_per_worker
    gpus += cfg.fleet.num_replicas * cfg.fleet.num_gpus_per_replica
    assert cfg.learner.device == "cuda" and gpus <= 1
    assert cfg.fleet.gpu_memory_utilization <= 0.5  # the learner keeps the rest of the shared GPU
    assert (
        cfg.rollout.max_inflight_tasks * cfg.sampling.num_generations <= cfg.fleet.max_num_seqs * cfg.fleet.num_replicas
    )
    assert cfg.bucket.url.startswith("file://")


def test_request_limits_are_fleet_settings_with_safe_defaults():
    from core.config import FleetSettings

    limits = ("max_request_bytes", "max_json_depth", "max_prompts_per_request", "max_sequences_per_request")
    fleet = FleetSettings()
    assert fleet.max_prompts_per_request == 1024  # vLLM's VLLM_MAX_COMPLETION_PROMPTS
    assert fleet.max_request_bytes == 16 * 2**20 and fleet.max_json_depth == 32
    for name in (*limits, "max_text_chars"):
        description = FleetSettings.model_fields[name].description
        assert description and "\n" not in description, name
    cfg = load_config(None, ["fleet.max_request_bytes=65536", "fleet.max_text_chars=100"])
    assert (cfg.fleet.max_request_bytes, cfg.fleet.max_text_chars) == (65536, 100)
    with pytest.raises(ConfigError, match="fleet.max_json_depth"):
        load_config(None, ["fleet.max_json_depth=0"])


def test_a_run_and_a_fleet_are_configured_apart():
    """A fleet is a product of its own (`FleetConfig`, what serve_config.yaml names); a run either brings one along,
    sized for itself from its `fleet` section, or joins one (`join.url`), stating its own rank and window there."""
    from core.config import DEFAULT_FLEET_CONFIG, load_fleet_config

    run = load_config(None, ["lora.rank=4", "rollout.max_staleness=3"])
    own = run.own_fleet()
    assert (own.max_loras, own.max_lora_rank, own.max_staleness, own.window) == (5, 8, 3, 4)  # its window + 1, vLLM's 8
    assert own.bucket_url == run.bucket_url and own.model == run.model  # a fleet names no task (`tiny.build`)
    assert load_config(None, ["fleet.max_loras=9"]).own_fleet().max_loras == 9  # as its fleet section says
    with pytest.raises(ConfigError, match="lora.rank=16 exceeds fleet.max_lora_rank=8"):
        load_config(None, ["lora.rank=16", "fleet.max_lora_rank=8"])
    with pytest.raises(ConfigError, match="fleet.join_url: unknown key"):  # a client's setting, no longer the server's
        load_config(None, ["fleet.join_url=http://127.0.0.1:8000"])
    assert load_config(None, ["join.url=http://127.0.0.1:8000"]).fleet_run == "tiny-cpu"

    seed_fleet = load_fleet_config(CONFIG_DIR / "fleet-qwen2.5-math-1.5b.yaml")  # the cluster's shared fleet
    seed_run = load_config(CONFIG_DIR / "qwen2.5-math-1.5b.yaml")
    assert seed_fleet.model == seed_run.model and seed_fleet.fleet.replica_resources == {"rollout_node": 1}
    assert seed_fleet.max_loras >= slots_needed([seed_run.rollout.max_staleness + 1] * 3)

    fleet = load_fleet_config()  # configs/fleet-tiny-cpu.yaml, which serve_config.yaml names
    assert "fleet-tiny-cpu.yaml" in str(DEFAULT_FLEET_CONFIG)
    assert fleet.bucket_url == "file://runs/fleet/bucket" and fleet.model.name_or_path == "tiny"
    assert (fleet.max_loras, fleet.max_lora_rank, fleet.window) == (8, 8, 3)
    with pytest.raises(ConfigError, match="rollout: unknown key"):  # a run's settings have no place in a fleet's
        load_fleet_config(None, ["rollout.max_staleness=2"])
    with pytest.raises(ConfigError, match=r"fleet.max_loras must be >= max_staleness \+ 2 = 6"):
        load_fleet_config(None, ["fleet.max_staleness=4", "fleet.max_loras=5"])


def test_every_field_of_a_run_and_a_fleet_says_what_it_is_in_one_line():
    from pydantic import BaseModel

    from core.config import FleetConfig, RunConfig

    def fields(model: type[BaseModel], prefix: str = ""):
        for name, info in model.model_fields.items():
            yield f"{prefix}{name}", info
            annotation = info.annotation
            if isinstance(annotation, type) and issubclass(annotation, BaseModel):
                yield from fields(annotation, f"{prefix}{name}.")

    for schema in (RunConfig, FleetConfig):
        missing = [name for name, info in fields(schema) if not info.description or "\n" in info.description]
        assert missing == [], schema.__name__


def test_a_model_teacher_holds_the_students_context_or_is_refused_at_start():
    """A teacher shorter than the student would refuse to score every longer sample: refused, naming the field; one
    that names no context gets the student's."""
    from core.config import load_fleet_config

    sized = load_config(
        None, ["model.max_model_len=512", "objectives=[{kind: distill, teacher: {model: {name_or_path: t}}}]"]
    )
    assert sized.teacher.model.max_model_len == 512 and sized.own_fleet().teacher.model.max_model_len == 512
    with pytest.raises(ConfigError, match=r"objectives\[0\].teacher.model.max_model_len=256 .*=512") as err:
        load_config(
            None,
            [
                "model.max_model_len=512",
                "objectives=[{kind: distill, teacher: {model: {name_or_path: t, max_model_len: 256}}}]",
            ],
        )
    assert "\n" not in str(err.value)
    with pytest.raises(ConfigError, match="teacher.model.max_model_len=128"):
        load_fleet_config(None, ["model.max_model_len=256", "teacher={model: {name_or_path: t, max_model_len: 128}}"])
    fleet = load_fleet_config(None, ["model.max_model_len=96", "teacher={model: {name_or_path: t}}"])
    assert fleet.teacher.model.max_model_len == 96


def test_a_teacher_adapter_may_be_named_by_the_folder_of_a_committed_version(tmp_path, monkeypatch):
    """What a finished run leaves on disk (`runs/<run>/bucket/adapters/policy-v3`) names that committed version: its
    URL, whose lineage the run's own fleet trusts; a PEFT folder stays a folder."""
    from core.bucket.store import AdapterStore
    from tests.support.replica_parts import adapter_folder

    AdapterStore(f"file://{tmp_path}/runs/old/bucket", cache_dir=tmp_path / "cache").publish(
        adapter_folder(tmp_path / "src", b"w"), 3
    )
    monkeypatch.chdir(tmp_path)
    cfg = load_config(None, ["objectives=[{kind: distill, teacher: {adapter: runs/old/bucket/adapters/policy-v3}}]"])
    assert cfg.teacher.adapter == f"file://{tmp_path}/runs/old/bucket/adapters/policy-v3"
    assert cfg.own_fleet().fleet.extra_adapter_buckets == [f"file://{tmp_path}/runs/old/bucket"]
    peft = load_config(None, [f"objectives=[{{kind: distill, teacher: {{adapter: {tmp_path}/src}}}}]"])
    assert peft.teacher.adapter == f"{tmp_path}/src" and peft.own_fleet().fleet.extra_adapter_dirs == [str(tmp_path)]
