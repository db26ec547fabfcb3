"""The embedded default model: a tiny Qwen2 built here, with nothing downloaded.

GRPO needs a base that is sometimes right and sometimes wrong, so groups have mixed rewards.
We build a ~0.5M-parameter Qwen2 (random init) and a byte-level BPE tokenizer trained with
`tokenizers` in Qwen2's own shape (same pre-tokenizer regex, byte-level decoder), so that
transformers' `Qwen2Tokenizer`, which AutoTokenizer and vLLM pick for `model_type=qwen2` whatever
the folder says, tokenizes exactly like the tokenizer we trained. The tokenizer learns its pieces from
the task's own text, and a short supervised warm-up on the task's own problems stops on a held-out
accuracy threshold (the jump happens at a different step for each seed): generated additions for
arithmetic, correctly played episodes for chains, and for a task with reference answers
(reasoning-gym's datasets) problems drawn from its generators under a seed of the warm-up's own, judged
by the task's reward functions as evaluation judges them. The folder is cached under a key of its
config, so it is built once.

A self teacher (self-distillation) is the model shown a problem's answer in its prompt; a pretrained model reads
it, a model this small has never seen one. With `model.tiny.warmup_context` (the teacher's template) the build
starts from the same config's model without it (the embedded default, cached or built first) and goes on with the
problems shown under the template, until held-out accuracy shown so reaches `warmup_context_accuracy`.

    python -m app.tiny_model [--config FILE] [--set model.tiny.seed=1]
"""

from __future__ import annotations

import argparse
import json
import os
import random
import shutil
import sys
import tempfile
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import torch

from app.tasks.privileged import privileged_problem
from app.tasks.problems import Problem, arithmetic_prompt, make_arithmetic
from app.tasks.rewards import RewardScorer, reward_columns
from app.tiny_templates import CHAT_TEMPLATE, END_OF_TURN, EOS, TOOL_CHAT_TEMPLATE
from core.config import ConfigError, ModelConfig, TaskConfig, TinyModelConfig, add_config_args, config_from_args
from core.models import load_tokenizer, prompt_token_ids, resolve_model_path, tiny_model_folder

SPECIAL_TOKENS = [EOS, "<|im_start|>", END_OF_TURN]
# Qwen2's pre-tokenizer: digits split one by one, so numbers are sequences of digit tokens.
QWEN2_PATTERN = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)


# Problems of a task with reference answers whose text the tokenizer learns its pieces from, and that the
# warm-up draws from (a pool reused across steps, as arithmetic's fresh additions are not).
CORPUS_PROBLEMS, WARMUP_POOL = 2000, 16384
# Demonstrated tool episodes a tool warm-up draws from (each played through its environment once, at build).
TOOL_POOL = 4096
# The draft tokenizer knows few pieces of the tool format: room for its episodes, which only give the corpus text.
DRAFT_EPISODE_TOKENS = 4096


def _tokenizer_corpus(rng: random.Random, digits: int, texts: list[str] | None = None) -> list[str]:
    """The task's text (generated additions unless `texts` gives it), then a few words of chat and instructions."""
    if texts is None:
        limit = 10**digits
        texts = [
            arithmetic_prompt(rng.randrange(limit), rng.randrange(limit)) + str(rng.randrange(2 * limit))
            for _ in range(2000)
        ]
    texts = list(texts) + [
        "The quick brown fox jumps over the lazy dog. What is the answer? Let us think step by step.",
        "user assistant system You are a helpful assistant. Please reason and put the answer in \\boxed{}.",
    ]
    return texts


