"""The Tinker learner on the tiny model at small shapes: its precision path (a bfloat16 base under fp32 adapters, what it
runs on a GPU) computes what the float32 one does, trains, and saves and restores fp32 adapters and moments; the
tinker paths recorded for what it saved (`core.bucket.tinker_registry`) are found again by path; datums packed in rows
compute what one at a time does, and what a plain forward's full logits give at whatever targets a datum names."""

import time

import pytest
import torch

from app.learner import tinker_learner, tinker_states
from app.learner.tinker_learner import TinkerLearner, train_sample
from contracts.tinker import AdamStep, AdapterSpec, Datum, Lineage, LossCall, TinkerBackend
from core.bucket import tinker_paths
from core.bucket.tinker_registry import PathRegistry

TOKENS = [5, 9, 14, 3, 7, 11, 2]


def _call(model: str, backward: bool = True) -> LossCall:
    datum = Datum(TOKENS[:-1], TOKENS[1:], {"weights": [0.0, 0.0, 1.0, 1.0, 1.0, 1.0]})
    return LossCall(model, [datum], "cross_entropy", backward=backward)


def _step(model: str) -> AdamStep:
    return AdamStep(model, 1e-2, 0.9, 0.999, 1e-8, 0.0, 1.0)


def _save(learner, model, lineage, path, expires=None, user_metadata=None) -> int:
    """A user's save_state as the service makes it: the learner commits the state, the registry records its path."""
    number = learner.save_state(model, lineage)
    spec = learner.clients[model].spec
    PathRegistry(lineage).remember(path, "training", number, model, spec, expires, user_metadata)
    return number


def _publish(learner, model, lineage, path=None, expires=None, user_metadata=None):
    published = learner.publish(model, lineage)
    if path is not None:
        spec = learner.clients[model].spec
        PathRegistry(lineage).remember(path, "sampler", published.version, model, spec, expires, user_metadata)
    return published


def _export(learner, model, lineage, path):
    export = learner.export(model, lineage)
    spec = learner.clients[model].spec
    PathRegistry(lineage).remember(path, "external", export.number, model, spec, None, size_bytes=export.size_bytes)
    return export


def _store(lineage, kind):
    return tinker_paths.store(lineage.bucket_url, kind, lineage.cache_dir)


@pytest.fixture(scope="module")
def learners(tiny_model_path):
    return {dtype: TinkerLearner(tiny_model_path, max_models=32, dtype=dtype) for dtype in ("float32", "bfloat16")}


def test_a_bfloat16_base_keeps_fp32_adapters_and_agrees_with_float32(learners):
    for learner in learners.values():
        learner.create("a", AdapterSpec(rank=4, seed=0))
    half = learners["bfloat16"]
    trainable = [p for p in half.peft.parameters() if p.requires_grad]
    frozen = [p for name, p in half.peft.named_parameters() if not p.requires_grad and "lora_" not in name]
    assert trainable and all(p.dtype == torch.float32 for p in trainable)
    assert all(p.dtype == torch.bfloat16 for p in frozen if p.is_floating_point())

    full = learners["float32"].forward_backward(_call("a", backward=False)).logprobs[0]
    approx = half.forward_backward(_call("a", backward=False)).logprobs[0]
    assert len(full) == len(approx) == len(TOKENS) - 1
    assert max(abs(x - y) for x, y in zip(full, approx, strict=True)) < 0.15  # bfloat16's ~3 significant digits


