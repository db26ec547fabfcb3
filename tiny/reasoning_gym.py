"""The tiny model's recipe for reasoning-gym's datasets: a task with reference answers. Its tokenizer learns their
text, its warm-up trains on problems drawn from the generators under a seed of the warm-up's own (none held out) with
their reference completions, and a greedy completion is judged by the task's reward functions, as evaluation judges
it; a context too short for its problems is refused naming the field."""

from __future__ import annotations

import importlib.metadata

from app.tasks.problems import SEED_BLOCK, WARMUP_BLOCK, draw_reasoning_gym, load_task
from core.config import NO_REASONING_GYM, ConfigError, ModelConfig, TaskConfig, TinyModelConfig
from tiny.recipe import TaskRecipe
from tiny.tokenizer import CORPUS_PROBLEMS, build_tokenizer
from tiny.warmup import WarmUpData, WarmUpPlan, check_context, encode, greedy_accuracy, reference_example, rewards_judge

# Problems the warm-up draws from (a pool reused across steps, as arithmetic's fresh additions are not).
WARMUP_POOL = 16384


def reasoning_gym_version() -> str:
    try:
        return importlib.metadata.version("reasoning-gym")
    except importlib.metadata.PackageNotFoundError:
        raise ConfigError(NO_REASONING_GYM) from None


class ReasoningGym(TaskRecipe):
    """A weighted mix of reasoning-gym's datasets (`task.datasets`)."""

    def key(self, task: TaskConfig) -> dict:
        # Its tokenizer and warm-up come from the datasets' own problems, in the mix's order (which seeds each
        # dataset), drawn by the library's version of the generators, and held-out accuracy is judged by the rewards.
        return {
            "reasoning_gym": {
                "datasets": [[name, d.model_dump()] for name, d in task.datasets.items()],
                "library": reasoning_gym_version(),
                "reward_funcs": task.reward_funcs,
            }
        }

    def data(self, task: TaskConfig, tiny: TinyModelConfig) -> WarmUpData:
        splits = load_task(task)
        avoid = frozenset(p.prompt for p in splits.heldout)
        pool = draw_reasoning_gym(task, tiny.seed + WARMUP_BLOCK * SEED_BLOCK, WARMUP_POOL, "warmup", avoid)
        return WarmUpData(splits.heldout, splits.train, pool)

    def tokenizer(self, model_cfg: ModelConfig, task: TaskConfig, data: WarmUpData):
        corpus = [p.prompt + p.reference for p in data.pool[:CORPUS_PROBLEMS]]
        tokenizer = build_tokenizer(task.digits, model_cfg.tiny.seed, texts=corpus)
        check_context(tokenizer, model_cfg, data.heldout + data.train + data.pool)
        return tokenizer

    def judge(self, task: TaskConfig):
        return rewards_judge(task)

    def plan(self, tokenizer, tiny, task, data, judge, render=None) -> WarmUpPlan:
        longest = max(len(encode(tokenizer, p.reference)) for p in data.heldout)
        return WarmUpPlan(
            lambda rng: reference_example(tokenizer, rng.choice(data.pool)),
            lambda model: greedy_accuracy(model, tokenizer, data.heldout, max_new_tokens=longest + 1, judge=judge),
        )

    def draw(self, rng, task, data):
        return rng.choice(data.pool)


REASONING_GYM = ReasoningGym()
