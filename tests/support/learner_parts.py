"""A learner's parts for tests, without Ray: a small random model folder, GRPO-shaped groups of random samples, a
learner config of a small LoRA (the unit tests of packing and the learner, and the learner's integration tests)."""

from __future__ import annotations

import random

from app.objectives import Objectives
from contracts.rollouts import Group, Sample
from core.config import RunConfig

VOCAB = 64


def random_model(folder) -> str:
    """A small random Qwen2 saved as a model folder (no tokenizer: the learner works on token ids)."""
    from tiny.network import random_qwen2

    model = random_qwen2(
        vocab_size=VOCAB,
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=128,
    )
    model.save_pretrained(folder)
    return str(folder)


def random_groups(
    n_groups: int, group_size: int = 4, seed: int = 0, first_id: int = 0, max_completion: int = 12
) -> list[Group]:
    """Groups shaped like GRPO rollouts: one prompt per group, completions of very different lengths, annotated
    by the default objectives (GRPO) as the rollout annotates them.

    Their ids are `first_id`, `first_id + 1`, ...: give each step's groups their own range."""
    rng = random.Random(seed)
    groups = []
    for g in range(n_groups):
        prompt = [rng.randrange(1, VOCAB) for _ in range(rng.randint(3, 8))]
        samples = []
        for _ in range(group_size):
            n = rng.randint(1, max_completion)
            samples.append(
                Sample(
                    completion_ids=[rng.randrange(1, VOCAB) for _ in range(n)],
                    sampling_logprobs=[-rng.uniform(3.5, 4.8) for _ in range(n)],  # near log(1/64): ratios near 1
                    reward=float(rng.random() < 0.5),
                )
            )
        groups.append(Group(first_id + g, f"p{g}", prompt, 0, samples))
    objectives = Objectives.from_config(RunConfig())
    return [objectives.annotate(group) for group in groups]


def learner_config(**learner) -> RunConfig:
    cfg = RunConfig()
    cfg.lora.rank, cfg.lora.alpha = 2, 4.0
    for key, value in learner.items():
        setattr(cfg.learner, key, value)
    return cfg
