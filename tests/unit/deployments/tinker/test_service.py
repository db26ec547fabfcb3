"""The Tinker API's routes with the SDK's own request and reply types, over a fake learner and a fake fleet: who may
call, bounded and validated bodies, futures, capacity, and the SDK-shaped errors."""

import asyncio
import tempfile
import threading

import numpy as np
import zstandard
from fastapi.testclient import TestClient
from tinker import types
from tinker.proto import tinker_public_pb2 as pb
from tinker.proto.request_conv import forward_backward_request_to_proto
from tinker.proto.response_conv import deserialize_forward_backward_output
from tinker.types.try_again_response import TryAgainResponse

from contracts.adapters import adapter_name
from contracts.auth import Secret
from contracts.tinker import AdapterSpec, Export, LearnerLost, Lineage, LossReply, Publication, StepReply
from deployments.tinker.fleet_calls import FleetCalls, Tenant
from deployments.tinker.service import make_app
from deployments.tinker.settings import TinkerSettings

KEYS = {"tml-a": "alice", "tml-b": "bob"}


class FakeFleet(FleetCalls):
    """The fleet's answers for the keys in `KEYS`; each run's prefix lies in the local bucket folder `root`."""

    def __init__(self, root: str):
        super().__init__("http://127.0.0.1:9", root)
        self.root = root

    async def tenant(self, api_key):
        run = KEYS.get(api_key or "")
        return Tenant(run, api_key) if run else None

    async def lineage(self, tenant):
        return Lineage(f"file://{self.root}/bucket/runs/{tenant.run}", "00", tenant.run, self.root)

    async def load_adapter(self, tenant, model, key):
        return None


class FakeLearner:
    """A `TinkerBackend` that answers at once and logs each call as (method, args); what it commits is numbered, not
    written (the paths the service records for the numbers are real records, in `root`'s bucket)."""

    def __init__(self):
        self.calls, self.lost = [], False
        self.noticed: str | None = None  # what `notice` answers: a spot notice for the learner's node
        self.saves = 0
        self.held: list[str] = []  # what `models` answers: the adapters on the learner
        self.root = tempfile.mkdtemp(prefix="tinker-fake-bucket-")

    async def call(self, method, *args):
        self.calls.append((method, args))
        if self.lost:
            raise LearnerLost("gone")
        if method == "forward_backward":
            call = args[0]
            if call.loss_fn == "nonsense":
                raise ValueError("loss_fn 'nonsense' is not supported here")
            return LossReply([[-1.0] * len(d.target_tokens) for d in call.data], 2.0)
        if method == "optim_step":
            return StepReply(1.0, 1)
        if method == "notice":
            return self.noticed
        if method == "save_state":
            self.saves += 1
            return self.saves
        if method in ("publish", "adopt"):
            return Publication(7, "alice/policy-v7")
        if method == "export":
            return Export(1, {"adapter_model.safetensors": 10})
        if method == "models":
            return self.held
        if method == "load_state":
            return AdapterSpec(8)
        return None

    async def create(self, model, spec):
        return await self.call("create", model, spec)

    async def drop(self, model):
        return await self.call("drop", model)

    async def models(self):
        return await self.call("models")

    async def notice(self):
        return await self.call("notice")

    async def forward_backward(self, call):
        return await self.call("forward_backward", call)

    async def optim_step(self, step):
        return await self.call("optim_step", step)

    async def publish(self, model, lineage):
        return await self.call("publish", model, lineage)

    async def adopt(self, lineage, source, version, source_key):
        return await self.call("adopt", lineage, source, version, source_key)

    async def save_state(self, model, lineage, gradient):
        return await self.call("save_state", model, lineage, gradient)

    async def export(self, model, lineage):
        return await self.call("export", model, lineage)

    async def load_state(self, model, lineage, number, optimizer, source):
        return await self.call("load_state", model, lineage, number, optimizer, source)


def client(max_models=2, max_per_tenant=1, max_body=1 << 16, learner=None, learners=None, admin=None, **limits):
    """The app over fake learners (`learners`, else one: `learner`) and a fake fleet whose bucket is the first
    learner's; the app and the first learner. A fleet of context 128, vocabulary 64, LoRA ranks up to 8 and 16
    completions per request, unless `limits` say."""
    settings = TinkerSettings(
        fleet_url="http://127.0.0.1:9",
        base_model="tiny",
        model_path="/models/tiny",
        cache_dir="/tmp",
        max_models=max_models,
        max_models_per_tenant=max_per_tenant,
        max_body_bytes=max_body,
        poll_wait_s=2.0,
        learner_wait_s=0.5,
        **{"max_context": 128, "vocab_size": 64, "max_lora_rank": 8, "max_samples": 16, **limits},
    )
    learners = learners or [learner or FakeLearner()]
    learner = learners[0]
    app = make_app(settings, learners, admin, FakeFleet(learner.root))
    return TestClient(app), learner


