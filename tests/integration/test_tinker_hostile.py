"""A hostile tenant against the Tinker API (issue 43, item 17): two keys share one service; bob tries, as an attacker
would, every path to alice's work (each kind of checkpoint, published and not, on each route that takes a path; her
run id, training client, sampler and session), download links after unpublish and delete, a key the admin revoked,
bodies too large or malformed, values out of range; each is refused with the 4xx that says why (the SDK's error), while alice,
in a thread of her own from the module's first test to its last, trains and samples on unaffected: her loss falls,
her samples come, no call of hers fails or stalls. Many of these paths have a test of their own in
`test_tinker_api.py`; here they come together, in the order an attacker would try them, against one service.
"""

import threading
import time
from dataclasses import dataclass, field

import httpx
import pytest
import tinker
import zstandard
from tinker import types
from tinker.proto import tinker_public_pb2 as pb
from tinker.proto.request_conv import forward_backward_request_to_proto

from tests.integration import test_tinker_api
from tests.integration.test_tinker_api import RANK, TOKEN, one_datum_client, sft_datum

# The service `test_tinker_api` starts (a fleet, a learner, keys alice and bob), started again for this module.
service, notice_file = test_tinker_api.service, test_tinker_api.notice_file

STALL_S = 120.0  # a generous bound on one of alice's rounds (a train step, a save, a sample) on a loaded 2-core box


def outcome(call) -> str:
    """What a call came to: "ok", or the HTTP status of the SDK's error (its class and message else)."""
    try:
        call()
        return "ok"
    except tinker.APIStatusError as exc:
        return str(exc.status_code)
    except httpx.HTTPStatusError as exc:
        return str(exc.response.status_code)
    except Exception as exc:  # noqa: BLE001 - anything else is reported as it is, and fails the comparison
        return f"{type(exc).__name__}: {str(exc)[:160]}"


def on_a_client_of_its_own(url: str, key: str, call):
    """`call(client)` on a ServiceClient closed after it: a training client it opens ends with that session, so a
    route that succeeds does not hold one of the key's few training clients for the rest of the module."""
    client = tinker.ServiceClient(base_url=url, api_key=key)
    try:
        return call(client)
    finally:
        client.close("success").result(timeout=120)


def external_weights_urls(url: str, rest: tinker.RestClient, key: str, path: str):
    """`get_external_weights_urls` as an attacker sends it: through the SDK for an export's path, and straight to
    the route for a path of another kind (the SDK refuses those itself, by the path's text, before sending)."""
    parsed = types.ParsedCheckpointTinkerPath.from_tinker_path(path)
    if parsed.checkpoint_id.startswith("external_weights/"):
        return rest.get_external_weights_urls(path).result(60)
    route = f"/api/v1/training_runs/{parsed.training_run_id}/checkpoints/{parsed.checkpoint_id}/external_weights_urls"
    return httpx.get(f"{url}{route}", headers={"X-API-Key": key}, timeout=60).raise_for_status()


def refused_with(answers: dict[str, str], expected: dict[str, str]) -> None:
    """Every call's answer against the one expected, all reported together."""
    wrong = {name: f"{answers[name]} (expected {want})" for name, want in expected.items() if answers[name] != want}
    assert not wrong, wrong


