"""`python -m app.evaluate` without --adapter: the newest version in the bucket, else the base model as served."""

import httpx

from app.evaluate import default_model
from app.fleet_client import FleetClient
from core.bucket.store import AdapterStore
from core.config import load_config


def _fleet(base_name: str, adapters: list[str]) -> FleetClient:
    def handler(request: httpx.Request) -> httpx.Response:
        assert request.url.path == "/v1/models"
        data = [{"id": base_name, "parent": None}, *({"id": a, "parent": base_name} for a in adapters)]
        return httpx.Response(200, json={"object": "list", "data": data})

    return FleetClient("http://fleet.test", transport=httpx.MockTransport(handler))


def test_without_a_version_the_base_model_is_evaluated_under_the_name_the_fleet_serves(tmp_path):
    cfg = load_config(None, [f"bucket.url=file://{tmp_path}/bucket", f"bucket.cache_dir={tmp_path}/cache"])
    served_as = "/models/tiny-qwen2"  # the fleet serves the base under its resolved folder
    assert default_model(cfg, _fleet(served_as, [])) == served_as

    adapter = tmp_path / "adapter"
    adapter.mkdir()
    (adapter / "adapter_config.json").write_text('{"r": 1}')
    (adapter / "adapter_model.safetensors").write_bytes(b"weights")
    AdapterStore.from_config(cfg).publish(adapter, 3)
    assert default_model(cfg, _fleet(served_as, ["policy-v3"])) == "policy-v3"


def test_evaluation_scores_a_problem_as_training_does_with_every_column_it_has():
    """Evaluation and the rollout share one sampler: the reward functions see the problem's own columns in both."""
    import asyncio

    from app.evaluate import evaluate_async
    from app.rollout.producer import GroupProducer
    from app.rollout.sampling import CompletionSampler
    from app.tasks.problems import Problem
    from app.tasks.rewards import RewardScorer
    from contracts.rollouts import Choice
    from core.config import load_config

    seen = []

    def recording(completions, prompts, completion_ids, answer, **columns):
        seen.append({"answer": answer, **columns})
        return [float(c == a) for c, a in zip(completions, answer, strict=True)]

    async def generate(prompt_ids, model, n=1, max_tokens=16, temperature=1.0, top_p=1.0, top_k=-1, *, turn=None):
        return [Choice(i, [4, 6], [-0.1, -0.2], "46", "stop") for i in range(n)]

    class Tokenizer:
        def __call__(self, text, add_special_tokens=False):
            return {"input_ids": [ord(c) for c in text]}

    problem = Problem("p", "Compute 12+34. Answer: ", "46", {"level": "easy", "source": "unit"})
    sampler = CompletionSampler(generate, RewardScorer([recording]))
    result = asyncio.run(evaluate_async(sampler, Tokenizer(), [problem], "policy-v0", 8, 4))
    assert result["accuracy"] == 1.0 and result["mean_reward"] == 1.0
    (evaluated,) = seen
    assert evaluated == {"answer": ["46"], "truncated": [False], "level": ["easy"], "source": ["unit"]}

    async def train_one_group():
        cfg = load_config(None, ["grpo.num_generations=2", "rollout.max_inflight_tasks=1"])
        producer = GroupProducer(cfg, [problem], lambda p: [1, 2], sampler)
        producer.start()
        await producer.get_groups(1)
        await producer.stop()

    asyncio.run(asyncio.wait_for(train_one_group(), 30))
    trained = seen[1]
    assert trained == {name: values * 2 for name, values in evaluated.items()}  # the same columns, per sample


def test_an_evaluation_closes_its_client_its_connections_and_its_sampler(monkeypatch, tmp_path):
    """The driver evaluates before and after every run; a caller that evaluates again and again must not leak a
    client (its connection pool) each time."""
    import json

    import app.evaluate as evaluation
    import core.models

    made: list[FleetClient] = []

    def answer(request: httpx.Request) -> httpx.Response:
        body = json.loads(request.content)
        choice = {"index": 0, "token_ids": [5], "logprobs": {"token_logprobs": [-0.1]}, "text": "7"}
        return httpx.Response(200, json={"choices": [{**choice, "finish_reason": "stop"}] * body["n"]})

    class Recorded(FleetClient):
        def __init__(self, base_url, token=None):
            super().__init__(base_url, token)
            self.pool = self._async = httpx.AsyncClient(base_url=base_url, transport=httpx.MockTransport(answer))
            made.append(self)

    class Tokenizer:
        def __call__(self, text, add_special_tokens=False):
            return {"input_ids": [ord(c) % 64 for c in text]}

    monkeypatch.setattr(evaluation, "FleetClient", Recorded)
    monkeypatch.setattr(core.models, "load_tokenizer", lambda path: Tokenizer())
    cfg = load_config(None, ["task.num_heldout=4", f"bucket.url=file://{tmp_path}/bucket"])
    result = evaluation.evaluate(cfg, "http://fleet.test", "unused", "policy-v1")
    assert result["num_problems"] == 4
    (client,) = made
    assert client.pool.is_closed and client._async is None and client._client.is_closed