def post(http, path, body, key="tml-a"):
    return http.post(f"/v1/{path}", json=body.model_dump(mode="json", exclude_none=True), headers={"X-API-Key": key})


def result(http, request_id, key="tml-a"):
    return http.post("/v1/retrieve_future", json={"request_id": request_id}, headers={"X-API-Key": key})


def new_model(http, key="tml-a"):
    session = post(http, "create_session", types.CreateSessionRequest(tags=[], user_metadata={}, sdk_version="x"), key)
    session_id = session.json()["session_id"]
    request = types.CreateModelRequest(
        session_id=session_id, model_seq_id=0, base_model="tiny", lora_config=types.LoraConfig(rank=8)
    )
    future = post(http, "create_model", request, key)
    return session_id, future


def test_a_model_is_created_as_a_future_and_its_info_names_the_tokenizer():
    http, learner = client()
    with http:
        _, future = new_model(http)
        assert future.status_code == 200, future.text
        created = types.CreateModelResponse.model_validate(result(http, future.json()["request_id"]).json())
        assert created.model_id.endswith(":train:0") and learner.calls[0][0] == "create"
        info = post(http, "get_info", types.GetInfoRequest(model_id=created.model_id))
        parsed = types.GetInfoResponse.model_validate(info.json())
        assert parsed.model_data.tokenizer_id == "/models/tiny" and parsed.lora_rank == 8


def forward_backward(http, model_id: str, seq_id: int):
    """A `forward_backward` of one datum as the SDK sends it (zstd protobuf); the accepted future's response."""
    datum = types.Datum(
        model_input=types.ModelInput.from_ints([1, 2]), loss_fn_inputs={"target_tokens": [2, 3], "weights": [1, 1]}
    )
    request = types.ForwardBackwardRequest(
        forward_backward_input=types.ForwardBackwardInput(data=[datum], loss_fn="cross_entropy"),
        model_id=model_id,
        seq_id=seq_id,
    )
    body = zstandard.ZstdCompressor().compress(forward_backward_request_to_proto(request).SerializeToString())
    headers = {"X-API-Key": "tml-a", "Content-Type": "application/x-protobuf", "Content-Encoding": "zstd"}
    accepted = http.post("/v1/forward_backward", content=body, headers=headers)
    assert accepted.status_code == 200, accepted.text
    return accepted


def test_forward_backward_takes_zstd_protobuf_and_answers_protobuf_the_sdk_reads():
    http, _ = client()
    with http:
        _, future = new_model(http)
        model_id = result(http, future.json()["request_id"]).json()["model_id"]
        accepted = forward_backward(http, model_id, 1)
        answer = result(http, accepted.json()["request_id"])
        assert answer.headers["content-type"] == "application/x-protobuf"
        output = deserialize_forward_backward_output(answer.content)
        assert output.metrics == {"loss:sum": 2.0} and output.loss_fn_outputs[0]["logprobs"].tolist() == [-1, -1]


def test_who_may_call_and_what_they_may_see():
    http, _ = client()
    with http:
        assert http.post("/v1/create_session", json={}).status_code == 401
        assert http.post("/v1/create_session", json={}, headers={"X-API-Key": "tml-x"}).json()["detail"]
        _, future = new_model(http)
        request_id = future.json()["request_id"]
        assert result(http, request_id, key="tml-b").status_code == 404  # another tenant's future
        model_id = result(http, request_id).json()["model_id"]
        assert post(http, "get_info", types.GetInfoRequest(model_id=model_id), key="tml-b").status_code == 404