@dataclass
class Victim:
    """Alice's rounds, run in a thread while bob attacks: each a `forward_backward` and an `optim_step` (its loss),
    then, every third, sampler weights saved and sampled."""

    losses: list[float] = field(default_factory=list)
    samples: list[int] = field(default_factory=list)
    round_s: list[float] = field(default_factory=list)
    errors: list[str] = field(default_factory=list)
    stop: threading.Event = field(default_factory=threading.Event)

    def run(self, url: str, key: str, base: str) -> None:
        with tinker.ServiceClient(base_url=url, api_key=key) as client:
            training = client.create_lora_training_client(base_model=base, rank=RANK, seed=31).result()
            tokenizer = training.get_tokenizer()
            data = [sft_datum(tokenizer, "27+15=", "42"), sft_datum(tokenizer, "9+9=", "18")]
            prompt = types.ModelInput.from_ints(tokenizer.encode("27+15=", add_special_tokens=False))
            while not self.stop.is_set():
                began = time.monotonic()
                try:
                    result = training.forward_backward(data, "cross_entropy").result(timeout=STALL_S)
                    training.optim_step(types.AdamParams(learning_rate=2e-3)).result(timeout=STALL_S)
                    self.losses.append(result.metrics["loss:sum"])
                    if len(self.losses) % 3 == 1:
                        sampler = training.save_weights_and_get_sampling_client(f"victim-{len(self.losses)}")
                        params = types.SamplingParams(max_tokens=3, temperature=1.0)
                        self.samples.append(len(sampler.sample(prompt, 2, params).result(STALL_S).sequences))
                except Exception as exc:  # noqa: BLE001 - every failure of hers is the finding, collected
                    self.errors.append(f"{type(exc).__name__}: {exc}")
                self.round_s.append(time.monotonic() - began)
                time.sleep(0.5)


@pytest.fixture(scope="module")
def victim(service):
    fleet, url, keys = service
    alice = Victim()
    thread = threading.Thread(target=alice.run, args=(url, keys["alice"], fleet.base), daemon=True)
    thread.start()
    deadline = time.monotonic() + 300
    while not alice.samples and not alice.errors:  # she is under way before the first attack
        assert time.monotonic() < deadline, "alice never got going"
        time.sleep(0.5)
    yield alice
    alice.stop.set()
    thread.join(timeout=3 * STALL_S)


@pytest.fixture(scope="module")
def alices_paths(service, victim):
    """Alice's checkpoints of each kind, one published and one not: {(kind, published): path}, and her run id."""
    fleet, url, keys = service
    rest = tinker.RestClient(base_url=url, api_key=keys["alice"])
    client = tinker.ServiceClient(base_url=url, api_key=keys["alice"])
    training, step, _ = one_datum_client(client, fleet.base, 33, "8+5=", "13")
    step()
    paths = {}
    for published in (False, True):
        tag = "public" if published else "private"
        paths["state", published] = training.save_state(f"state-{tag}").result().path
        paths["sampler", published] = training.save_weights_for_sampler(f"sampler-{tag}").result().path
        paths["export", published] = training.save_weights_external(f"export-{tag}").result().path
    training.save_weights_for_sampler("newest").result()  # the newest sampler weights are never deletable
    for (_, published), path in paths.items():
        if published:
            rest.publish_checkpoint_from_tinker_path(path).result()
    return paths, training


