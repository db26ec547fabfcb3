"""`spotrl eval` on a running fleet without a version: the newest version in the bucket, else the base model as served."""

import httpx

from app.evaluate import default_model
from app.fleet_client import FleetClient
from core.bucket.store import AdapterStore
from core.config import load_config
from tests.support.served_app import answering


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

    def recording(completions, prompts, completion_ids, answer, trainer_state, log_extra, log_metric, **columns):
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
        cfg = load_config(None, ["sampling.num_generations=2", "rollout.max_inflight_tasks=1"])
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

    import app.evaluate as evaluation
    import core.models

    made: list[FleetClient] = []

    def answer(path: str, body: dict | None) -> tuple[int, dict]:
        choice = {"index": 0, "token_ids": [5], "logprobs": {"token_logprobs": [-0.1]}, "text": "7"}
        return 200, {"choices": [{**choice, "finish_reason": "stop"}] * body["n"]}

    class Recorded(FleetClient):
        def __init__(self, base_url, token=None):
            super().__init__(base_url, token)
            made.append(self)

        async def aclose(self) -> None:
            self.pool = self._async  # the session its generations went through
            await super().aclose()

    class Tokenizer:
        def __call__(self, text, add_special_tokens=False):
            return {"input_ids": [ord(c) % 64 for c in text]}

    monkeypatch.setattr(evaluation, "FleetClient", Recorded)
    monkeypatch.setattr(core.models, "load_tokenizer", lambda path: Tokenizer())
    cfg = load_config(None, ["task.num_heldout=4", f"bucket.url=file://{tmp_path}/bucket"])
    with answering(answer) as url:
        result = evaluation.evaluate(cfg, url, "unused", "policy-v1")
    assert result["num_problems"] == 4
    (client,) = made
    assert client.pool.closed and client._async is None and client._client.is_closed


class ResetRaises:
    """A TRL environment whose `reset` raises on the problems the row's `broken` column marks; no tools, and a reward
    of its own: 1 for every episode it played."""

    def reset(self, answer: str, broken: bool = False, **row) -> None:
        if broken:
            raise RuntimeError("no sandbox for this one")

    def get_reward(self) -> float:
        return 1.0


def _evaluate_episodes(broken: list[bool]) -> dict:
    """The held-out evaluation of one problem per entry (`broken`: its reset raises) with a TRL environment, the
    model's turns scripted."""
    import asyncio

    from app.evaluate import evaluate_async
    from app.rollout.tool_episodes import ToolEpisodeRunner
    from app.tasks.problems import Problem
    from app.tasks.trl_environments import ToolChat, tool_tokenizer
    from contracts.rollouts import Choice
    from tiny.tokenizer import build_tokenizer

    chat = ToolChat(tool_tokenizer(build_tokenizer(2, 0)))

    async def generate(prompt_ids, model, n=1, max_tokens=16, temperature=1.0, top_p=1.0, top_k=-1, *, turn=None):
        ids = chat.tokenizer("46<|im_end|>", add_special_tokens=False)["input_ids"]
        prompts = prompt_ids if isinstance(prompt_ids[0], list) else [prompt_ids]
        return [Choice(i, list(ids), [-0.1] * len(ids), "46", "stop") for _ in prompts for i in range(n)]

    runner = ToolEpisodeRunner(
        {None: ResetRaises}, chat, generate, [], max_tool_calling_iterations=None, max_episode_tokens=512, timeout_s=2
    )
    problems = [Problem(f"p{i}", "Compute 12+34.", "46", {"broken": b}) for i, b in enumerate(broken)]
    try:
        return asyncio.run(evaluate_async(runner, chat.tokenizer, problems, "policy-v0", 8))
    finally:
        runner.close()


def test_a_lost_held_out_episode_scores_unsolved_and_is_counted():
    """Each held-out problem is a group of one: a `reset` that raised on one of them raised out of the evaluation
    and ended the run before its first step."""
    result = _evaluate_episodes([False, True, False, True])
    assert result["lost"] == 2 and result["accuracy"] == 0.5 and result["num_problems"] == 4


def test_an_evaluation_whose_every_episode_is_lost_says_so_in_one_line():
    import pytest

    from app.evaluate import EvaluationLost

    with pytest.raises(EvaluationLost, match=r"^every one of the 3 held-out episodes was lost, the last with "):
        _evaluate_episodes([True, True, True])


def test_a_mix_of_datasets_reports_held_out_accuracy_per_dataset():
    """One number for a mix hid a dataset the model never learned behind one it did."""
    import asyncio

    from app.evaluate import evaluate_async
    from app.rollout.sampling import CompletionSampler
    from app.tasks.problems import Problem
    from app.tasks.rewards import RewardScorer, exact_answer
    from contracts.rollouts import Choice

    async def generate(prompt_ids, model, n=1, max_tokens=16, temperature=1.0, top_p=1.0, top_k=-1, *, turn=None):
        return [Choice(i, [4, 6], [-0.1, -0.2], "46", "stop") for i in range(n)]

    class Tokenizer:
        def __call__(self, text, add_special_tokens=False):
            return {"input_ids": [ord(c) for c in text]}

    def problem(i: int, dataset: str, answer: str) -> Problem:
        return Problem(f"p{i}", "Q", answer, {"rg_entry": {"metadata": {"source_dataset": dataset}}})

    problems = [problem(0, "chain_sum", "46"), problem(1, "chain_sum", "46"), problem(2, "leg_counting", "4")]
    problems.append(problem(3, "chain_sum", "7"))
    sampler = CompletionSampler(generate, RewardScorer([exact_answer]))
    try:
        result = asyncio.run(evaluate_async(sampler, Tokenizer(), problems, "policy-v0", 8))
    finally:
        sampler.close()
    assert result["accuracy"] == 0.5
    assert result["accuracy_by_dataset"] == {"chain_sum": 2 / 3, "leg_counting": 0.0}