def test_bad_bodies_are_400_or_413_with_the_reason():
    http, _ = client(max_body=2048)
    with http:
        bad = http.post("/v1/create_session", json={"tags": "not-a-list"}, headers={"X-API-Key": "tml-a"})
        assert bad.status_code == 400 and "tags" in bad.json()["detail"]
        extra = http.post("/v1/create_session", json={"nonsense": 1}, headers={"X-API-Key": "tml-a"})
        assert extra.status_code == 400 and "nonsense" in extra.json()["detail"]
        huge = http.post("/v1/create_session", content=b"{" + b" " * 4096 + b"}", headers={"X-API-Key": "tml-a"})
        assert huge.status_code == 413
        garbage = http.post("/v1/forward_backward", content=b"\xff\x01", headers={"X-API-Key": "tml-a"})
        assert garbage.status_code == 400 and "ForwardBackwardRequest" in garbage.json()["detail"]


def test_capacity_is_a_429_and_a_failed_request_is_the_sdks_request_failed():
    http, learner = client(max_models=2, max_per_tenant=1)
    with http:
        new_model(http)
        session_id, _ = new_model(http)
        request = types.CreateModelRequest(session_id=session_id, model_seq_id=1, base_model="tiny")
        assert post(http, "create_model", request).status_code == 429
        learner.lost = True
        _, future = new_model(http, key="tml-b")
        failed = types.RequestFailedResponse.model_validate(result(http, future.json()["request_id"], "tml-b").json())
        assert failed.category == types.RequestErrorCategory.Server and "learner" in failed.error


def test_a_heartbeat_of_a_released_session_is_410_which_stops_the_sdks_heartbeat_and_closing_it_succeeds():
    http, learner = client()
    with http:
        gone = post(http, "session_heartbeat", types.SessionHeartbeatRequest(session_id="alice-none"))
        assert gone.status_code == 410
        closed = http.post(
            "/v1/sessions/alice-none/finish", json={"reason": {"type": "success"}}, headers={"X-API-Key": "tml-a"}
        )
        assert closed.status_code == 200 and not learner.calls  # finished already: nothing to do
        session_id, _ = new_model(http)
        other = http.post(f"/v1/sessions/{session_id}/finish", json={}, headers={"X-API-Key": "tml-b"})
        assert other.status_code == 200 and session_id in http.app.state.api.sessions.sessions  # alice's stays open


def test_after_a_spot_notice_every_client_that_trained_is_saved_and_again_after_each_of_its_steps():
    """The learner's node got a notice: the upkeep saves each client that trained since its last state, and every
    optimizer step from then on is followed by a save, so the learner Ray starts again restores it where it stopped.
    Without a notice nothing is saved behind the user's back."""

    http, learner = client()
    with http:
        _, future = new_model(http)
        model_id = types.CreateModelResponse.model_validate(result(http, future.json()["request_id"]).json()).model_id
        api = http.app.state.api

        def step(seq):
            request = types.OptimStepRequest(adam_params=types.AdamParams(), model_id=model_id, seq_id=seq)
            assert result(http, post(http, "optim_step", request).json()["request_id"]).status_code == 200

        step(1)
        assert learner.saves == 0 and api.sessions.models[model_id].trained
        learner.noticed = "an AWS interruption notice for this node (120 s)"
        asyncio.run(api.recovery.keep_everyone(learner.noticed))  # what the upkeep does on its next round
        model = api.sessions.models[model_id]
        assert (learner.saves, model.saved, model.trained) == (1, 1, False)
        asyncio.run(api.recovery.keep_everyone(learner.noticed))  # nothing trained since: nothing saved again
        assert learner.saves == 1
        step(2)
        assert (learner.saves, model.saved, model.trained) == (2, 2, False)
        # A gradient accumulated under the notice is saved too, gradient and all: the optim_step after a restart
        # applies it, where a state without it would step on nothing.
        assert result(http, forward_backward(http, model_id, 3).json()["request_id"]).status_code == 200
        assert (learner.saves, model.pending, model.trained) == (3, True, False)
        assert learner.calls[-1][0] == "save_state" and learner.calls[-1][1][2:] == (True,)
        learner.noticed = None  # a learner started again elsewhere: no notice there
        step(4)
        assert (learner.saves, model.trained, model.pending) == (3, True, False)