def test_every_route_that_takes_a_path_refuses_another_keys_unpublished_and_wrong_kind_paths(
    service, victim, alices_paths
):
    """Bob gives each of alice's paths to each route that takes one. What she did not publish does not exist for
    him (404, whatever the route); what she published he may read with the route of its kind only (a state starts a
    training client or loads into his, sampler weights sample, an export gives download links), another kind is a
    400; he may never delete, publish, unpublish or set the TTL of any of them (404)."""
    fleet, url, keys = service
    paths, alices_training = alices_paths
    bob = tinker.ServiceClient(base_url=url, api_key=keys["bob"])
    rest = tinker.RestClient(base_url=url, api_key=keys["bob"])
    own, _, _ = one_datum_client(bob, fleet.base, 34, "8+5=", "13")
    routes = {
        "create_training_client_from_state": lambda p: on_a_client_of_its_own(
            url, keys["bob"], lambda c: c.create_training_client_from_state(p).result(60)
        ),
        "create_training_client_from_state_with_optimizer": lambda p: on_a_client_of_its_own(
            url, keys["bob"], lambda c: c.create_training_client_from_state_with_optimizer(p).result(60)
        ),
        "load_state": lambda p: own.load_state(p).result(60),
        "load_state_with_optimizer": lambda p: own.load_state_with_optimizer(p).result(60),
        "create_sampling_client": lambda p: bob.create_sampling_client(model_path=p).result(60),
        "get_external_weights_urls": lambda p: external_weights_urls(url, rest, keys["bob"], p),
        "get_weights_info_by_tinker_path": lambda p: rest.get_weights_info_by_tinker_path(p).result(60),
        "delete_checkpoint_from_tinker_path": lambda p: rest.delete_checkpoint_from_tinker_path(p).result(60),
        "publish_checkpoint_from_tinker_path": lambda p: rest.publish_checkpoint_from_tinker_path(p).result(60),
        "unpublish_checkpoint_from_tinker_path": lambda p: rest.unpublish_checkpoint_from_tinker_path(p).result(60),
        "set_checkpoint_ttl_from_tinker_path": lambda p: rest.set_checkpoint_ttl_from_tinker_path(p, 7200).result(60),
    }
    reads = {  # the route that reads each kind
        "create_training_client_from_state": "state",
        "create_training_client_from_state_with_optimizer": "state",
        "load_state": "state",
        "load_state_with_optimizer": "state",
        "create_sampling_client": "sampler",
        "get_external_weights_urls": "export",
    }
    answers, expected = {}, {}
    for route, call in routes.items():
        for (kind, published), path in paths.items():
            name = f"{route}({'published' if published else 'unpublished'} {kind})"
            answers[name] = outcome(lambda call=call, path=path: call(path))
            if not published or route not in reads and route != "get_weights_info_by_tinker_path":
                expected[name] = "404"
            elif route == "get_weights_info_by_tinker_path":
                expected[name] = "ok"  # what a published path is (its base model, rank) is for every key to read
            else:
                expected[name] = "ok" if reads[route] == kind else "400"
    run = alices_training.model_id
    answers["list_checkpoints(alice's run)"] = outcome(lambda: rest.list_checkpoints(run).result(60))
    answers["get_training_run(alice's run)"] = outcome(lambda: rest.get_training_run(run).result(60))
    expected |= {"list_checkpoints(alice's run)": "404", "get_training_run(alice's run)": "404"}
    refused_with(answers, expected)
    listed = {c.tinker_path for c in rest.list_user_checkpoints(limit=1000).result().checkpoints}
    assert not listed & set(paths.values()), listed & set(paths.values())
    assert run not in {r.training_run_id for r in rest.list_training_runs(limit=100).result().training_runs}
    owner = tinker.RestClient(base_url=url, api_key=keys["alice"])
    still = {c.tinker_path: c.public for c in owner.list_checkpoints(run).result().checkpoints}
    assert {path: still[path] for path in paths.values()} == {path: pub for (_, pub), path in paths.items()}


def test_alices_clients_samplers_and_futures_are_not_bobs_to_use(service, victim, alices_paths):
    """Her training client's id in his SDK (train, save), her sampler's handle with his key: each a 404 for him;
    her session's heartbeat with his key a 410, as for a session that does not exist."""
    from tinker.lib.public_interfaces.training_client import TrainingClient

    fleet, url, keys = service
    _, alices_training = alices_paths
    alice = tinker.ServiceClient(base_url=url, api_key=keys["alice"])
    bob = tinker.ServiceClient(base_url=url, api_key=keys["bob"])
    tokenizer = alices_training.get_tokenizer()
    data = [sft_datum(tokenizer, "8+5=", "13")]
    stolen = TrainingClient(
        bob.holder, model_seq_id=0, model_id=alices_training.model_id, info=alices_training.get_info()
    )
    alices_sampler = alice.create_sampling_client(base_model=fleet.base).result()
    prompt = types.ModelInput.from_ints(tokenizer.encode("8+5=", add_special_tokens=False))
    borrowed = tinker.SamplingClient.from_sampler_handle(alices_sampler.get_sampler_handle(), api_key=keys["bob"])
    headers = {"X-API-Key": keys["bob"]}
    answers = {
        "forward_backward": outcome(lambda: stolen.forward_backward(data, "cross_entropy").result(60)),
        "optim_step": outcome(lambda: stolen.optim_step(types.AdamParams(learning_rate=1.0)).result(60)),
        "save_state": outcome(lambda: stolen.save_state("stolen").result(60)),
        "save_weights_for_sampler": outcome(lambda: stolen.save_weights_for_sampler("stolen").result(60)),
        "save_weights_external": outcome(lambda: stolen.save_weights_external("stolen").result(60)),
        "sample with her sampler's handle": outcome(
            lambda: borrowed.sample(prompt, 1, types.SamplingParams(max_tokens=2)).result(60)
        ),
        "heartbeat her session": str(
            httpx.post(
                f"{url}/api/v1/session_heartbeat",
                json={"session_id": alice.holder.get_session_id()},
                headers=headers,
                timeout=60,
            ).status_code
        ),
    }
    # A session that is not open for the key is a 410, as one that never existed or has ended: the SDK reads a 410
    # heartbeat as "this session is over" and stops beating, and bob learns nothing of whether hers exists.
    refused_with(answers, dict.fromkeys(answers, "404") | {"heartbeat her session": "410"})
    assert alices_training.forward(data, "cross_entropy").result(60).loss_fn_outputs  # her client is still hers


