"""The learner under Ray: 2-rank FSDP on the CPU equals 1 rank, and a killed worker resumes exactly.

A small random Qwen2 keeps these fast; the log-prob agreement with vLLM on the real tiny model is in
test_learner_vllm.py. Ray runs on loopback only, with 2 CPUs (one per learner rank).
"""

import json
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import pytest
import torch
from safetensors.torch import load_file

from app.learner.group import LearnerGroup
from app.learner.rank import LearnerRank
from app.messages import ResumePoint
from contracts.rollouts import RolloutBatch
from core.bucket.store import AdapterStore
from tests.support.learner_parts import learner_config, random_groups, random_model

STEP_GROUPS = [random_groups(3, seed=s, first_id=100 * s) for s in range(3)]


def batch(step: int, data_cursor: int | None = None) -> RolloutBatch:
    return RolloutBatch(STEP_GROUPS[step], data_cursor=data_cursor)


@pytest.fixture(scope="module")
def ray_local():
    import ray

    ray.init(
        address="local",
        num_cpus=2,
        resources={"learner_node": 1},  # as cluster.yaml labels the learner node
        include_dashboard=False,
        _node_ip_address="127.0.0.1",
        configure_logging=False,
    )
    yield ray
    ray.shutdown()


@pytest.fixture(scope="module")
def model_path(tmp_path_factory):
    return random_model(tmp_path_factory.mktemp("model"))


def _config(tmp_path, bucket: str, **learner):
    cfg = learner_config(**learner)
    cfg.bucket.url = f"file://{tmp_path}/{bucket}"
    cfg.bucket.cache_dir = str(tmp_path / "cache")
    cfg.train.learning_rate = 1e-2  # large steps, so that a wrong update cannot hide inside the tolerance
    return cfg


def _run_in_process(cfg, model_path, steps):
    torch.set_num_threads(1)
    learner = LearnerRank(cfg, model_path)
    learner.setup()
    learner.start()
    results = [learner.train_step(RolloutBatch(groups, data_cursor=i + 1)) for i, groups in enumerate(steps)]
    return learner, results


def _assert_same_tensors(a: dict, b: dict, atol: float):
    assert a.keys() == b.keys()
    for name in a:
        torch.testing.assert_close(a[name], b[name], atol=atol, rtol=0, msg=name)


def test_two_fsdp_ranks_update_the_adapter_like_one(ray_local, tmp_path, model_path):
    ref, ref_results = _run_in_process(_config(tmp_path, "one"), model_path, STEP_GROUPS)
    group = LearnerGroup(_config(tmp_path, "two", num_workers=2, ray_resources={"learner_node": 1}), model_path)
    try:
        assert group.start().policy_version == 0
        results = [group.train_step(batch(i, data_cursor=i + 1)) for i in range(len(STEP_GROUPS))]
        two = group.adapter_state_dict()
    finally:
        group.shutdown()
    one = ref.adapter_state_dict()
    assert (
        max(
            (v - ref_v).abs().max().item() for v, ref_v in zip(one.values(), _initial(model_path).values(), strict=True)
        )
        > 1e-3
    )  # it did train
    _assert_same_tensors(two, one, atol=1e-5)
    for m, r in zip(results, ref_results, strict=True):
        assert m.metrics["loss"] == pytest.approx(r.metrics["loss"], abs=1e-6)
        assert m.metrics["ratio"] == pytest.approx(r.metrics["ratio"], abs=1e-6)
        assert m.policy_version == r.policy_version
    # What was published is the whole adapter (gathered from both shards), in PEFT's naming.
    folder = AdapterStore.from_config(_config(tmp_path, "two")).fetch(3)
    published = load_file(folder / "adapter_model.safetensors")
    assert len(published) == len(two)
    for name, tensor in two.items():
        torch.testing.assert_close(published[name.replace(".default.", ".")], tensor, atol=0, rtol=0)


def _initial(model_path):
    fresh = LearnerRank(learner_config(), model_path)
    fresh.setup()
    return fresh.adapter_state_dict()