def test_a_service_that_restarted_finds_the_paths_it_handed_out_in_the_bucket():
    """Saved states and sampler weights are recorded by the learner in the tenant's prefix: a new service process
    (the head's node lost) restores a client from a path it never saw, samples from one and lists them, for their
    tenant only, and releases the adapters the old one left on the learner."""
    learner = FakeLearner()
    http, _ = client(learner=learner)
    with http:
        _, future = new_model(http)
        model_id = result(http, future.json()["request_id"]).json()["model_id"]
        saved = post(http, "save_weights", types.SaveWeightsRequest(model_id=model_id, path="step-1", seq_id=1))
        state_path = result(http, saved.json()["request_id"]).json()["path"]
        request = types.SaveWeightsForSamplerRequest(model_id=model_id, path="s-1", seq_id=2)
        sampler_path = result(http, post(http, "save_weights_for_sampler", request).json()["request_id"]).json()["path"]
    assert state_path.startswith("tinker://") and sampler_path.endswith("/sampler_weights/s-1")

    http, _ = client(max_per_tenant=2, learner=learner)  # the service again, with nothing in memory
    with http:
        session_id, _ = new_model(http)
        load = types.LoadWeightsRequest(path=state_path, session_id=session_id, model_seq_id=1, optimizer=True)
        loaded = result(http, post(http, "load_weights", load).json()["request_id"])
        assert loaded.status_code == 200 and loaded.json()["path"] == state_path, loaded.text
        assert learner.calls[-1][0] == "load_state" and learner.calls[-1][1][2] == 1  # the state saved before
        sampling = types.CreateSamplingSessionRequest(
            session_id=session_id, sampling_session_seq_id=0, model_path=sampler_path
        )
        sampler_id = post(http, "create_sampling_session", sampling).json()["sampling_session_id"]
        assert http.app.state.api.sessions.samplers[sampler_id].fleet_model == adapter_name(7, "alice")

        bob_session = post(
            http, "create_session", types.CreateSessionRequest(tags=[], user_metadata={}, sdk_version="x"), "tml-b"
        )
        bob = bob_session.json()["session_id"]
        stolen = types.LoadWeightsRequest(path=state_path, session_id=bob, model_seq_id=0, optimizer=True)
        assert post(http, "load_weights", stolen, key="tml-b").status_code == 404
        peek = types.CreateSamplingSessionRequest(session_id=bob, sampling_session_seq_id=0, model_path=sampler_path)
        assert post(http, "create_sampling_session", peek, key="tml-b").status_code == 404

        listed = types.CheckpointsListResponse.model_validate(
            http.get("/v1/checkpoints", headers={"X-API-Key": "tml-a"}).json()
        )
        assert [c.tinker_path for c in listed.checkpoints] == [sampler_path, state_path]  # newest first
        assert [c.checkpoint_type for c in listed.checkpoints] == ["sampler", "training"]
        assert listed.cursor.total_count == 2
        page = http.get("/v1/checkpoints?limit=1&offset=1", headers={"X-API-Key": "tml-a"}).json()
        assert [c["tinker_path"] for c in page["checkpoints"]] == [state_path]
        by_run = http.get(f"/v1/training_runs/{model_id}/checkpoints", headers={"X-API-Key": "tml-a"}).json()
        assert len(by_run["checkpoints"]) == 2
        bob_lists = http.get(f"/v1/training_runs/{model_id}/checkpoints", headers={"X-API-Key": "tml-b"})
        assert bob_lists.status_code == 404  # her run is not his, as one that never was
        assert http.get("/v1/checkpoints?limit=0", headers={"X-API-Key": "tml-a"}).status_code == 400

        learner.held = [model_id, *http.app.state.api.sessions.models]  # the first service's client is still there
        asyncio.run(http.app.state.api.recovery.drop_orphans())
        assert [args for method, args in learner.calls if method == "drop"] == [(model_id,)]


def test_ttls_outside_the_sdks_range_encrypted_exports_and_foreign_links_are_refused_with_the_reason():
    http, learner = client()
    with http:
        _, future = new_model(http)
        model_id = types.CreateModelResponse.model_validate(result(http, future.json()["request_id"]).json()).model_id
        short = post(http, "save_weights", types.SaveWeightsRequest(model_id=model_id, path="s", ttl_seconds=60))
        assert short.status_code == 400 and "between 3600" in short.json()["detail"]
        ttl = http.put(
            f"/v1/training_runs/{model_id}/checkpoints/weights/s/ttl",
            json={"ttl_seconds": 10**10},
            headers={"X-API-Key": "tml-a"},
        )
        assert ttl.status_code == 400 and "10 years" in ttl.json()["detail"]
        age = types.SaveWeightsExternalRequest(model_id=model_id, path="e", age_encryption_recipients=["age1xyz"])
        refused = post(http, "save_weights_external", age)
        assert refused.status_code == 400 and "encrypt" in refused.json()["detail"]
        kept = post(http, "save_weights", types.SaveWeightsRequest(model_id=model_id, path="s", seq_id=1))
        assert result(http, kept.json()["request_id"]).json()["path"].endswith("/weights/s")
        urls = http.get(
            f"/v1/training_runs/{model_id}/checkpoints/weights/s/external_weights_urls", headers={"X-API-Key": "tml-a"}
        )  # a saved state, by its record: no download links
        assert urls.status_code == 400 and "external_weights" in urls.json()["detail"], urls.text
        forged = http.get("/v1/exported/bm90LW1pbmU.0000/adapter_model.safetensors")
        assert forged.status_code == 403
        stored = [method for method, _ in learner.calls if method in ("save_state", "export", "expire")]
        assert stored == ["save_state"]  # the kept state alone: nothing of what was refused


