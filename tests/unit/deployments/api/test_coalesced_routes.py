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
