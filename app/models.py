"""Where the model and its tokenizer come from, for the learner, the rollout, evaluation and the fleet alike.

One place resolves the model path (a local folder, a hub name, or the embedded tiny model built
on demand) and loads the tokenizer with the round-trip check, so every part sees the same tokens.
"""

from __future__ import annotations

from pathlib import Path

from app.config import ModelConfig, TaskConfig


def resolve_model_path(model_cfg: ModelConfig, task_cfg: TaskConfig, log=print) -> str:
    """The local folder (or hub name) that the learner and the fleet load."""
    if model_cfg.name_or_path == "tiny":
        from app.tiny_model import ensure_tiny_model

        return str(ensure_tiny_model(model_cfg, task_cfg, log=log)[0])
    return model_cfg.name_or_path


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