def test_with_several_learners_each_client_is_trained_saved_and_noticed_on_its_own():
    """Two learners: clients land on the one holding fewest, every call of a client goes to its learner, and a notice
    for one learner's node saves only the clients on that learner."""
    first, second = FakeLearner(), FakeLearner()
    http, _ = client(max_models=1, max_per_tenant=2, learners=[first, second])
    with http:
        models = []
        for _ in range(2):
            _, future = new_model(http)
            reply = result(http, future.json()["request_id"]).json()
            models.append(types.CreateModelResponse.model_validate(reply).model_id)
        _, refused = new_model(http)
        assert refused.status_code == 429  # one client on each learner: both full
        for model_id in models:
            result(http, forward_backward(http, model_id, 1).json()["request_id"])
            step = types.OptimStepRequest(model_id=model_id, seq_id=2, optim_params=types.AdamParams(learning_rate=0.1))
            assert result(http, post(http, "optim_step", step).json()["request_id"]).status_code == 200
        for learner, model_id in zip((first, second), models, strict=True):
            trained = [args[0].model for method, args in learner.calls if method == "forward_backward"]
            assert trained == [model_id]
        second.noticed = "spot: a notice for the second learner's node"
        asyncio.run(http.app.state.api.recovery.keep_everyone(second.noticed, 1))
        assert (first.saves, second.saves) == (0, 1)


# ---- issue 43: bounded inputs, turns that cannot hang, the SDK's try_again, request-time refusals --------------


class SlowLearner(FakeLearner):
    """A learner whose `forward_backward` takes until `gate` is set."""

    def __init__(self):
        super().__init__()
        self.gate = threading.Event()

    async def call(self, method, *args):
        if method == "forward_backward":
            while not self.gate.is_set():
                await asyncio.sleep(0.01)
        return await super().call(method, *args)


def created(http, key="tml-a") -> str:
    _, future = new_model(http, key)
    return types.CreateModelResponse.model_validate(result(http, future.json()["request_id"], key).json()).model_id


def fb_message(model_id: str, seq_id: int, tokens=(1, 2), targets=(2, 3), loss_fn="cross_entropy", **inputs):
    """The SDK's protobuf `ForwardBackwardRequest` of one datum (weights 1 unless `inputs` say otherwise)."""
    datum = types.Datum(
        model_input=types.ModelInput.from_ints(list(tokens)),
        loss_fn_inputs={"target_tokens": list(targets), **(inputs or {"weights": [1.0] * len(targets)})},
    )
    request = types.ForwardBackwardRequest(
        forward_backward_input=types.ForwardBackwardInput(data=[datum], loss_fn=loss_fn),
        model_id=model_id,
        seq_id=seq_id,
    )
    return forward_backward_request_to_proto(request)


def send_fb(http, message, key="tml-a"):
    headers = {"X-API-Key": key, "Content-Type": "application/x-protobuf"}
    return http.post("/v1/forward_backward", content=message.SerializeToString(), headers=headers)


def optim(http, model_id: str, seq_id: int, key="tml-a"):
    return post(
        http,
        "optim_step",
        types.OptimStepRequest(adam_params=types.AdamParams(), model_id=model_id, seq_id=seq_id),
        key,
    )