def test_the_bfloat16_learner_trains_and_restores_its_state(learners, tmp_path):
    learner = learners["bfloat16"]
    learner.create("b", AdapterSpec(rank=4, seed=1))
    before = learner.forward_backward(_call("b")).metrics["loss:sum"]
    for _ in range(5):
        learner.optim_step(_step("b"))
        learner.forward_backward(_call("b"))
    after = learner.forward_backward(_call("b", backward=False)).metrics["loss:sum"]
    assert after < before

    lineage = Lineage(f"file://{tmp_path}/bucket/runs/alice", "k" * 32, "alice", str(tmp_path / "cache"))
    path = "tinker://alice-1:train:0/weights/step-5"
    number = _save(learner, "b", lineage, path)
    assert PathRegistry(lineage).record(path)["number"] == number  # a service that restarted finds the path again
    assert PathRegistry(lineage).record(path + "x") is None
    bob = Lineage(f"file://{tmp_path}/bucket/runs/bob", "k" * 32, "bob", str(tmp_path / "cache"))
    assert PathRegistry(bob).record(path) is None  # the record lies in alice's prefix only
    assert [(r["path"], r["number"]) for r in PathRegistry(lineage).checkpoints()] == [(path, number)]
    assert PathRegistry(bob).checkpoints() == []
    moments = learner.clients["b"].optimizer.state_dict()["state"]
    learner.load_state("c", lineage, number, optimizer=True)
    restored = learner.clients["c"].optimizer.state_dict()["state"]
    assert all(t.dtype == torch.float32 for s in restored.values() for t in s.values() if t.dim())
    assert torch.equal(moments[0]["exp_avg"], restored[0]["exp_avg"])
    again = learner.forward_backward(_call("c", backward=False)).metrics["loss:sum"]
    assert again == pytest.approx(after, abs=1e-6)


def test_a_dtype_it_does_not_know_is_refused(tiny_model_path):
    with pytest.raises(ValueError, match="dtype 'int8'"):
        TinkerLearner(tiny_model_path, dtype="int8")


def test_datums_packed_in_rows_give_the_log_probs_and_gradients_of_one_at_a_time(learners, monkeypatch):
    learner = learners["float32"]
    learner.create("g", AdapterSpec(rank=4, seed=2))
    for p in learner.peft.parameters():  # a trained adapter: B away from zero, so every LoRA weight has a gradient
        if p.requires_grad:
            torch.nn.init.normal_(p, std=0.05)
    data = [
        Datum(TOKENS[: n - 1], TOKENS[1:n], {"logprobs": [-2.0] * (n - 1), "advantages": [0.5 - k] * (n - 1)})
        for k, n in enumerate([7, 3, 5, 2])
    ]
    call = LossCall("g", data, "importance_sampling")

    def run(budget):
        monkeypatch.setattr(tinker_learner, "BATCH_TOKENS", budget)
        reply = learner.forward_backward(call)
        grads = {n: p.grad.clone() for n, p in learner.peft.named_parameters() if p.grad is not None}
        learner.clients["g"].optimizer.zero_grad(set_to_none=True)
        return reply, grads

    alone, alone_grads = run(1)  # every datum a forward of its own
    together, together_grads = run(1 << 20)  # all four in one packed row
    assert [len(x) for x in together.logprobs] == [6, 2, 4, 1]
    for a, b in zip(alone.logprobs, together.logprobs, strict=True):
        assert a == pytest.approx(b, abs=1e-5)
    assert together.metrics["loss:sum"] == pytest.approx(alone.metrics["loss:sum"], abs=1e-5)
    assert alone_grads.keys() == together_grads.keys() and alone_grads
    for name, grad in alone_grads.items():
        assert torch.allclose(grad, together_grads[name], atol=1e-5), name


def test_a_datum_is_scored_at_its_own_targets_as_a_plain_forward_of_it_alone_scores_them(learners):
    learner = learners["float32"]
    learner.create("t", AdapterSpec(rank=4, seed=3))
    for p in learner.peft.parameters():
        if p.requires_grad:
            torch.nn.init.normal_(p, std=0.05)
    shifted = Datum(TOKENS[:-1], TOKENS[1:], {"weights": [1.0] * 6})
    own = Datum(
        [4, 8, 15, 16], [23, 42, 4, 8], {"weights": [1.0, 0.0, 2.0, 1.0]}
    )  # targets that are not the next inputs
    reply = learner.forward_backward(LossCall("t", [shifted, own], "cross_entropy", backward=False))
    for datum, logprobs in zip([shifted, own], reply.logprobs, strict=True):
        with torch.no_grad():  # outside scoring the head is the plain output layer: full logits, one causal row
            logits = learner.peft(input_ids=torch.tensor([datum.input_tokens])).logits[0]
        expected = logits.log_softmax(-1).gather(-1, torch.tensor(datum.target_tokens).unsqueeze(-1)).squeeze(-1)
        assert logprobs == pytest.approx(expected.tolist(), abs=1e-5)
    data, logps = [shifted, own], reply.logprobs
    weighted = [
        sum(w * x for w, x in zip(d.inputs["weights"], lp, strict=True)) for d, lp in zip(data, logps, strict=True)
    ]
    assert reply.metrics["loss:sum"] == pytest.approx(-sum(weighted), abs=1e-5)  # cross_entropy: -sum(weights * logp)


