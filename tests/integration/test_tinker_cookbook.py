"""Thinking Machines' `tinker-cookbook` 0.6.1 (installed by `make setup`) runs its own loops, unchanged, against the
Tinker API on the tiny model (issue 43, item 16): `tinker_cookbook.supervised.train` and `tinker_cookbook.rl.train`,
sync and async, each called as its recipes call it (`asyncio.run(train.main(config))`, the service reached through
`TINKER_BASE_URL` and `TINKER_API_KEY`, as a user would point the cookbook at it).

Only what the issue lets differ from the cookbook's defaults does: the model (the tiny model's folder, which names
the base model and loads its tokenizer), `lora_rank` (the keys' rank), the renderer and local data. The required
fields without a default (`learning_rate`, `max_tokens`, `recipe_name`, `log_path`; the dataset's batch and group
sizes) take the tiny model's values (`make train`'s learning rate, `bench.tinker_rl`'s completion length), and so
does SL's learning rate (its test says why). The renderer is `role_colon` for SL (the cookbook's own; nothing imports `tml_renderers`, which only its Inkling and
Kimi K3.1 tokenizers and renderers need) and, for RL, one registered through the cookbook's `register_renderer`
that renders a prompt as the tiny model was warmed up on (`Compute 60+62. Answer: `), since a chat header would
leave it nothing to reinforce.
"""

import asyncio
import json
from functools import partial

import chz
import pytest
import tinker
from tinker_cookbook import renderers
from tinker_cookbook.renderers.base import RenderedMessage
from tinker_cookbook.rl import train as rl_train
from tinker_cookbook.rl.problem_env import ProblemEnv, ProblemGroupBuilder
from tinker_cookbook.rl.types import RLDataset, RLDatasetBuilder
from tinker_cookbook.supervised import train as sl_train
from tinker_cookbook.supervised.data import FromConversationFileBuilder
from tinker_cookbook.supervised.types import ChatDatasetBuilderCommonConfig
from tinker_cookbook.tokenizer_utils import get_tokenizer

from tests.integration import test_tinker_api
from tests.integration.test_tinker_api import RANK

# The service `test_tinker_api` starts (a fleet, a learner, keys alice and bob), started again for this module.
service, notice_file = test_tinker_api.service, test_tinker_api.notice_file

PLAIN = "spotrl/plain_prompt"  # the RL renderer's registered name
LEARNING_RATE = 1e-3  # `make train`'s (configs/tiny-cpu.yaml's grpo.learning_rate)
MAX_TOKENS = 6  # bench.tinker_rl's: the longest answer and its end


@pytest.fixture
def cookbook_env(service, monkeypatch):
    """The cookbook's `ServiceClient(base_url=None)` reads the service and the key from the environment."""
    fleet, url, keys = service
    monkeypatch.setenv("TINKER_BASE_URL", url)
    monkeypatch.setenv("TINKER_API_KEY", keys["bob"])
    return fleet


def tiny_task():
    from app.tasks.problems import load_task
    from core.config import load_config

    return load_task(load_config().task)


def metric_rows(log_path) -> list[dict]:
    return [json.loads(line) for line in (log_path / "metrics.jsonl").read_text().splitlines()]


