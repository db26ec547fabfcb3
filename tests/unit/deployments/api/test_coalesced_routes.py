"""Single-sample requests through the app (`deployments.api.inference_routes` over a fake backend): like requests of
one run become one call of their summed `n` that holds that many places of the run's fair share, other runs' and
seeded requests stay apart, each caller gets its own choice, and the run's usage counts every request it sent."""

import asyncio

import httpx

from deployments.api import make_app
from tests.support.fake_fleet import ADMIN, BASE, FakeBackend, api_settings


def test_like_requests_of_a_run_are_one_call_counted_in_its_own_share():
    backend = FakeBackend()
    app = make_app(backend, api_settings(max_loras=10))  # room for two runs
    body = {"model": BASE, "prompt": [1, 2, 3], "max_tokens": 2, "logprobs": 0}

    async def run():
        transport = httpx.ASGITransport(app=app)
        async with httpx.AsyncClient(transport=transport, base_url="http://fleet") as http:
            tokens = {}
            for name in ("alice", "bob"):
                r = await http.post("/v1/runs", json={"name": name}, headers=ADMIN)
                assert r.status_code == 200, r.text
                tokens[name] = {"Authorization": f"Bearer {r.json()['token']}"}
            sent = [http.post("/v1/completions", json=body, headers=tokens[run]) for run in ["alice"] * 4 + ["bob"] * 2]
            sent += [http.post("/v1/completions", json={**body, "seed": 5}, headers=tokens["alice"]) for _ in range(2)]
            replies = await asyncio.gather(*sent)
            stats = (await http.get("/router/stats", headers=ADMIN)).json()
            return replies, stats

    replies, stats = asyncio.run(run())
    assert [r.status_code for r in replies] == [200] * 8
    assert all([c["index"] for c in r.json()["choices"]] == [0] for r in replies)
    assert all(r.json()["usage"]["completion_tokens"] == 2 for r in replies)
    calls = sorted((r.sampling.n, r.sampling.seed) for kind, r in backend.calls if kind == "generate")
    assert calls == [(1, 5), (1, 5), (2, None), (4, None)]  # alice's 4, bob's 2, each seeded one alone
    runs = stats["runs"]["runs"]  # the fair share, per run: what its clients sent, as each reply's usage says
    usage = {"requests": 6, "prompt_tokens": 6 * 3, "completion_tokens": 6 * 2}
    assert {k: runs["alice"][k] for k in usage} == usage
    assert {k: runs["bob"][k] for k in usage} == {"requests": 2, "prompt_tokens": 2 * 3, "completion_tokens": 2 * 2}


def test_a_runs_scored_sequences_of_one_prompt_are_one_call_each_answered_and_counted_as_sent():
    backend = FakeBackend()
    app = make_app(backend, api_settings(max_loras=10, routing_block_size=2))  # the router's block: two tokens
    tails = [[4, 5], [6], [7, 8, 9], [4, 5]]
    body = {"model": BASE, "max_tokens": 1, "prompt_logprobs": 0}

    async def run():
        transport = httpx.ASGITransport(app=app)
        async with httpx.AsyncClient(transport=transport, base_url="http://fleet") as http:
            r = await http.post("/v1/runs", json={"name": "alice"}, headers=ADMIN)
            token = {"Authorization": f"Bearer {r.json()['token']}"}
            sent = [http.post("/v1/completions", json={**body, "prompt": [1, 2, *t]}, headers=token) for t in tails]
            sent.append(http.post("/v1/completions", json={**body, "prompt": [3, 2, 1]}, headers=token))
            replies = await asyncio.gather(*sent)
            return replies, (await http.get("/router/stats", headers=ADMIN)).json()

    replies, stats = asyncio.run(run())
    assert [r.status_code for r in replies] == [200] * 5
    bundles = [requests for kind, requests in backend.calls if kind == "generate_many"]
    assert len(bundles) == 1 and sorted(r.prompt_ids for r in bundles[0]) == [[1, 2, 4, 5], [1, 2, 6], [1, 2, 7, 8, 9]]
    assert [r.sampling.n for r in bundles[0] if r.prompt_ids == [1, 2, 4, 5]] == [2]  # the same sequence twice: merged
    for reply, tail in zip(replies, tails, strict=False):  # each scores its own sequence
        scored = reply.json()["choices"][0]["prompt_logprobs"]
        assert len(scored) == 2 + len(tail) and scored[0] is None
    usage = {"requests": 5, "prompt_tokens": 4 + 3 + 5 + 4 + 3, "completion_tokens": 5 * 1}
    assert {k: stats["runs"]["runs"]["alice"][k] for k in usage} == usage