def test_a_datum_becomes_a_sample_whose_scored_positions_are_its_inputs_and_targets_its_own():
    sample = train_sample(3, Datum([4, 8, 15], [23, 42, 7]))
    assert sample.input_ids[:3] == [4, 8, 15] and len(sample) == 4  # one slot more: the last position's target
    assert sample.num_targets == 3 and sample.target_ids == [23, 42, 7] and sample.origin == (3, 0)


def test_forgetting_a_path_deletes_what_it_names_but_never_the_newest_sampler_version(learners, tmp_path):
    learner = learners["float32"]
    learner.create("f", AdapterSpec(rank=4, seed=4))
    lineage = Lineage(f"file://{tmp_path}/bucket/runs/alice", "ab" * 32, "alice", str(tmp_path / "cache"))
    state = "tinker://f/weights/s"
    older, newest = "tinker://f/sampler_weights/a", "tinker://f/sampler_weights/b"
    number = _save(learner, "f", lineage, state)
    first = _publish(learner, "f", lineage, older).version
    _publish(learner, "f", lineage, newest)
    records = {r["path"]: r for r in PathRegistry(lineage).checkpoints()}
    assert records[state]["rank"] == 4 and records[older]["model"] == "f" and records[newest]["train_mlp"] is True

    with pytest.raises(ValueError, match="newest sampler weights"):
        PathRegistry(lineage).forget(newest)
    assert PathRegistry(lineage).forget(older) is True
    assert PathRegistry(lineage).record(older) is None and PathRegistry(lineage).forget(older) is False
    from core.bucket.store import AdapterStore

    assert first not in AdapterStore(lineage.bucket_url, cache_dir=lineage.cache_dir).versions()
    assert PathRegistry(lineage).forget(state) is True
    assert number not in _store(lineage, "training").steps()
    assert {r["path"] for r in PathRegistry(lineage).checkpoints()} == {newest}


def test_an_export_is_a_peft_folder_of_the_clients_adapter_and_deleted_like_any_path(learners, tmp_path):
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    learner = learners["float32"]
    learner.create("x", AdapterSpec(rank=4, seed=6))
    learner.forward_backward(_call("x"))
    learner.optim_step(_step("x"))  # B moves off zero: the export holds trained weights
    expected = learner.forward_backward(_call("x", backward=False)).logprobs[0]
    lineage = Lineage(f"file://{tmp_path}/bucket/runs/alice", "ab" * 32, "alice", str(tmp_path / "cache"))
    path = "tinker://x/external_weights/out"
    export = _export(learner, "x", lineage, path)
    assert set(export.files) == {"adapter_model.safetensors", "adapter_config.json"}
    assert PathRegistry(lineage).record(path)["size_bytes"] == export.size_bytes > 0

    folder = _store(lineage, "external").load(export.number, tmp_path / "download")
    base = AutoModelForCausalLM.from_pretrained(learner.model_path, dtype=torch.float32)
    with torch.no_grad():
        logits = PeftModel.from_pretrained(base, str(folder))(torch.tensor([TOKENS[:-1]])).logits[0]
    logprobs = torch.log_softmax(logits, -1).gather(-1, torch.tensor(TOKENS[1:])[:, None])[:, 0]
    assert logprobs.tolist() == pytest.approx(expected, abs=1e-4)

    assert PathRegistry(lineage).forget(path) is True
    assert export.number not in _store(lineage, "external").steps()