def test_the_cookbooks_supervised_loop_lowers_the_test_loss(cookbook_env, tmp_path):
    """`supervised.train` with the cookbook's defaults (linear decay, evaluations every 10 steps, saves every 20)
    over a local conversations file: its test NLL (`test/nll`, sampler weights scored by `compute_logprobs`) falls
    below 0.7 of the first evaluation's within 21 steps. The one default changed beyond the issue's list is the
    learning rate: every recipe sets its own for its model, and at the default 1e-4 the tiny model's LoRA moves too
    little in 21 steps (measured: 9.05 -> 8.53 with `role_colon`, 0.51 -> 0.48 with the plain renderer below); at
    `make train`'s 1e-3: 9.05 -> 5.60."""
    fleet = cookbook_env
    conversations = tmp_path / "conversations.jsonl"
    rows = [
        {"messages": [{"role": "user", "content": p.prompt}, {"role": "assistant", "content": p.answer}]}
        for p in tiny_task().train[: 21 * 8 + 32]
    ]
    conversations.write_text("".join(json.dumps(row) + "\n" for row in rows))
    common = ChatDatasetBuilderCommonConfig(
        model_name_for_tokenizer=fleet.model_path, renderer_name="role_colon", max_length=None, batch_size=8
    )
    config = sl_train.Config(
        log_path=str(tmp_path / "sl"),
        model_name=fleet.model_path,
        recipe_name="spotrl_sl_test",
        renderer_name="role_colon",
        learning_rate=LEARNING_RATE,
        dataset_builder=FromConversationFileBuilder(common_config=common, file_path=str(conversations), test_size=32),
        lora_rank=RANK,
    )
    asyncio.run(sl_train.main(config))
    nll = [row["test/nll"] for row in metric_rows(tmp_path / "sl") if "test/nll" in row]
    print(f"\n[cookbook sl] test/nll at steps 0, 10, 20: {nll}")
    assert len(nll) == 3 and nll[-1] < 0.7 * nll[0], nll


class PlainPromptRenderer(renderers.Renderer):
    """A conversation as the tiny model's task text: a user message is its prompt as it is, the assistant's turn has
    no header and ends with EOS, its stop sequence."""

    def render_message(self, message, ctx):
        end = [self.tokenizer.eos_token_id] if message["role"] == "assistant" and message["content"] else []
        tokens = self.tokenizer.encode(renderers.ensure_text(message["content"]), add_special_tokens=False) + end
        return RenderedMessage(
            header=tinker.types.EncodedTextChunk(tokens=[]),
            output=[tinker.types.EncodedTextChunk(tokens=tokens)],
        )

    def get_stop_sequences(self) -> list[int]:
        return [self.tokenizer.eos_token_id]

    def parse_response(self, response):
        ended = bool(response) and response[-1] == self.tokenizer.eos_token_id
        text = self.tokenizer.decode(response[:-1] if ended else response)
        termination = renderers.ParseTermination.STOP_SEQUENCE if ended else renderers.ParseTermination.MALFORMED
        return renderers.Message(role="assistant", content=text), termination


renderers.register_renderer(PLAIN, lambda tokenizer, _image_processor: PlainPromptRenderer(tokenizer))


class TinyTaskEnv(ProblemEnv):
    """One of the tiny model's arithmetic problems: right when the completion is the answer, as `make train` scores."""

    def __init__(self, problem, renderer):
        super().__init__(renderer)
        self.problem = problem

    def get_question(self) -> str:
        return self.problem.prompt

    def check_answer(self, sample_str: str) -> bool:
        return sample_str.strip() == self.problem.answer

    def check_format(self, sample_str: str) -> bool:
        return True

    def get_reference_answer(self) -> str:
        return self.problem.answer


class TinyTaskDataset(RLDataset):
    def __init__(self, problems, renderer, batch_size: int, group_size: int):
        self.problems, self.renderer, self.batch_size, self.group_size = problems, renderer, batch_size, group_size

    def get_batch(self, index: int):
        batch = self.problems[index * self.batch_size : (index + 1) * self.batch_size]
        return [
            ProblemGroupBuilder(env_thunk=partial(TinyTaskEnv, p, self.renderer), num_envs=self.group_size)
            for p in batch
        ]

    def __len__(self) -> int:
        return len(self.problems) // self.batch_size


@chz.chz
class TinyTaskBuilder(RLDatasetBuilder):
    """The tiny model's training problems in order, `batch_size` groups of `group_size` per step (local data)."""

    model_path: str
    batch_size: int
    group_size: int
    steps: int

    async def __call__(self):
        renderer = renderers.get_renderer(PLAIN, get_tokenizer(self.model_path))
        problems = tiny_task().train[: self.steps * self.batch_size]
        return TinyTaskDataset(problems, renderer, self.batch_size, self.group_size), None


