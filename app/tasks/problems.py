"""Tasks: where prompts and gold answers come from.

Three families share one shape (`Problem`): generated arithmetic (the embedded default, offline and
seeded, with a held-out split that never overlaps the train split), chained arithmetic for the
multi-turn `ChainedArithmetic` environment (`app.tasks.environments`), and MATH questions in the
schema of sail/Sanity-Test-R1D-1.5B (`prompt` + `reward_model.ground_truth`), read from JSONL,
parquet or a `datasets` name. Rewards live in `app.tasks.rewards`.
"""

from __future__ import annotations

import json
import random
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

ARITHMETIC_TEMPLATE = "Compute {a}+{b}. Answer: "


@dataclass(frozen=True)
class Problem:
    """One prompt and its gold answer; `columns` travel to reward functions as keyword arguments."""

    id: str
    prompt: str | list[dict[str, str]]
    answer: str
    columns: dict[str, Any] = field(default_factory=dict)


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


def load_task(task_cfg) -> TaskSplits:
    """The splits a config's `task` section names."""
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