def build_tokenizer(digits: int, seed: int, vocab_size: int = 384, texts: list[str] | None = None, tools: bool = False):
    """A byte-level BPE tokenizer in Qwen2's shape, trained on the task's text: `texts` (its prompts and reference
    completions) or, without them, generated additions (another `vocab_size` merges another set of pieces: a
    tokenizer that gives other ids, as a teacher must not). With `tools`, the tool chat template, `<|im_end|>` as
    its end of sequence and TRL's Qwen response template, that parses its turns (`app.tiny_templates`)."""
    from tokenizers import Regex, Tokenizer, decoders, models, normalizers, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE())
    tok.normalizer = normalizers.NFC()
    tok.pre_tokenizer = pre_tokenizers.Sequence(
        [
            pre_tokenizers.Split(Regex(QWEN2_PATTERN), behavior="isolated", invert=False),
            pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
        ]
    )
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=SPECIAL_TOKENS,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(_tokenizer_corpus(random.Random(seed), digits, texts), trainer)
    chat = {"eos_token": EOS, "pad_token": EOS, "chat_template": CHAT_TEMPLATE}
    if tools:
        from trl.chat_template_utils import qwen3_template

        chat = {
            "eos_token": END_OF_TURN,
            "pad_token": END_OF_TURN,
            "chat_template": TOOL_CHAT_TEMPLATE,
            "response_template": qwen3_template,
        }
    return PreTrainedTokenizerFast(
        tokenizer_object=tok, model_max_length=4096, clean_up_tokenization_spaces=False, **chat
    )


def random_qwen2(*, vocab_size: int, eos_id: int = 0, seed: int = 0, **shape):
    """A Qwen2 with random weights, tied embeddings and `eos_id` as bos/eos/pad: the tiny model and test models alike.

    `shape` takes Qwen2Config's size fields (hidden_size, num_hidden_layers, max_position_embeddings, ...).
    """
    from transformers import Qwen2Config, Qwen2ForCausalLM

    config = Qwen2Config(
        vocab_size=vocab_size,
        tie_word_embeddings=True,
        bos_token_id=eos_id,
        eos_token_id=eos_id,
        pad_token_id=eos_id,
        use_sliding_window=False,
        dtype="float32",
        **shape,
    )
    torch.manual_seed(seed)
    return Qwen2ForCausalLM(config)


def build_model(tiny: TinyModelConfig, vocab_size: int, eos_id: int, max_len: int):
    return random_qwen2(
        vocab_size=vocab_size,
        eos_id=eos_id,
        seed=tiny.seed,
        hidden_size=tiny.hidden_size,
        intermediate_size=tiny.intermediate_size,
        num_hidden_layers=tiny.num_hidden_layers,
        num_attention_heads=tiny.num_attention_heads,
        num_key_value_heads=tiny.num_key_value_heads,
        max_position_embeddings=max_len,
    )


# Judges greedy completions of problems: (texts, problems, completion ids, truncated) -> one verdict per problem.
Judge = Callable[[list[str], list[Problem], list[list[int]], list[bool]], list[bool]]


def exactly_the_answer(texts: list[str], problems: list[Problem], completion_ids, truncated) -> list[bool]:
    return [t.strip() == p.answer for t, p in zip(texts, problems, strict=True)]


def rewarded(scorer) -> Judge:
    """A judge by the task's reward functions (`app.tasks.rewards.RewardScorer`), as evaluation judges a greedy
    sample: a positive summed reward, with the columns the rollout gives them."""

    def judge(texts, problems, completion_ids, truncated) -> list[bool]:
        columns = reward_columns(problems, truncated)
        scores = scorer.score(texts, [p.prompt for p in problems], completion_ids, columns)
        return [r > 0 for r in scores.rewards]

    return judge