def test_a_request_refused_when_it_arrives_still_takes_its_turn_so_the_next_one_runs():
    """The SDK numbered the refused request: were its number left a hole, every later request of the client would
    wait for ever (the SDK's own next request is numbered after it)."""
    http, _ = client()
    with http:
        model_id = created(http)
        refused = send_fb(http, fb_message(model_id, 1, tokens=[1] * 200, targets=[2] * 200))  # past the context
        assert refused.status_code == 400, refused.text
        step = result(http, optim(http, model_id, 2).json()["request_id"])
        assert "metrics" in step.json(), step.text  # ran, instead of waiting for seq_id 1 for ever
        ttl = post(http, "save_weights", types.SaveWeightsRequest(model_id=model_id, path="s", seq_id=3, ttl_seconds=1))
        assert ttl.status_code == 400  # refused after its claim too
        assert result(http, optim(http, model_id, 4).json()["request_id"]).status_code == 200


def test_a_cancelled_waiting_request_takes_its_turn_and_a_seq_id_far_ahead_keeps_nothing():
    learner = SlowLearner()
    http, _ = client(learner=learner)
    with http:
        learner.gate.set()
        model_id = created(http)
        learner.gate.clear()
        send_fb(http, fb_message(model_id, 1))  # running, held by the learner
        waiting = optim(http, model_id, 2).json()["request_id"]
        http.post("/v1/cancel_future", json={"request_id": waiting}, headers={"X-API-Key": "tml-a"})
        last = optim(http, model_id, 3).json()["request_id"]
        learner.gate.set()
        assert "metrics" in result(http, last).json()
        futures = len(http.app.state.api.futures)
        far = optim(http, model_id, 10**9)
        assert far.status_code == 429 and "ahead of its turn" in far.json()["detail"]
        assert len(http.app.state.api.futures) == futures  # nothing of it kept


def test_a_long_poll_that_times_out_answers_the_sdks_try_again():
    """What the SDK's `retrieve_future` loop reads as try_again (`{"type": "try_again"}`, 200), not a 500."""
    learner = SlowLearner()
    http, _ = client(learner=learner)
    with http:
        learner.gate.set()
        model_id = created(http)
        learner.gate.clear()
        pending = result(http, send_fb(http, fb_message(model_id, 1)).json()["request_id"])
        assert pending.status_code == 200, pending.text
        assert TryAgainResponse.model_validate(pending.json()).type == "try_again"
        learner.gate.set()


def test_forward_backward_is_checked_against_the_context_the_vocabulary_and_its_own_bytes():
    """A sparse tensor's shape is believed only as far as the datum goes: 5 million declared values for 2 tokens are
    refused before any is built, as are ids outside the vocabulary, inputs of another length, calls over the token
    bound and losses this server does not compute; the learner sees none of them."""
    http, learner = client(max_tokens_per_call=100)
    with http:
        model_id = created(http)
        sparse = fb_message(model_id, 1)
        weights = sparse.data[0].loss_fn_inputs["weights"]
        weights.Clear()
        weights.dtype, weights.sparse_csr.values = pb.DTYPE_FLOAT32, b""
        weights.shape.extend([1, 5_000_000])
        weights.sparse_csr.crow_indices = np.zeros(2, dtype=np.int64).tobytes()
        lying = fb_message(model_id, 2)
        lying.data[0].loss_fn_inputs["weights"].shape[:] = [4]  # declares 4, holds 2
        refusals = [
            ("5000000 values for 2 tokens", sparse),
            ("does not hold", lying),
            ("token id 64 is outside", fb_message(model_id, 3, tokens=[1, 64])),
            ("token id -1 is outside", fb_message(model_id, 4, targets=[2, -1])),
            ("holds 3 values for 2 tokens", fb_message(model_id, 5, weights=[1.0, 1.0, 1.0])),
            ("per forward_backward", fb_message(model_id, 6, tokens=[1] * 101, targets=[1] * 101)),
            ("use 'ppo'", fb_message(model_id, 7, loss_fn="stable_reinforce", logprobs=[0.0, 0.0], advantages=[1, 1])),
            ("not read by cross_entropy", fb_message(model_id, 8, weights=[1.0, 1.0], advantages=[1.0, 1.0])),
        ]
        for reason, message in refusals:
            refused = send_fb(http, message)
            assert refused.status_code == 400 and reason in refused.json()["detail"], (reason, refused.text)
        assert not [c for c in learner.calls if c[0] == "forward_backward"]
        fine = send_fb(http, fb_message(model_id, 9))  # each refused request took its turn: this one's comes
        assert result(http, fine.json()["request_id"]).status_code == 200
        assert [c for c in learner.calls if c[0] == "forward_backward"]


