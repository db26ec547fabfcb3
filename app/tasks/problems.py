"""Tasks: where prompts and gold answers come from.

Four families share one shape (`Problem`): generated arithmetic (the embedded default, offline and
seeded, with a held-out split that never overlaps the train split), chained arithmetic for the
multi-turn `ChainedArithmetic` environment (`app.tasks.environments`), MATH questions in the
schema of sail/Sanity-Test-R1D-1.5B (`prompt` + `reward_model.ground_truth`), read from JSONL,
parquet or a `datasets` name, and reasoning-gym's procedural datasets, mixed by weight.
Rewards live in `app.tasks.rewards`.

reasoning-gym stays as it is published: its datasets are made by `reasoning_gym.create_dataset`, a weighted mix
by its `composite` dataset, and each problem carries the library's own entry and the dataset that made it, whose
`score_answer` the reward calls (`app.tasks.rewards.reasoning_gym_score`). The prompt is the question followed by
an opened `<answer>` tag, so a small model answers at once and closes the tag (`46</answer>`), and the answer is
read back by the library's `extract_answer`, as its examples read it. The library is imported on first use: it
takes seconds to import and most runs never need it.
"""

from __future__ import annotations

import json
import random
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from core.config import NO_REASONING_GYM, ConfigError

ARITHMETIC_TEMPLATE = "Compute {a}+{b}. Answer: "
ANSWER_OPEN, ANSWER_CLOSE = "<answer>", "</answer>"  # the tags reasoning-gym's `extract_answer` reads by default
# reasoning-gym draws item `idx` of a dataset seeded `s` from `Random(s + idx)` (and seeds the i-th dataset of a mix
# `s + i + 1`), so two splits whose seeds lie closer than their sizes share items: each split draws from a block of
# seeds of its own. Blocks stay below 2**32, since some generators seed numpy with them.
SEED_BLOCK = 2**28
HELDOUT_BLOCK, TRAIN_BLOCK, WARMUP_BLOCK = 0, 1, 2
# Draws allowed per problem asked: a split that finds too few distinct questions within them is an error, as
# arithmetic's is, rather than a loop that never ends on a dataset whose questions are few.
DRAWS_PER_PROBLEM = 4


@dataclass(frozen=True)
class Problem:
    """One prompt and its gold answer; `columns` travel to reward functions as keyword arguments; `completion` is
    what a right completion reads, where it is more than the answer (the supervised warm-up's reference)."""

    id: str
    prompt: str | list[dict[str, str]]
    answer: str
    columns: dict[str, Any] = field(default_factory=dict)
    completion: str | None = None

    @property
    def reference(self) -> str:
        """The completion a right answer is, as the model writes it."""
        return self.answer if self.completion is None else self.completion


@dataclass(frozen=True)
class TaskSplits:
    train: list[Problem]
    heldout: list[Problem]


def arithmetic_prompt(a: int, b: int) -> str:
    return ARITHMETIC_TEMPLATE.format(a=a, b=b)


def make_arithmetic(digits: int, num_train: int, num_heldout: int, seed: int) -> TaskSplits:
    """Addition of two operands below 10**digits; held-out pairs never appear in train."""
    limit = 10**digits
    if num_train + num_heldout > limit * limit // 2:
        raise ValueError(f"{digits}-digit addition has too few distinct problems for the splits asked")
    rng = random.Random(seed)
    seen: set[tuple[int, int]] = set()

    def draw(split: str, count: int) -> list[Problem]:
        problems = []
        while len(problems) < count:
            a, b = rng.randrange(limit), rng.randrange(limit)
            if (a, b) in seen:
                continue
            seen.add((a, b))
            problems.append(Problem(f"{split}-{a}+{b}", arithmetic_prompt(a, b), str(a + b)))
        return problems

    heldout = draw("heldout", num_heldout)
    return TaskSplits(train=draw("train", num_train), heldout=heldout)


def make_chained_arithmetic(
    digits: int, num_train: int, num_heldout: int, seed: int, extra_operands: tuple[int, int], operand_max: int
) -> TaskSplits:
    """Additions `a+b` followed by a chain of operands to add one per turn (`ChainedArithmetic`).

    Each problem's `chain` column holds `extra_operands[0]` to `extra_operands[1]` operands in 1..operand_max;
    the answer is a+b, the first turn's. Held-out episodes (a, b, chain) never appear in train."""
    limit = 10**digits
    low, high = extra_operands
    rng = random.Random(seed)
    seen: set[tuple[int, ...]] = set()

    def draw(split: str, count: int) -> list[Problem]:
        problems = []
        while len(problems) < count:
            a, b = rng.randrange(limit), rng.randrange(limit)
            chain = [rng.randint(1, operand_max) for _ in range(rng.randint(low, high))]
            key = (a, b, *chain)
            if key in seen:
                continue
            seen.add(key)
            name = f"{split}-{a}+{b}" + "".join(f"+{c}" for c in chain)
            problems.append(Problem(name, arithmetic_prompt(a, b), str(a + b), {"chain": chain}))
        return problems

    heldout = draw("heldout", num_heldout)
    return TaskSplits(train=draw("train", num_train), heldout=heldout)


def _read_records(source: str) -> list[dict]:
    path = Path(source)
    if path.suffix == ".jsonl":
        with path.open() as f:
            return [json.loads(line) for line in f if line.strip()]
    if path.suffix == ".parquet":
        import pyarrow.parquet as pq

        return pq.read_table(path).to_pylist()
    if path.exists():
        raise ValueError(f"{source}: unsupported data file (use .jsonl or .parquet)")
    import datasets  # a hub name or a local datasets folder; offline machines need it cached

    return list(datasets.load_dataset(source, split="train"))