def fetched(links: dict[str, str], label: str) -> dict[str, str]:
    """Each download link's HTTP status, named by `label` and its file."""
    return {f"{label}: {name}": str(httpx.get(link, timeout=60).status_code) for name, link in links.items()}


def test_download_links_end_with_the_publication_and_the_export(service, victim):
    """Bob's link to alice's published export ends when she unpublishes it (and he gets no new one), hers when she
    deletes it; no link of either reaches her next export."""
    fleet, url, keys = service
    alice = tinker.ServiceClient(base_url=url, api_key=keys["alice"])
    alice_rest = tinker.RestClient(base_url=url, api_key=keys["alice"])
    bob_rest = tinker.RestClient(base_url=url, api_key=keys["bob"])
    training, step, _ = one_datum_client(alice, fleet.base, 35, "4+4=", "8")
    step()
    exported = training.save_weights_external("linked").result().path
    alice_rest.publish_checkpoint_from_tinker_path(exported).result()
    bobs = bob_rest.get_external_weights_urls(exported).result().urls
    hers = alice_rest.get_external_weights_urls(exported).result().urls
    assert set((fetched(bobs, "bob's") | fetched(hers, "hers")).values()) == {"200"}
    alice_rest.unpublish_checkpoint_from_tinker_path(exported).result()
    answers = fetched(bobs, "bob's after unpublish") | fetched(hers, "hers after unpublish")
    answers["bob asks again"] = outcome(lambda: bob_rest.get_external_weights_urls(exported).result(60))
    alice_rest.delete_checkpoint_from_tinker_path(exported).result()
    answers |= fetched(hers, "hers after delete")
    training.save_weights_external("next").result()  # a number reused would make the old links reach it
    answers |= fetched(bobs, "bob's after her next") | fetched(hers, "hers after her next")
    expected = {name: "200" if name.startswith("hers after unpublish") else "404" for name in answers}
    refused_with(answers, expected)