def rl_config(fleet, log_path, steps: int, batch_size: int, group_size: int, **fields) -> rl_train.Config:
    return rl_train.Config(
        log_path=str(log_path),
        model_name=fleet.model_path,
        recipe_name="spotrl_rl_test",
        renderer_name=PLAIN,
        dataset_builder=TinyTaskBuilder(
            model_path=fleet.model_path, batch_size=batch_size, group_size=group_size, steps=steps
        ),
        learning_rate=LEARNING_RATE,
        max_tokens=MAX_TOKENS,
        lora_rank=RANK,
        **fields,
    )


def final_sampler_path(log_path) -> str:
    records = [json.loads(line) for line in (log_path / "checkpoints.jsonl").read_text().splitlines()]
    return [r["sampler_path"] for r in records if r.get("sampler_path")][-1]


STABLE_REINFORCE_REFUSED = pytest.mark.xfail(
    strict=True,
    reason="issue 43 finding: the service refuses `stable_reinforce` (AsyncConfig's default loss) at the first "
    "sample, record_stability_info being a 400 that names ppo; neither the SDK 0.38.0 nor the cookbook 0.6.1 "
    "defines its objective, so it is not implemented",
)


@pytest.mark.parametrize("mode", ["sync", pytest.param("async", marks=STABLE_REINFORCE_REFUSED), "async with ppo"])
def test_the_cookbooks_rl_loop_runs_its_steps_and_saves(cookbook_env, tmp_path, mode):
    """`rl.train` for 3 steps, sync (`importance_sampling`) and async (`AsyncConfig`'s default loss,
    `stable_reinforce`, refused; and `ppo`, the loss the refusal names): every step trains (a metric row of its
    episodes each) and its final sampler weights sample."""
    fleet = cookbook_env
    fields = {}
    if mode.startswith("async"):
        loss = {"loss_fn": "ppo"} if mode.endswith("ppo") else {}
        fields["async_config"] = rl_train.AsyncConfig(max_steps_off_policy=1, groups_per_batch=4, **loss)
    log_path = tmp_path / "rl"
    config = rl_config(fleet, log_path, steps=3, batch_size=4, group_size=4, **fields)
    asyncio.run(rl_train.main(config))
    steps = {row["step"] for row in metric_rows(log_path) if any(k.startswith("env/") for k in row)}
    assert len(steps) == 3, steps
    with tinker.ServiceClient() as client:
        sampler = client.create_sampling_client(model_path=final_sampler_path(log_path)).result()
        prompt = tinker.types.ModelInput.from_ints([1, 2, 3])
        assert len(sampler.sample(prompt, 1, tinker.types.SamplingParams(max_tokens=2)).result().sequences) == 1


@pytest.mark.slow
def test_the_cookbooks_sync_rl_loop_raises_held_out_accuracy_by_10_points(cookbook_env, tmp_path):
    """`rl.train` (sync, the cookbook's `importance_sampling`, no KL, temperature 1) on the tiny task, 16 problems x
    8 samples a step: greedy held-out accuracy (the task's held-out split, `bench.tinker_rl`'s measure) of its final
    sampler weights against the base model's."""
    from bench.tinker_rl import heldout_accuracy

    fleet = cookbook_env
    steps = 40
    asyncio.run(rl_train.main(rl_config(fleet, tmp_path / "rl", steps=steps, batch_size=16, group_size=8)))
    heldout = tiny_task().heldout
    tokenizer = get_tokenizer(fleet.model_path)
    with tinker.ServiceClient() as client:
        base = client.create_sampling_client(base_model=fleet.model_path).result()
        trained = client.create_sampling_client(model_path=final_sampler_path(tmp_path / "rl")).result()
        before, after = heldout_accuracy(base, tokenizer, heldout), heldout_accuracy(trained, tokenizer, heldout)
    print(f"\n[cookbook rl] held-out {100 * before:.1f}% -> {100 * after:.1f}% in {steps} steps")
    assert after - before >= 0.10, (before, after)