def test_an_expired_path_is_gone_from_lookups_and_listings_and_its_files_from_the_bucket(learners, tmp_path):
    learner = learners["float32"]
    learner.create("e", AdapterSpec(rank=4, seed=7))
    lineage = Lineage(f"file://{tmp_path}/bucket/runs/alice", "ab" * 32, "alice", str(tmp_path / "cache"))
    kept, lapsing = "tinker://e/weights/kept", "tinker://e/weights/lapsing"
    _save(learner, "e", lineage, kept, expires=time.time() + 3600)
    number = _save(learner, "e", lineage, lapsing)
    assert PathRegistry(lineage).expire(lapsing, time.time() - 1) is True
    assert PathRegistry(lineage).record(lapsing) is None
    assert PathRegistry(lineage).expire(lapsing, None) is False  # gone is gone
    assert [r["path"] for r in PathRegistry(lineage).checkpoints()] == [kept]
    assert number not in _store(lineage, "training").steps()  # the listing deleted it
    assert PathRegistry(lineage).expire(kept, None) is True and PathRegistry(lineage).record(kept)["expires"] is None

    newest = "tinker://e/sampler_weights/newest"
    _publish(learner, "e", lineage, newest, time.time() - 1)  # expired at once: out of sight, kept while newest
    assert PathRegistry(lineage).record(newest) is None and newest not in {
        r["path"] for r in PathRegistry(lineage).checkpoints()
    }
    from core.bucket.store import AdapterStore

    assert AdapterStore(lineage.bucket_url, cache_dir=lineage.cache_dir).latest() is not None


def test_a_state_kept_mid_step_restores_the_gradient_not_yet_applied_and_a_users_state_holds_none(learners, tmp_path):
    learner = learners["float32"]
    learner.create("k", AdapterSpec(rank=4, seed=5))
    lineage = Lineage(f"file://{tmp_path}/bucket/runs/alice", "ab" * 32, "alice", str(tmp_path / "cache"))
    learner.forward_backward(_call("k"))  # accumulated; no optim_step yet
    kept = learner.save_state("k", lineage, gradient=True)
    users = _save(learner, "k", lineage, "tinker://k/weights/mid")
    learner.optim_step(_step("k"))  # what the client's optim_step does where nothing is lost
    expected = learner.forward_backward(_call("k", backward=False)).logprobs[0]

    learner.load_state("k2", lineage, kept, optimizer=True)
    assert all(p.grad is not None for p in tinker_states.params(learner.clients["k2"]))
    learner.optim_step(_step("k2"))
    assert learner.forward_backward(_call("k2", backward=False)).logprobs[0] == pytest.approx(expected, abs=1e-6)
    learner.load_state("k3", lineage, users, optimizer=True)
    assert all(p.grad is None for p in tinker_states.params(learner.clients["k3"]))


def test_a_published_path_reaches_other_keys_until_its_owner_takes_it_back(learners, tmp_path):
    """`share`: another tenant finds the owner's record (with the owner's prefix), starts a client from the state,
    samples a copy of the sampler weights under its own lineage; it cannot expire, delete or unpublish them; taking
    the path back, or deleting it, leaves nothing for the other tenant to find."""
    from contracts.auth import Secret
    from core.bucket.store import AdapterStore

    learner = learners["float32"]
    learner.create("p", AdapterSpec(rank=4, seed=8))
    learner.forward_backward(_call("p"))
    learner.optim_step(_step("p"))
    expected = learner.forward_backward(_call("p", backward=False)).logprobs[0]
    cache = str(tmp_path / "cache")
    alice = Lineage(f"file://{tmp_path}/bucket/runs/alice", "a" * 64, "alice", cache)
    bob = Lineage(f"file://{tmp_path}/bucket/runs/bob", "b" * 64, "bob", cache)
    state, sampler = "tinker://p/weights/shared", "tinker://p/sampler_weights/shared"
    number = _save(learner, "p", alice, state)
    version = _publish(learner, "p", alice, sampler).version
    assert (
        PathRegistry(bob).record(state) is None and PathRegistry(bob).share(state, True) is False
    )  # not bob's to publish

    assert PathRegistry(alice).share(state, True) and PathRegistry(alice).share(sampler, True)
    found = PathRegistry(bob).record(state)
    assert found["number"] == number and found["prefix"] == alice.bucket_url and found["public"] is True
    learner.load_state("p-bob", bob, number, True, found["prefix"])
    assert learner.forward_backward(_call("p-bob", backward=False)).logprobs[0] == pytest.approx(expected, abs=1e-6)
    copy = learner.adopt(bob, PathRegistry(bob).record(sampler)["prefix"], version, alice.signing_key)
    bobs = AdapterStore(bob.bucket_url, cache_dir=cache, signing_key=Secret(bob.signing_key))
    assert copy.version in bobs.versions() and bobs.signed(copy.version)  # signed with bob's lineage key
    as_alices = AdapterStore(bob.bucket_url, cache_dir=cache, signing_key=Secret(alice.signing_key))
    assert not as_alices.signed(copy.version)
    assert PathRegistry(bob).expire(state, time.time() - 1) is False and PathRegistry(bob).forget(state) is False

    assert PathRegistry(alice).share(state, False) and PathRegistry(bob).record(state) is None
    learner.publish("p", alice)  # sampler is no longer alice's newest: it may go
    assert PathRegistry(alice).forget(sampler) and PathRegistry(bob).record(sampler) is None
    assert {r["path"]: r.get("public") for r in PathRegistry(alice).checkpoints()} == {state: False}