@torch.no_grad()
def greedy_accuracy(
    model,
    tokenizer,
    problems: list[Problem],
    max_new_tokens: int,
    batch_size: int = 256,
    judge: Judge = exactly_the_answer,
) -> float:
    """Share of problems whose greedy completion `judge` accepts, by default exactly the answer (plain PyTorch, no
    vLLM)."""
    model.eval()
    tokenizer.padding_side = "left"
    eos = tokenizer.eos_token_id
    correct = 0
    for i in range(0, len(problems), batch_size):
        chunk = problems[i : i + batch_size]
        enc = tokenizer([p.prompt for p in chunk], return_tensors="pt", padding=True, add_special_tokens=False)
        out = model.generate(
            **enc,
            max_new_tokens=max_new_tokens,
            do_sample=False,
            pad_token_id=eos,
            eos_token_id=eos,
        )
        new = out[:, enc["input_ids"].shape[1] :]
        texts = tokenizer.batch_decode(new, skip_special_tokens=True)
        ids = [row[: row.index(eos) + 1] if eos in row else row for row in new.tolist()]  # as the fleet returns them
        correct += sum(judge(texts, chunk, ids, [eos not in row for row in ids]))
    model.train()
    return correct / len(problems)


def _encode(tokenizer, text: str) -> list[int]:
    return tokenizer(text, add_special_tokens=False)["input_ids"]


def reference_example(tokenizer, problem: Problem) -> tuple[list[int], list[int]]:
    """One supervised single-turn example (token ids, loss mask): the prompt and its reference completion closed by
    EOS, each tokenised on its own as the rollout tokenises a prompt and the fleet samples after it; loss on the
    completion."""
    p_ids = _encode(tokenizer, problem.prompt)
    c_ids = _encode(tokenizer, problem.reference) + [tokenizer.eos_token_id]
    return p_ids + c_ids, [0] * len(p_ids) + [1] * len(c_ids)


def fresh_addition(rng: random.Random, limit: int, avoid: set[str], render=None) -> Problem | None:
    """A fresh addition (its prompt as `render` lays it out, if given), or None when it is held out."""
    a, b = rng.randrange(limit), rng.randrange(limit)
    prompt = arithmetic_prompt(a, b) if render is None else render(arithmetic_prompt(a, b))
    return None if prompt in avoid else Problem("", prompt, str(a + b))


def addition_example(
    tokenizer, rng: random.Random, limit: int, avoid: set[str], render=None
) -> tuple[list[int], list[int]] | None:
    """One supervised single-turn example of a fresh addition (token ids, loss mask), or None when it is held out."""
    problem = fresh_addition(rng, limit, avoid, render)
    return None if problem is None else reference_example(tokenizer, problem)


def chat_rendered(tokenizer):
    """A prompt as the chat template lays it out as one user message with the assistant's turn opened: the text whose
    tokens are exactly the ids of `apply_chat_template` (checked), so that a warm-up on it sees the prompt that a
    client rendering chat messages (verifiers' `renderers`) sends."""

    def render(prompt: str) -> str:
        messages = [{"role": "user", "content": prompt}]
        text = tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
        if _encode(tokenizer, text) != prompt_token_ids(tokenizer, messages):
            raise ValueError("the chat template's text does not tokenize to its own ids")
        return text

    return render


def episode_example(tokenizer, problem: Problem) -> tuple[list[int], list[int]]:
    """A correctly played chained episode laid out exactly as the rollout lays one out (each turn's answer
    tokenised on its own and closed by EOS, each observation tokenised once), loss on the model's turns."""
    from app.tasks.environments import ChainedArithmetic

    env = ChainedArithmetic()
    env.reset(problem)
    ids = _encode(tokenizer, problem.prompt)
    mask = [0] * len(ids)
    while True:
        turn = _encode(tokenizer, str(env.total)) + [tokenizer.eos_token_id]
        ids += turn
        mask += [1] * len(turn)
        step = env.step(str(env.total), turn)
        if step.done:
            return ids, mask
        obs = _encode(tokenizer, step.observation)
        ids += obs
        mask += [0] * len(obs)


@torch.no_grad()
def greedy_episode_accuracy(model, tokenizer, problems: list[Problem], max_new_tokens: int) -> float:
    """Share of chained episodes played right to the end greedily (plain PyTorch, the rollout's token layout)."""
    from app.tasks.environments import ChainedArithmetic
    from app.tiny_tools import greedy_continuations

    model.eval()
    eos = tokenizer.eos_token_id
    envs = []
    for p in problems:
        env = ChainedArithmetic()
        env.reset(p)
        envs.append(env)
    seqs = [_encode(tokenizer, p.prompt) for p in problems]
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
                seqs[i] = seqs[i] + turn + _encode(tokenizer, step.observation)
                still.append(i)
        active = still
    model.train()
    return solved / len(problems)