def test_a_revoked_key_is_refused_everywhere_and_its_links_end(service, victim):
    """Carol trains, saves, exports and samples; the admin removes her run (`DELETE /v1/runs/carol` on the fleet);
    within the service's recheck of a key every SDK call of hers is a 401, and her download link ends too."""
    fleet, url, keys = service
    carol = test_tinker_api.new_key(url, "carol-hostile")
    client = tinker.ServiceClient(base_url=url, api_key=carol)
    rest = tinker.RestClient(base_url=url, api_key=carol)
    training, step, _ = one_datum_client(client, fleet.base, 36, "6+7=", "13")
    step()
    state = training.save_state("revoked").result().path
    exported = training.save_weights_external("revoked").result().path
    link = rest.get_external_weights_urls(exported).result().urls["adapter_config.json"]
    sampler = client.create_sampling_client(base_model=fleet.base).result()
    prompt = types.ModelInput.from_ints([1, 2, 3])
    assert len(sampler.sample(prompt, 1, types.SamplingParams(max_tokens=2)).result().sequences) == 1
    assert httpx.get(link, timeout=60).status_code == 200

    removed = httpx.delete(f"{url}/v1/runs/carol-hostile", headers={"Authorization": f"Bearer {TOKEN}"}, timeout=60)
    assert removed.status_code == 200, removed.text
    deadline = time.monotonic() + 30  # the service's recheck of a key is a second or so; 30 s is its generous bound
    while outcome(lambda: rest.list_user_checkpoints().result(60)) != "401":
        assert time.monotonic() < deadline, "the revoked key still lists"
        time.sleep(0.5)
    data = [sft_datum(training.get_tokenizer(), "6+7=", "13")]
    calls = {
        "forward_backward": lambda: training.forward_backward(data, "cross_entropy").result(60),
        "optim_step": lambda: training.optim_step(types.AdamParams(learning_rate=1e-3)).result(60),
        "save_state": lambda: training.save_state("after").result(60),
        "save_weights_external": lambda: training.save_weights_external("after").result(60),
        "sample": lambda: sampler.sample(prompt, 1, types.SamplingParams(max_tokens=2)).result(60),
        "create_lora_training_client": lambda: client.create_lora_training_client(
            base_model=fleet.base, rank=RANK
        ).result(60),
        "create_training_client_from_state": lambda: client.create_training_client_from_state(state).result(60),
        "get_external_weights_urls": lambda: rest.get_external_weights_urls(exported).result(60),
        "delete_checkpoint_from_tinker_path": lambda: rest.delete_checkpoint_from_tinker_path(state).result(60),
        "publish_checkpoint_from_tinker_path": lambda: rest.publish_checkpoint_from_tinker_path(state).result(60),
        "list_training_runs": lambda: rest.list_training_runs().result(60),
    }
    answers = {name: outcome(call) for name, call in calls.items()}
    answers["her download link"] = str(httpx.get(link, timeout=60).status_code)
    expected = dict.fromkeys(calls, "401") | {"her download link": "404"}
    refused_with(answers, expected)


def fb_body(model_id: str, seq_id: int, data: list[types.Datum]) -> bytes:
    """A `forward_backward` body as the SDK encodes it (its own protobuf encoder)."""
    request = types.ForwardBackwardRequest(
        forward_backward_input=types.ForwardBackwardInput(data=data, loss_fn="cross_entropy"),
        model_id=model_id,
        seq_id=seq_id,
    )
    return forward_backward_request_to_proto(request).SerializeToString()