def test_a_number_is_never_handed_out_twice_even_after_its_checkpoint_is_deleted(learners, tmp_path):
    """A deleted newest state or export leaves its number retired: what kept the number (a client's last state, a
    download link) never comes to mean the next checkpoint."""
    learner = learners["float32"]
    learner.create("n", AdapterSpec(rank=4, seed=9))
    lineage = Lineage(f"file://{tmp_path}/bucket/runs/alice", "ab" * 32, "alice", str(tmp_path / "cache"))
    first = _save(learner, "n", lineage, "tinker://n/weights/a")
    assert PathRegistry(lineage).forget("tinker://n/weights/a")
    assert _save(learner, "n", lineage, "tinker://n/weights/b") > first
    export = _export(learner, "n", lineage, "tinker://n/external_weights/a")
    assert PathRegistry(lineage).forget("tinker://n/external_weights/a")
    assert _export(learner, "n", lineage, "tinker://n/external_weights/b").number > export.number


def test_two_savers_of_one_key_that_read_the_same_newest_number_each_get_their_own(learners, tmp_path, monkeypatch):
    """Two clients of one key on different learners saving at once both read the same newest number: the one that
    commits second takes the next number instead of failing."""
    from core.bucket.store import CheckpointStore

    learner = learners["float32"]
    learner.create("r", AdapterSpec(rank=4, seed=10))
    lineage = Lineage(f"file://{tmp_path}/bucket/runs/alice", "ab" * 32, "alice", str(tmp_path / "cache"))
    monkeypatch.setattr(CheckpointStore, "latest", lambda self: None)  # each read before the other's commit
    assert _save(learner, "r", lineage, "tinker://r/weights/a") == 1
    assert _save(learner, "r", lineage, "tinker://r/weights/b") == 2
    assert _export(learner, "r", lineage, "tinker://r/external_weights/a").number == 1
    assert _export(learner, "r", lineage, "tinker://r/external_weights/b").number == 2
    assert PathRegistry(lineage).record("tinker://r/weights/b")["number"] == 2


def test_a_name_saved_again_is_replaced_and_what_it_named_is_deleted(learners, tmp_path):
    """A name saved again (`save_state(name, overwrite=True, user_metadata=...)`; without overwrite the service
    refuses it before the learner saves, `tests/unit/deployments/tinker/test_paths.py`): the replaced state (or sampler version, saved again under its name) leaves the bucket, so nothing a tenant wrote is
    left where no path reaches it; each record says its kind and the user's metadata."""
    from core.bucket.store import AdapterStore

    learner = learners["float32"]
    learner.create("o", AdapterSpec(rank=4, seed=11))
    lineage = Lineage(f"file://{tmp_path}/bucket/runs/alice", "ab" * 32, "alice", str(tmp_path / "cache"))
    path = "tinker://o/weights/x"
    first = _save(learner, "o", lineage, path, user_metadata={"stage": "a"})
    second = _save(learner, "o", lineage, path, user_metadata={"stage": "b"})
    record = PathRegistry(lineage).record(path)
    assert (record["number"], record["kind"], record["user_metadata"]) == (second, "training", {"stage": "b"})
    assert _store(lineage, "training").steps() == [second]  # the first is gone, not orphaned
    assert first != second

    sampler = "tinker://o/sampler_weights/x"
    older = _publish(learner, "o", lineage, sampler).version
    newer = _publish(learner, "o", lineage, sampler, None, {"k": "v"}).version
    assert PathRegistry(lineage).record(sampler)["kind"] == "sampler"
    assert AdapterStore(lineage.bucket_url, cache_dir=lineage.cache_dir).versions() == [newer]
    assert older < newer