def test_samples_are_bounded_by_the_fleet_and_unserved_fields_are_refused_by_name():
    http, _ = client()
    with http:
        session = post(http, "create_session", types.CreateSessionRequest(tags=[], user_metadata={}, sdk_version="x"))
        sampling = types.CreateSamplingSessionRequest(
            session_id=session.json()["session_id"], sampling_session_seq_id=0, base_model="tiny"
        )
        sampler_id = post(http, "create_sampling_session", sampling).json()["sampling_session_id"]

        def sample(prompt=(1, 2, 3), **fields):
            request = types.SampleRequest(
                sampling_session_id=sampler_id,
                seq_id=0,
                prompt=types.ModelInput.from_ints(list(prompt)),
                sampling_params=types.SamplingParams(max_tokens=4),
                **fields,
            )
            return post(http, "asample", request)

        for fields, reason in [
            ({"num_samples": 2_000_000}, "num_samples 2000000"),
            ({"topk_prompt_logprobs": 5}, "topk_prompt_logprobs"),
            ({"topk_sample_logprobs": 5}, "topk_sample_logprobs"),
            ({"prompt_alt_tokens_k": 2}, "prompt_alt_tokens_k"),
            ({"record_stability_info": True}, "train with loss_fn 'ppo'"),
            ({"prompt_logprobs_last_n": 2}, "needs prompt_logprobs"),
            ({"prompt": [1, 99]}, "token id 99 is outside"),
            ({"prompt": [1] * 129}, "129 tokens"),
        ]:
            refused = sample(**fields)
            assert refused.status_code == 400 and reason in refused.json()["detail"], (fields, refused.text)


def test_a_lora_rank_above_the_fleets_or_another_optimizer_is_refused_when_the_client_is_created():
    http, learner = client()
    with http:
        session = post(http, "create_session", types.CreateSessionRequest(tags=[], user_metadata={}, sdk_version="x"))
        request = types.CreateModelRequest(
            session_id=session.json()["session_id"],
            model_seq_id=0,
            base_model="tiny",
            lora_config=types.LoraConfig(rank=32),
        )
        refused = post(http, "create_model", request)
        assert (
            refused.status_code == 400
            and "max_lora_rank" in refused.json()["detail"]
            and "8" in refused.json()["detail"]
        )
        dimuon = request.model_copy(
            update={"lora_config": types.LoraConfig(rank=8), "optimizer_config": types.DimuonOptimizerConfig()}
        )
        refused = post(http, "create_model", dimuon)
        assert refused.status_code == 400 and "only AdamOptimizerConfig" in refused.json()["detail"]
        assert not learner.calls


def test_the_admin_route_takes_only_declared_json_and_no_api_docs_are_served():
    http, _ = client(admin=Secret("tinker-admin-token-0123"))
    with http:
        form = http.post(
            "/v1/admin/keys",
            content=b'{"name": "eve"}',
            headers={"Authorization": "Bearer tinker-admin-token-0123", "Content-Type": "text/plain"},
        )
        assert form.status_code == 415
        for path in ("/docs", "/redoc", "/openapi.json"):
            assert http.get(path).status_code == 404, path


def test_a_key_the_fleet_revoked_is_refused_by_every_route_and_all_it_held_is_dropped(monkeypatch):
    """The admin removed alice's run on the fleet: once the key's bound (`key_recheck_s`) passes, every route answers
    her key 401 in the SDK's shape, her futures are cancelled, her sessions, samplers and training clients released
    (the adapter dropped from the learner), and bob, whose key stands, keeps his."""
    http, learner = client(max_per_tenant=2)
    with http:
        api = http.app.state.api
        session_id, future = new_model(http)
        model_id = result(http, future.json()["request_id"]).json()["model_id"]
        pending = forward_backward(http, model_id, 1).json()["request_id"]
        sampling = types.CreateSamplingSessionRequest(
            session_id=session_id, sampling_session_seq_id=0, base_model="tiny"
        )
        sampler_id = post(http, "create_sampling_session", sampling).json()["sampling_session_id"]
        bob_session, bob_future = new_model(http, key="tml-b")
        bob_model = result(http, bob_future.json()["request_id"], "tml-b").json()["model_id"]

        monkeypatch.delitem(KEYS, "tml-a")  # what the fleet says of alice's token now
        api.keys.max_age_s = 0.0  # the bound passed
        alice = {"X-API-Key": "tml-a"}
        refusals = [
            post(http, "create_session", types.CreateSessionRequest(tags=[], user_metadata={}, sdk_version="x")),
            post(http, "session_heartbeat", types.SessionHeartbeatRequest(session_id=session_id)),
            post(http, "get_info", types.GetInfoRequest(model_id=model_id)),
            result(http, pending),
            http.get(f"/v1/samplers/{sampler_id}", headers=alice),
            http.get("/v1/checkpoints", headers=alice),
            http.get("/v1/training_runs", headers=alice),
            post(http, "save_weights", types.SaveWeightsRequest(model_id=model_id, path="late", seq_id=2)),
        ]
        assert [r.status_code for r in refusals] == [401] * len(refusals)
        assert all("API key" in r.json()["detail"] for r in refusals)
        assert not api.futures.owned(pending, "alice") and session_id not in api.sessions.sessions
        assert model_id not in api.sessions.models and sampler_id not in api.sessions.samplers
        assert ("drop", (model_id,)) in learner.calls and ("drop", (bob_model,)) not in learner.calls
        assert bob_session in api.sessions.sessions
        info = post(http, "get_info", types.GetInfoRequest(model_id=bob_model), key="tml-b")
        assert info.status_code == 200, info.text