def test_killed_worker_resumes_from_checkpoint_and_matches_uninterrupted_run(ray_local, tmp_path, model_path):
    ref, ref_results = _run_in_process(_config(tmp_path, "ref", save_steps=2), model_path, STEP_GROUPS)
    cfg = _config(tmp_path, "bucket", save_steps=2)
    group = LearnerGroup(cfg, model_path)
    try:
        group.start()
        group.train_step(batch(0, data_cursor=1))
        group.train_step(batch(1, data_cursor=2))  # checkpoint at step 2
        ray_local.kill(group.workers[0], no_restart=False)  # as a preemption would: Ray restarts it

        # The ObjectRef of a batch, as the driver passes the rollout's: retried after the death, it is sent again.
        result = group.train_step(ray_local.put(batch(2, data_cursor=3)))
        # Step 0's groups (ids 0-2) are the frontier now; step 1's (100-102) lie above it, ahead of ids never trained.
        consumed = tuple(g.group_id for g in STEP_GROUPS[1])
        assert group.last_resume == ResumePoint(
            step=2, policy_version=2, data_cursor=2, consumed_group_ids=consumed, consumed_frontier=3
        )
        assert result.metrics["learner/restarts"] == 1 and result.metrics["learner/resumed_step"] == 2
        assert result.step == 3 and result.policy_version == ref_results[2].policy_version == 3
        assert result.trained_group_ids == [g.group_id for g in STEP_GROUPS[2]]
        assert result.metrics["loss"] == pytest.approx(ref_results[2].metrics["loss"], abs=1e-7)
        _assert_same_tensors(group.adapter_state_dict(), ref.adapter_state_dict(), atol=1e-7)
        resumed_optim, ref_optim = group.optimizer_state_dict()["state"], ref.optimizer_state_dict()["state"]
        assert resumed_optim.keys() == ref_optim.keys()
        for name in ref_optim:
            _assert_same_tensors(resumed_optim[name], ref_optim[name], atol=1e-7)

        replay = group.train_step(batch(2, data_cursor=4))  # the driver re-sends groups: not trained twice
        assert replay.metrics["batch/skipped_groups"] == 3 and replay.step == 3
        assert replay.metrics["learner/skipped_step"] == 1 and replay.trained_group_ids == []
    finally:
        group.shutdown()

    # The whole learner restarts (a new driver): it resumes from the step-2 checkpoint, but policy-v3 (from
    # the lost step 3) is in the bucket, so it republishes its weights above it: versions never go back.
    # (In-process: the same `LearnerRank.start` the workers run, without paying for a new worker process.)
    again = LearnerRank(cfg, model_path)
    again.setup()
    state = again.start()
    assert state.step == 2 and state.data_cursor == 2 and state.policy_version == 4
    assert AdapterStore.from_config(cfg).latest() == 4
    assert again.train_step(batch(2)).policy_version == 5


class _FakeFleet(BaseHTTPRequestHandler):
    """Records admin calls; answers 400 (not retried) once `fail` is set."""

    calls: list = []
    fail = False

    def do_POST(self):  # noqa: N802 - http.server's naming
        body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
        type(self).calls.append((self.path, body, self.headers.get("Authorization")))
        payload = json.dumps({"error": "refused"} if self.fail else {"ok": True}).encode()
        self.send_response(400 if self.fail else 200)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(payload)))
        self.end_headers()
        self.wfile.write(payload)

    def log_message(self, *args):
        pass


def test_each_publish_asks_the_fleet_to_load_it_and_a_fleet_error_does_not_stop_training(tmp_path, model_path):
    server = ThreadingHTTPServer(("127.0.0.1", 0), _FakeFleet)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    cfg = _config(tmp_path, "fleet")
    store = AdapterStore.from_config(cfg)
    learner = LearnerRank(cfg, model_path, fleet_url=f"http://127.0.0.1:{server.server_port}", fleet_token="secret")
    try:
        learner.setup()
        learner.start()
        assert _FakeFleet.calls == [
            ("/v1/load_lora_adapter", {"lora_name": "policy-v0", "lora_path": store.url_of(0)}, "Bearer secret")
        ]
        _FakeFleet.fail = True
        result = learner.train_step(batch(0))
        assert result.policy_version == 1 and result.metrics["weight_sync/fleet_load_failures"] == 1
        assert _FakeFleet.calls[-1][1]["lora_name"] == "policy-v1"
        assert store.latest() == 1  # in the bucket all the same, for replicas that start later
    finally:
        learner.close()
        server.shutdown()