def test_the_services_own_saves_of_a_client_are_bounded_to_its_newest_two(learners, tmp_path):
    """A notice's saves (no path) come after every step while the notice lasts: each supersedes the client's earlier
    ones beyond the newest two (the service restores from the newest), so they never pile up where nothing reaches
    them; another client's, and the user's own states, stay."""
    learner = learners["float32"]
    for model in ("q1", "q2"):
        learner.create(model, AdapterSpec(rank=4, seed=13))
    lineage = Lineage(f"file://{tmp_path}/bucket/runs/alice", "ab" * 32, "alice", str(tmp_path / "cache"))
    other = learner.save_state("q2", lineage, gradient=True)
    PathRegistry(lineage).supersede("q2", other)
    users = _save(learner, "q1", lineage, "tinker://q1/weights/mine")
    kept = []
    for _ in range(4):  # as the service's `Recovery.keep` does
        kept.append(learner.save_state("q1", lineage, gradient=True))
        PathRegistry(lineage).supersede("q1", kept[-1])
    assert sorted(_store(lineage, "training").steps()) == sorted([other, users, *kept[-2:]])
    learner.load_state("q3", lineage, kept[-1], optimizer=True)  # the newest restores


def test_adopting_a_version_planted_in_the_owners_prefix_is_refused(learners, tmp_path):
    """Whoever can write the bucket can plant a version in a tenant's prefix: `adopt` copies only what verifies under
    the owner's lineage key, so a planted one is never signed anew into the adopter's lineage."""
    from contracts.auth import Secret
    from core.bucket.filesystem import NotSigned
    from core.bucket.store import AdapterStore

    learner = learners["float32"]
    learner.create("v", AdapterSpec(rank=4, seed=12))
    cache = str(tmp_path / "cache")
    alice = Lineage(f"file://{tmp_path}/bucket/runs/alice", "a" * 64, "alice", cache)
    bob = Lineage(f"file://{tmp_path}/bucket/runs/bob", "b" * 64, "bob", cache)
    folder = tinker_states.write_adapter(learner.peft, learner.clients["v"], learner.model_path, tmp_path / "planted")
    AdapterStore(alice.bucket_url, cache_dir=cache, signing_key=Secret("c" * 64)).publish(folder, 1)  # another key
    AdapterStore(alice.bucket_url, cache_dir=cache).publish(folder, 2)  # no signature at all
    for planted in (1, 2):
        with pytest.raises(NotSigned):
            learner.adopt(bob, alice.bucket_url, planted, alice.signing_key)
    assert AdapterStore(bob.bucket_url, cache_dir=cache).versions() == []
    genuine = learner.publish("v", alice).version
    assert learner.adopt(bob, alice.bucket_url, genuine, alice.signing_key).version == 1


def test_the_backend_the_service_calls_is_the_learners_own_methods():
    """`contracts.tinker.TinkerBackend` is the learner's calls, by the learner's own names: a route's call reads as the
    learner method it reaches."""

    def calls(cls) -> set[str]:
        return {name for name in vars(cls) if not name.startswith("_") and callable(getattr(cls, name))}

    assert calls(TinkerBackend) == calls(TinkerLearner) - {"join", "rendezvous_address"}


def test_a_group_of_ranks_answers_every_call_one_learner_answers():
    """The service cannot tell one learner from a group (`learner_ranks`): every call of the one is the group's too."""
    from app.learner.tinker_group import TinkerLearnerGroup

    def calls(cls) -> set[str]:
        return {name for name in vars(cls) if not name.startswith("_") and callable(getattr(cls, name))}

    assert calls(TinkerLearner) - {"join", "rendezvous_address"} <= calls(TinkerLearnerGroup)