def test_a_closed_session_releases_its_sampling_clients():
    """The SDK never releases a sampling client (an RL loop makes one per step): they go with their session."""
    http, _ = client()
    with http:
        session_id, _ = new_model(http)
        sampling = types.CreateSamplingSessionRequest(
            session_id=session_id, sampling_session_seq_id=0, base_model="tiny"
        )
        sampler_id = post(http, "create_sampling_session", sampling).json()["sampling_session_id"]
        assert http.get(f"/v1/samplers/{sampler_id}", headers={"X-API-Key": "tml-a"}).status_code == 200
        http.post(f"/v1/sessions/{session_id}/finish", json={}, headers={"X-API-Key": "tml-a"})
        assert http.get(f"/v1/samplers/{sampler_id}", headers={"X-API-Key": "tml-a"}).status_code == 404
        assert not http.app.state.api.sessions.samplers


def test_an_upkeep_round_that_fails_is_logged_and_the_next_one_runs(monkeypatch):
    """One exception (here the links' pruning) must not end the upkeep for good: releases, heartbeats and notice
    saves of every tenant depend on it."""
    from deployments.tinker import service

    http, _ = client()  # not entered: no upkeep of the app's own runs meanwhile
    api = http.app.state.api
    pruned = []

    def prune():
        pruned.append(len(pruned))
        if len(pruned) == 1:
            raise OSError("the bucket did not answer")

    monkeypatch.setattr(api.links, "prune", prune)
    monkeypatch.setattr(service, "UPKEEP_PERIOD_S", 0.02)

    async def upkeep_for_a_while():
        task = asyncio.ensure_future(api.upkeep())
        await asyncio.sleep(0.5)
        assert not task.done(), task.exception()
        task.cancel()

    asyncio.run(upkeep_for_a_while())
    assert len(pruned) >= 3


def test_listings_and_lookups_read_the_bucket_and_never_wait_for_a_learner():
    """The key's paths are recorded by the service in its prefix of the bucket: while the learner is gone (a preempted
    node) its listings, lookups, TTLs and publishing answer at once, none of it asked of a learner."""
    http, learner = client()
    with http:
        model_id = created(http)
        saved = post(http, "save_weights", types.SaveWeightsRequest(model_id=model_id, path="kept", seq_id=1))
        path = result(http, saved.json()["request_id"]).json()["path"]
        learner.lost, asked = True, len(learner.calls)
        alice = {"X-API-Key": "tml-a"}
        listed = http.get("/v1/checkpoints", headers=alice)
        assert listed.status_code == 200 and [c["tinker_path"] for c in listed.json()["checkpoints"]] == [path]
        assert http.get("/v1/training_runs", headers=alice).status_code == 200
        info = http.post("/v1/weights_info", json={"tinker_path": path}, headers=alice)
        assert info.status_code == 200 and info.json()["lora_rank"] == 8
        route = f"/v1/training_runs/{model_id}/checkpoints/weights/kept"
        assert http.post(f"{route}/publish", headers=alice).status_code == 200
        assert http.put(f"{route}/ttl", json={"ttl_seconds": 7200}, headers=alice).status_code == 200
        assert len(learner.calls) == asked  # the learner was asked nothing