def load_math(source: str, num_heldout: int, seed: int) -> TaskSplits:
    """MATH questions in the Sanity-Test schema; a seeded share is held out for evaluation."""
    problems = []
    for i, rec in enumerate(_read_records(source)):
        try:
            gold = rec["reward_model"]["ground_truth"]
            prompt = rec["prompt"]
        except (KeyError, TypeError):
            raise ValueError(f"{source}: record {i} lacks prompt or reward_model.ground_truth") from None
        if isinstance(prompt, str):
            prompt = [{"role": "user", "content": prompt}]
        prompt = [{"role": m["role"], "content": m["content"]} for m in prompt]
        uid = str((rec.get("extra_info") or {}).get("index", i))
        problems.append(Problem(f"math-{uid}", prompt, str(gold)))
    if len(problems) < 2:
        raise ValueError(f"{source}: needs at least 2 problems, found {len(problems)}")
    random.Random(seed).shuffle(problems)
    cut = min(num_heldout, len(problems) // 2)
    return TaskSplits(train=problems[cut:], heldout=problems[:cut])


def reasoning_gym_mix(task_cfg, seed: int, size: int):
    """The task's datasets as reasoning-gym's weighted mix (its `composite` dataset) of `size` items seeded `seed`.

    Each dataset is first made alone, so that one the library does not know, or whose config it refuses, is a
    ConfigError naming its field (the mix itself would only say that something failed)."""
    try:
        import reasoning_gym
        from reasoning_gym.composite import DatasetSpec
        from reasoning_gym.factory import DATASETS
    except ImportError:
        raise ConfigError(NO_REASONING_GYM) from None

    for name, spec in task_cfg.datasets.items():
        where = f"task.datasets.{name}"
        if name == "composite":
            raise ConfigError(f"{where}: the task is already reasoning-gym's weighted mix; name the datasets to mix")
        if name not in DATASETS:
            raise ConfigError(f"{where}: reasoning-gym has no such dataset (it has {len(DATASETS)}, e.g. leg_counting)")
        try:
            reasoning_gym.create_dataset(name, **spec.config)
        except Exception as e:  # a config class refuses by TypeError, its validate() by AssertionError or ValueError
            reason = " ".join(str(e).split()) or "refused"
            raise ConfigError(f"{where}.config: {type(e).__name__}: {reason}") from None
    specs = [DatasetSpec(name, spec.weight, dict(spec.config)) for name, spec in task_cfg.datasets.items()]
    return reasoning_gym.create_dataset("composite", seed=seed, size=size, datasets=specs)


def reasoning_gym_prompt(question: str) -> str:
    """The question, then an opened answer tag for the model to fill and close."""
    return f"{question.rstrip()}\n{ANSWER_OPEN}"


def draw_reasoning_gym(
    task_cfg, seed: int, count: int, split: str, avoid: frozenset[str] = frozenset()
) -> list[Problem]:
    """Up to `count` problems of distinct questions from the task's mix seeded `seed`, none of whose prompts is in
    `avoid`, in the mix's order; fewer when `DRAWS_PER_PROBLEM` draws per problem find no more."""
    budget = DRAWS_PER_PROBLEM * count
    mix = reasoning_gym_mix(task_cfg, seed, budget)
    problems, seen = [], set(avoid)
    for idx in range(budget):
        entry = mix[idx]
        prompt = reasoning_gym_prompt(entry["question"])
        if prompt in seen:
            continue
        seen.add(prompt)
        answer = str(entry["answer"])
        source = entry["metadata"]["source_dataset"]
        columns = {"rg_entry": entry, "rg_dataset": mix}
        problems.append(Problem(f"{split}-{source}-{idx}", prompt, answer, columns, answer + ANSWER_CLOSE))
        if len(problems) == count:
            break
    return problems


def make_reasoning_gym(task_cfg) -> TaskSplits:
    """Train and held-out splits of the task's mix, each from its own block of seeds, and no held-out question in
    train whatever the generators do; ConfigError naming the size that the datasets cannot fill with distinct
    questions."""
    heldout = draw_reasoning_gym(task_cfg, task_cfg.seed + HELDOUT_BLOCK * SEED_BLOCK, task_cfg.num_heldout, "heldout")
    avoid = frozenset(p.prompt for p in heldout)
    train = draw_reasoning_gym(task_cfg, task_cfg.seed + TRAIN_BLOCK * SEED_BLOCK, task_cfg.num_train, "train", avoid)
    for where, asked, got in (("num_heldout", task_cfg.num_heldout, heldout), ("num_train", task_cfg.num_train, train)):
        if len(got) < asked:
            raise ConfigError(
                f"task.{where}={asked}: the datasets gave {len(got)} distinct questions in {DRAWS_PER_PROBLEM * asked} "
                "draws (held-out ones left out of train); ask fewer or widen the datasets' configs"
            )
    return TaskSplits(train=train, heldout=heldout)


def load_task(task_cfg) -> TaskSplits:
    """The splits a config's `task` section names."""
    if task_cfg.name == "reasoning_gym":
        return make_reasoning_gym(task_cfg)
    if task_cfg.name == "arithmetic":
        return make_arithmetic(task_cfg.digits, task_cfg.num_train, task_cfg.num_heldout, task_cfg.seed)
    if task_cfg.name == "chained_arithmetic":
        return make_chained_arithmetic(
            task_cfg.digits,
            task_cfg.num_train,
            task_cfg.num_heldout,
            task_cfg.seed,
            (task_cfg.chain_min, task_cfg.chain_max),
            task_cfg.chain_operand_max,
        )
    return load_math(task_cfg.dataset, task_cfg.num_heldout, task_cfg.seed)
