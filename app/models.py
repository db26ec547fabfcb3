"""Where the model and its tokenizer come from, for the learner, the rollout, evaluation and the fleet alike.

One place resolves the model path (a local folder, a hub name, or the embedded tiny model built
on demand) and loads the tokenizer with the round-trip check, so every part sees the same tokens.
"""

from __future__ import annotations

import re
from pathlib import Path

from app.config import ModelConfig, TaskConfig

_COMMIT = re.compile(r"[0-9a-f]{40}")


def resolve_model_path(model_cfg: ModelConfig, task_cfg: TaskConfig, log=print) -> str:
    """The local folder (or hub name) that the learner and the fleet load."""
    if model_cfg.name_or_path == "tiny":
        from app.tiny_model import ensure_tiny_model

        return str(ensure_tiny_model(model_cfg, task_cfg, log=log)[0])
    return model_cfg.name_or_path


def is_local(model_path: str) -> bool:
    """A model folder on this disk (the tiny model, or a downloaded one): nothing to fetch from a hub."""
    return Path(model_path).expanduser().is_dir()


def pin_revision(model_cfg: ModelConfig, model_path: str, log=print) -> None:
    """Fix `model.revision` to a commit of a hub model before anything loads it.

    A branch such as "main" moves: a learner and a replica (or a replica restarted a day later on a new
    spot node) would load different weights. Resolved once by the driver, the commit travels in the
    config to every process; a local folder has no revision.
    """
    if is_local(model_path) or (model_cfg.revision and _COMMIT.fullmatch(model_cfg.revision)):
        return
    from huggingface_hub import HfApi

    branch = model_cfg.revision or "main"
    model_cfg.revision = HfApi().model_info(model_path, revision=branch).sha
    log(f"model {model_path}: {branch} pinned to revision {model_cfg.revision}")


def load_tokenizer(path: str | Path):
    """Load a model folder's tokenizer and check that token ids round-trip through text.

    A tokenizer that silently changes text (dropping spaces, say) makes the sampler and the
    learner see different prompts, and learning collapses without an error; fail loudly instead.
    """
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(str(path))
    probe = "Compute 12+345. Answer: 357 and some words, with  two spaces."
    ids = tokenizer(probe, add_special_tokens=False)["input_ids"]
    text = tokenizer.decode(ids, skip_special_tokens=False)
    if text != probe or tokenizer(text, add_special_tokens=False)["input_ids"] != ids:
        raise RuntimeError(f"tokenizer at {path} does not round-trip text ({probe!r} -> {text!r})")
    return tokenizer


def prompt_token_ids(tokenizer, prompt) -> list[int]:
    """Token ids of a prompt: plain text as is, chat messages through the model's template."""
    if isinstance(prompt, str):
        return tokenizer(prompt, add_special_tokens=False)["input_ids"]
    return list(tokenizer.apply_chat_template(prompt, add_generation_prompt=True, tokenize=True))
