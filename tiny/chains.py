"""The tiny model's recipe for chained arithmetic: correctly played episodes of a train split of the warm-up's own
seed, laid out as the rollout lays one out, judged by whole episodes played greedily to the end."""

from __future__ import annotations

import torch

from app.tasks.environments import ChainedArithmetic
from app.tasks.problems import Problem, load_task, make_chained_arithmetic
from core.config import TaskConfig, TinyModelConfig
from tiny.recipe import TaskRecipe
from tiny.warmup import WarmUpData, WarmUpPlan, encode


def episode_example(tokenizer, problem: Problem) -> tuple[list[int], list[int]]:
    """A correctly played chained episode laid out exactly as the rollout lays one out (each turn's answer
    tokenised on its own and closed by EOS, each observation tokenised once), loss on the model's turns."""
    env = ChainedArithmetic()
    env.reset(problem)
    ids = encode(tokenizer, problem.prompt)
    mask = [0] * len(ids)
    while True:
        turn = encode(tokenizer, str(env.total)) + [tokenizer.eos_token_id]
        ids += turn
        mask += [1] * len(turn)
        step = env.step(str(env.total), turn)
        if step.done:
            return ids, mask
        obs = encode(tokenizer, step.observation)
        ids += obs
        mask += [0] * len(obs)


@torch.no_grad()
def greedy_episode_accuracy(model, tokenizer, problems: list[Problem], max_new_tokens: int) -> float:
    """Share of chained episodes played right to the end greedily (plain PyTorch, the rollout's token layout)."""
    from tiny.tool_play import greedy_continuations

    model.eval()
    eos = tokenizer.eos_token_id
    envs = []
    for p in problems:
        env = ChainedArithmetic()
        env.reset(p)
        envs.append(env)
    seqs = [encode(tokenizer, p.prompt) for p in problems]
    active, solved = list(range(len(problems))), 0
    while active:
        out = greedy_continuations(model, [seqs[i] for i in active], max_new_tokens, eos, batch_size=len(active))
        still = []
        for i, new in zip(active, out, strict=True):
            turn = new[: new.index(eos) + 1] if eos in new else new
            step = envs[i].step(tokenizer.decode(turn, skip_special_tokens=True), turn)
            if step.done:
                solved += bool(step.solved)
            elif eos in turn:
                seqs[i] = seqs[i] + turn + encode(tokenizer, step.observation)
                still.append(i)
        active = still
    model.train()
    return solved / len(problems)


class Chains(TaskRecipe):
    """Multi-turn: a chain's operands are added one turn at a time, the environment telling the next."""

    single_turn = False

    def key(self, task: TaskConfig) -> dict:
        return {"episodes": [task.chain_min, task.chain_max, task.chain_operand_max]}

    def data(self, task: TaskConfig, tiny: TinyModelConfig) -> WarmUpData:
        splits = load_task(task)
        return WarmUpData(splits.heldout, splits.train)

    def plan(self, tokenizer, tiny, task, data, judge, render=None) -> WarmUpPlan:
        # A train split of its own seed: held-out chains excluded by (a, b, chain).
        held = {p.id.removeprefix("heldout-") for p in data.heldout}
        chains = make_chained_arithmetic(
            task.digits, 20000, 1, tiny.seed + 7, (task.chain_min, task.chain_max), task.chain_operand_max
        ).train
        chains = [p for p in chains if p.id.removeprefix("train-") not in held]
        return WarmUpPlan(
            lambda rng: episode_example(tokenizer, rng.choice(chains)),
            lambda model: greedy_episode_accuracy(model, tokenizer, data.heldout, max_new_tokens=task.digits + 3),
        )


CHAINS = Chains()