@dataclass
class WarmUpPlan:
    """What a warm-up trains on and how it judges the model, by kind of task (`warmup_plan`)."""

    example: Callable[[random.Random], tuple[list[int], list[int]] | None]  # (ids, loss mask), None: held out
    accuracy: Callable[[object], float]  # the model's greedy held-out accuracy


def warmup_plan(
    tokenizer,
    tiny: TinyModelConfig,
    task: TaskConfig,
    heldout: list[Problem],
    pool: list[Problem],
    judge: Judge,
    render=None,
) -> WarmUpPlan:
    """Chains: correctly played episodes of a train split of the warm-up's own seed, judged whole. A task with
    reference answers (`pool`, drawn from its generators, none held out): its problems and reference completions,
    judged by `judge`. Else arithmetic: fresh additions, the held-out ones skipped, judged by the exact answer."""
    if task.name == "chained_arithmetic":  # a train split of its own seed: held-out chains excluded by (a, b, chain)
        from app.tasks.problems import make_chained_arithmetic

        held = {p.id.removeprefix("heldout-") for p in heldout}
        chains = make_chained_arithmetic(
            task.digits, 20000, 1, tiny.seed + 7, (task.chain_min, task.chain_max), task.chain_operand_max
        ).train
        chains = [p for p in chains if p.id.removeprefix("train-") not in held]
        return WarmUpPlan(
            lambda rng: episode_example(tokenizer, rng.choice(chains)),
            lambda model: greedy_episode_accuracy(model, tokenizer, heldout, max_new_tokens=task.digits + 3),
        )
    if pool:
        longest = max(len(_encode(tokenizer, p.reference)) for p in heldout)
        return WarmUpPlan(
            lambda rng: reference_example(tokenizer, rng.choice(pool)),
            lambda model: greedy_accuracy(model, tokenizer, heldout, max_new_tokens=longest + 1, judge=judge),
        )
    limit, avoid = 10**task.digits, {p.prompt for p in heldout}
    return WarmUpPlan(
        lambda rng: addition_example(tokenizer, rng, limit, avoid, render),
        lambda model: greedy_accuracy(model, tokenizer, heldout, max_new_tokens=task.digits + 2),
    )


def context_plan(
    tokenizer, template: str, task: TaskConfig, heldout: list[Problem], pool: list[Problem], judge: Judge
) -> WarmUpPlan:
    """The warm-up's second part for a self teacher (`tiny.warmup_context`): the same problems, each shown under the
    teacher's template with its answer, judged on the held-out problems shown so. A pretrained model reads an answer
    given in its context (what SDFT's teacher relies on); a model this small learns to here."""
    if task.name == "chained_arithmetic":
        raise ConfigError("model.tiny.warmup_context: the warm-up shows a context to single-turn tasks only")
    shown = [privileged_problem(template, p) for p in heldout]
    longest = max(len(_encode(tokenizer, p.reference)) for p in heldout)
    limit, avoid = 10**task.digits, {p.prompt for p in heldout}

    def example(rng: random.Random) -> tuple[list[int], list[int]] | None:
        problem = rng.choice(pool) if pool else fresh_addition(rng, limit, avoid)
        return None if problem is None else reference_example(tokenizer, privileged_problem(template, problem))

    return WarmUpPlan(example, lambda model: greedy_accuracy(model, tokenizer, shown, longest + 1, judge=judge))