def test_bodies_too_large_or_malformed_and_values_out_of_range_are_refused_at_once(service, victim, alices_paths):
    """Bob's own training client and sampler, sent what no well-behaved SDK call holds: a body over the service's
    limit (as sent, and a zstd bomb that only inflates past it), bytes that are no protobuf or JSON, a sparse tensor
    whose declared shape is 20 million for a few bytes, token ids outside the vocabulary (in the input, the targets,
    a prompt), two million samples: each a 413 or a 400 when it arrives, and his client trains on after them. A turn
    (`seq_id`) a billion ahead is a 429 (nothing of it kept; the SDK would retry it while the turns before it run), on
    alice's client a 404. The raw bodies go to a client of his that the SDK then leaves alone (they use its turns)."""
    from transformers import AutoConfig

    fleet, url, keys = service
    vocab = AutoConfig.from_pretrained(fleet.model_path).vocab_size
    bob = tinker.ServiceClient(base_url=url, api_key=keys["bob"])
    training, _, logprobs = one_datum_client(bob, fleet.base, 37, "2+3=", "5")
    before = logprobs()
    datum = sft_datum(training.get_tokenizer(), "2+3=", "5")
    model = bob.create_lora_training_client(base_model=fleet.base, rank=RANK, seed=38).result().model_id
    protobuf = {"X-API-Key": keys["bob"], "Content-Type": "application/x-protobuf"}
    as_json = {"X-API-Key": keys["bob"], "Content-Type": "application/json"}

    def post(route: str, body: bytes, headers: dict) -> str:
        return str(httpx.post(f"{url}/api/v1/{route}", content=body, headers=headers, timeout=120).status_code)

    sparse = forward_backward_request_to_proto(
        types.ForwardBackwardRequest(
            forward_backward_input=types.ForwardBackwardInput(data=[datum], loss_fn="cross_entropy"),
            model_id=model,
            seq_id=1,
        )
    )
    weights = sparse.data[0].loss_fn_inputs["weights"]
    weights.Clear()
    weights.dtype = pb.DTYPE_FLOAT32
    weights.shape.extend([1, 20_000_000])
    weights.sparse_csr.values = b"\x00\x00\x80\x3f"
    weights.sparse_csr.crow_indices = b"\x00" * 8 + b"\x01" + b"\x00" * 7
    weights.sparse_csr.col_indices = b"\x00" * 8
    bomb = zstandard.ZstdCompressor().compress(b"\x00" * (64 << 20))

    def with_ids(ids: list[int], targets: list[int]) -> types.Datum:
        return types.Datum(
            model_input=types.ModelInput.from_ints(ids),
            loss_fn_inputs={"target_tokens": targets, "weights": [1.0] * len(targets)},
        )

    sampler = bob.create_sampling_client(base_model=fleet.base).result()
    answers = {
        "a 9 MiB body": post("forward_backward", b"\x00" * (9 << 20), protobuf),
        "a zstd bomb of 64 MiB": post("forward_backward", bomb, protobuf | {"Content-Encoding": "zstd"}),
        "bytes that are no protobuf": post("forward_backward", b"\xff\xfe\xfd not a message", protobuf),
        "bytes that are no JSON": post("optim_step", b"{not json", as_json),
        "JSON of another shape": post("create_model", b'{"session_id": [1, 2], "base_model": {}}', as_json),
        "a sparse shape of 20 million": post("forward_backward", sparse.SerializeToString(), protobuf),
        "an input id = vocab": outcome(
            lambda: training.forward_backward([with_ids([1, vocab, 2], [3, 4, 5])], "cross_entropy").result(60)
        ),
        "a negative input id": outcome(
            lambda: training.forward_backward([with_ids([1, -1, 2], [3, 4, 5])], "cross_entropy").result(60)
        ),
        "a target id = vocab": outcome(
            lambda: training.forward_backward([with_ids([1, 2, 3], [3, vocab, 5])], "cross_entropy").result(60)
        ),
        "a prompt id = vocab": outcome(
            lambda: sampler.sample(
                types.ModelInput.from_ints([1, vocab]), 1, types.SamplingParams(max_tokens=2)
            ).result(60)
        ),
        "2,000,000 samples": outcome(
            lambda: sampler.sample(
                types.ModelInput.from_ints([1, 2]), 2_000_000, types.SamplingParams(max_tokens=2)
            ).result(60)
        ),
        "a seq_id a billion ahead": post("forward_backward", fb_body(model, 10**9, [datum]), protobuf),
        "a seq_id on alice's model": post(
            "forward_backward", fb_body(alices_paths[1].model_id, 10**9, [datum]), protobuf
        ),
    }
    expected = dict.fromkeys(answers, "400") | {
        "a 9 MiB body": "413",
        "a zstd bomb of 64 MiB": "413",
        "a seq_id a billion ahead": "429",
        "a seq_id on alice's model": "404",
    }
    refused_with(answers, expected)
    training.forward_backward([datum], "cross_entropy").result(60)  # his client's turns still come
    training.optim_step(types.AdamParams(learning_rate=1e-2)).result(60)
    assert logprobs() != before


def test_alice_trained_and_sampled_unaffected_throughout(victim):
    """Last in the module: alice's thread, running through every attack above, never failed, never stalled past
    the generous bound, sampled every time, and her loss fell."""
    victim.stop.set()
    time.sleep(1)
    assert not victim.errors, victim.errors
    assert len(victim.losses) >= 6, victim.losses
    assert victim.losses[-1] < 0.5 * victim.losses[0], victim.losses
    assert victim.samples and set(victim.samples) == {2}, victim.samples
    assert max(victim.round_s) < STALL_S, victim.round_s
    print(f"\n[hostile] alice: {len(victim.losses)} rounds, the slowest {max(victim.round_s):.1f} s")