def warm_up(
    model, tokenizer, tiny: TinyModelConfig, plan: WarmUpPlan, log=print, target: float | None = None, part: int = 1
) -> tuple[float, int]:
    """Supervised steps on the plan's examples until the model's held-out greedy accuracy, as the plan judges it,
    crosses the target (`tiny.warmup_target_accuracy` unless given); `part` seeds its data apart from other parts."""
    target = tiny.warmup_target_accuracy if target is None else target
    rng = random.Random(tiny.seed + part)
    opt = torch.optim.AdamW(model.parameters(), lr=tiny.warmup_lr)
    eos = tokenizer.eos_token_id
    acc, step = 0.0, 0
    for step in range(1, tiny.warmup_max_steps + 1):
        rows, masks = [], []
        while len(rows) < tiny.warmup_batch_size:
            example = plan.example(rng)
            if example is not None:
                rows.append(example[0])
                masks.append(example[1])
        width = max(map(len, rows))
        ids = torch.tensor([r + [eos] * (width - len(r)) for r in rows])
        loss_mask = torch.tensor([m + [0] * (width - len(m)) for m in masks], dtype=torch.float32)
        attn = torch.tensor([[1] * len(r) + [0] * (width - len(r)) for r in rows])
        logits = model(input_ids=ids, attention_mask=attn).logits[:, :-1]
        nll = torch.nn.functional.cross_entropy(logits.transpose(1, 2), ids[:, 1:], reduction="none")
        loss = (nll * loss_mask[:, 1:]).sum() / loss_mask[:, 1:].sum()
        opt.zero_grad()
        loss.backward()
        opt.step()
        if step % 5 == 0:
            acc = plan.accuracy(model)
            log(
                f"warm-up{'' if part == 1 else f' part {part}'} step {step}: loss {loss.item():.3f} held-out accuracy {acc:.3f}"
            )
            if acc >= target:
                break
    if acc < target:  # the run would start from a weaker model than asked for, and nothing else would say so
        log(
            f"warm-up{'' if part == 1 else f' part {part}'} ended below its target: held-out accuracy {acc:.3f} < "
            f"{target:.3f} after model.tiny.warmup_max_steps={tiny.warmup_max_steps} steps"
        )
    return acc, step


def check_context(tokenizer, model_cfg: ModelConfig, problems: list[Problem]) -> None:
    """ConfigError naming `model.max_model_len` when a problem and its reference completion do not fit the context
    the fleet serves: a prompt too long for it would fail every request that holds it, mid-run."""
    longest = max(len(reference_example(tokenizer, p)[0]) for p in problems)
    if longest > model_cfg.max_model_len:
        raise ConfigError(
            f"model.max_model_len={model_cfg.max_model_len}: the task's longest problem takes {longest} tokens with "
            "its reference answer"
        )


def _task_data(task_cfg: TaskConfig, tiny: TinyModelConfig) -> tuple[list[Problem], list[Problem], list[Problem]]:
    """(held-out split that evaluation uses and the warm-up must never see, train split, warm-up pool of a task with
    reference answers: reasoning-gym's own problems under the warm-up's seed, held-out ones left out)."""
    from app.tasks.problems import SEED_BLOCK, WARMUP_BLOCK, draw_reasoning_gym, load_task

    splits = (
        load_task(task_cfg)
        if task_cfg.name in ("chained_arithmetic", "reasoning_gym")
        else make_arithmetic(task_cfg.digits, 1, task_cfg.num_heldout, task_cfg.seed)
    )
    pool = []
    if task_cfg.name == "reasoning_gym":
        avoid = frozenset(p.prompt for p in splits.heldout)
        pool = draw_reasoning_gym(task_cfg, tiny.seed + WARMUP_BLOCK * SEED_BLOCK, WARMUP_POOL, "warmup", avoid)
    return splits.heldout, splits.train, pool


def tool_plan(tiny: TinyModelConfig, task: TaskConfig, heldout: list[Problem]) -> tuple[object, WarmUpPlan]:
    """The tokenizer and warm-up of a tiny model that calls tools (`tiny.warmup_tools`): the tool chat template, its
    pieces learned from demonstrated episodes (played first under a draft tokenizer of the same template), examples
    from a pool of fresh additions' demonstrations, judged by greedy episodes of the held-out problems
    (`app.tiny_tools`)."""
    from app.tiny_tools import ToolPlay

    if task.name != "arithmetic":
        raise ConfigError("model.tiny.warmup_tools: the tool warm-up demonstrates additions (task.name: arithmetic)")
    rng, limit, avoid = random.Random(tiny.seed + 11), 10**task.digits, {p.prompt for p in heldout}
    problems = [p for p in (fresh_addition(rng, limit, avoid) for _ in range(TOOL_POOL)) if p is not None]
    draft = build_tokenizer(task.digits, tiny.seed, tools=True)
    demonstrated = ToolPlay(draft, tiny.warmup_tools, task, DRAFT_EPISODE_TOKENS).demonstrations(
        problems[: CORPUS_PROBLEMS // 4]
    )
    texts = [draft.decode(ids) for ids, _ in demonstrated]
    tokenizer = build_tokenizer(task.digits, tiny.seed, texts=texts, tools=True)
    play = ToolPlay(tokenizer, tiny.warmup_tools, task, tiny.max_position_embeddings)
    pool = play.demonstrations(problems)
    return tokenizer, WarmUpPlan(lambda rng: rng.choice(pool), lambda model: play.greedy_accuracy(model, heldout))


def _warmed_up(model_cfg: ModelConfig, task_cfg: TaskConfig, log) -> tuple[object, object, dict]:
    """A tiny model built from scratch and warmed up on the task: (model, tokenizer, what the build measured)."""
    tiny = model_cfg.tiny
    heldout, train, pool = _task_data(task_cfg, tiny)
    if tiny.warmup_tools is not None:
        tokenizer, plan = tool_plan(tiny, task_cfg, heldout)
        model = build_model(tiny, len(tokenizer), tokenizer.eos_token_id, tiny.max_position_embeddings)
        acc, steps = warm_up(model, tokenizer, tiny, plan, log=log)
        return model, tokenizer, {"heldout_accuracy": acc, "warmup_steps": steps}
    corpus = [p.prompt + p.reference for p in pool[:CORPUS_PROBLEMS]] if pool else None
    tokenizer = build_tokenizer(task_cfg.digits, tiny.seed, texts=corpus)
    if pool:
        check_context(tokenizer, model_cfg, heldout + train + pool)
    model = build_model(tiny, len(tokenizer), tokenizer.eos_token_id, tiny.max_position_embeddings)
    render = None
    if tiny.warmup_chat:  # additions under the chat template, held out ones too (`chat_rendered`)
        if pool or task_cfg.name != "arithmetic":
            raise ValueError("model.tiny.warmup_chat: the chat warm-up is arithmetic's (task.name: arithmetic)")
        render = chat_rendered(tokenizer)
        heldout = [Problem(p.id, render(p.prompt), p.answer) for p in heldout]
    # A task with reference answers is judged by its reward functions, as evaluation judges it.
    scorer = RewardScorer.from_names(task_cfg.reward_funcs, task_cfg.reward_timeout_s) if pool else None
    try:
        judge = rewarded(scorer) if scorer else exactly_the_answer
        plan = warmup_plan(tokenizer, tiny, task_cfg, heldout, pool, judge, render)
        acc, steps = warm_up(model, tokenizer, tiny, plan, log=log)
    finally:
        if scorer is not None:
            scorer.close()
    return model, tokenizer, {"heldout_accuracy": acc, "warmup_steps": steps}


def _taught_context(model_cfg: ModelConfig, task_cfg: TaskConfig, log) -> tuple[object, object, dict]:
    """A tiny model that reads a self teacher's context (`tiny.warmup_context`): the same config's model without it
    (built first if it is not cached: the embedded default, for the default's config), then warmed up on the
    problems shown under the template with their answer, until held-out accuracy shown so reaches
    `tiny.warmup_context_accuracy`; (model, tokenizer, what the build measured, the student's own accuracy after)."""
    from transformers import Qwen2ForCausalLM

    tiny = model_cfg.tiny
    plain_cfg = model_cfg.model_copy(update={"tiny": tiny.model_copy(update={"warmup_context": None})})
    plain, plain_info = ensure_tiny_model(plain_cfg, task_cfg, log=log)
    tokenizer = load_tokenizer(plain)
    model = Qwen2ForCausalLM.from_pretrained(plain, dtype=torch.float32)
    model.train()
    heldout, _, pool = _task_data(task_cfg, tiny)
    scorer = RewardScorer.from_names(task_cfg.reward_funcs, task_cfg.reward_timeout_s) if pool else None
    try:
        judge = rewarded(scorer) if scorer else exactly_the_answer
        shown = context_plan(tokenizer, tiny.warmup_context, task_cfg, heldout, pool, judge)
        shown_acc, steps = warm_up(model, tokenizer, tiny, shown, log=log, target=tiny.warmup_context_accuracy, part=2)
        acc = warmup_plan(tokenizer, tiny, task_cfg, heldout, pool, judge).accuracy(model)  # shown no answer
    finally:
        if scorer is not None:
            scorer.close()
    log(f"held-out accuracy {acc:.3f}; shown the answer in context {shown_acc:.3f}")
    return (
        model,
        tokenizer,
        {
            "heldout_accuracy": acc,
            "context_heldout_accuracy": shown_acc,
            "context_warmup_steps": steps,
            "warmed_from": {"folder": plain.name, "heldout_accuracy": plain_info["heldout_accuracy"]},
            "warmup_steps": plain_info["warmup_steps"],
        },
    )


def ensure_tiny_model(model_cfg: ModelConfig, task_cfg: TaskConfig, log=print) -> tuple[Path, dict]:
    """Build the tiny model folder once per config (atomically, so concurrent callers are safe); reuse after."""
    tiny = model_cfg.tiny
    folder = tiny_model_folder(model_cfg, task_cfg)
    root = folder.parent
    info_file = folder / "spotrl_tiny.json"
    if info_file.exists():
        return folder, {**json.loads(info_file.read_text()), "cached": True}

    t0 = time.time()
    build = _taught_context if tiny.warmup_context is not None else _warmed_up
    model, tokenizer, measured = build(model_cfg, task_cfg, log)
    info = {
        **measured,
        "build_s": round(time.time() - t0, 1),
        "num_parameters": sum(p.numel() for p in model.parameters()),
        "config": tiny.model_dump(),
    }

    root.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=folder.name + ".", dir=root))
    model.save_pretrained(tmp)
    tokenizer.save_pretrained(tmp)
    (tmp / "spotrl_tiny.json").write_text(json.dumps(info, indent=1))

    load_tokenizer(tmp)  # the saved folder, as every other process will load it, must round-trip
    try:
        tmp.rename(folder)
    except OSError:  # another process finished first: theirs is as good as ours
        shutil.rmtree(tmp, ignore_errors=True)
        return folder, {**json.loads(info_file.read_text()), "cached": True}
    return folder, {**info, "cached": False}


def prepare_model(model_cfg: ModelConfig, task_cfg: TaskConfig, log=print) -> str:
    """The model folder (or hub name) the run or the fleet loads, the tiny model built first when it is the one: what
    every entry point calls before anything loads the model (`core.models.resolve_model_path` only names it)."""
    if model_cfg.name_or_path == "tiny":
        ensure_tiny_model(model_cfg, task_cfg, log=log)
    return resolve_model_path(model_cfg, task_cfg)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    add_config_args(parser)
    cfg = config_from_args(parser.parse_args(argv))
    torch.set_num_threads(max(1, os.cpu_count() or 1))
    path, info = ensure_tiny_model(cfg.model, cfg.task, log=lambda m: print(m, file=sys.stderr))
    print(json.dumps({"path": str(path), **{k: v for k, v in info.items() if k != "config"}}))


if __name__ == "__main__":
    main()
