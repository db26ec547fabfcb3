"""Where the model and its tokenizer come from, for the learner, the rollout, evaluation and the fleet alike.

One place resolves the model path (a local folder or a hub name; the embedded tiny model is named by the folder the
entry points build first, `tiny.build.prepare_model`) and loads the tokenizer with the round-trip check, so every
part sees the same tokens;
fingerprints the model, so a run can tell that a fleet it joins serves the same base model; and
compares two tokenizers by the ids they give, so a teacher that would score other tokens is refused.
"""

from __future__ import annotations

import hashlib
import json
import logging
import re
from collections.abc import Callable, Iterable
from pathlib import Path

from core.config import ConfigError, ModelConfig

_COMMIT = re.compile(r"[0-9a-f]{40}")
logger = logging.getLogger("spotrl.models")


def resolve_model_path(model_cfg: ModelConfig) -> str:
    """The local folder (or hub name) that the learner and the fleet load, as the config names it. The tiny model is
    named by its built folder: "tiny" is the entry points' to build and name (`tiny.build`), never resolved here."""
    if model_cfg.name_or_path == "tiny":
        raise ConfigError(
            "model.name_or_path: tiny is built by the entry point, which names its folder (`make tiny-model` prints it)"
        )
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


# What makes two model folders the same base model to a run: the architecture, the tokens and the weights.
_TOKENIZER_FILES = ("tokenizer.json", "tokenizer.model", "vocab.json", "merges.txt", "tokenizer_config.json")
_WEIGHT_SUFFIXES = (".safetensors", ".bin", ".pt")
_VOLATILE_CONFIG_KEYS = {"_name_or_path", "transformers_version"}  # change with who saved it, not what it is
_SAMPLED_BYTES = 2**20


def model_fingerprint(model_path: str, revision: str | None = None) -> str:
    """Which base model `model_path` is, comparable across machines: "hub:NAME@REVISION" for a hub
    name, "files:SHA256" for a local folder, whatever its path.

    A run that trains adapters for one base model while a fleet samples from another learns from
    samples it did not produce, and a LoRA of the same shapes loads without an error. The folder's
    hash covers its config (less who saved it), its tokenizer files and each weight file's name, size
    and first and last MiB: a fine-tune of the same architecture differs there, and a model of tens of
    GB is fingerprinted in milliseconds."""
    folder = Path(model_path).expanduser()
    if not folder.is_dir():
        return f"hub:{model_path}@{revision or 'main'}"
    digest = hashlib.sha256()
    config = folder / "config.json"
    if config.is_file():
        fields = {k: v for k, v in json.loads(config.read_text()).items() if k not in _VOLATILE_CONFIG_KEYS}
        digest.update(json.dumps(fields, sort_keys=True).encode())
    for name in _TOKENIZER_FILES:
        if (folder / name).is_file():
            digest.update(name.encode() + b"\0" + (folder / name).read_bytes())
    for weights in sorted(f for f in folder.iterdir() if f.is_file() and f.name.endswith(_WEIGHT_SUFFIXES)):
        size = weights.stat().st_size
        with weights.open("rb") as f:
            head = f.read(_SAMPLED_BYTES)
            f.seek(max(size - _SAMPLED_BYTES, 0))
            tail = f.read(_SAMPLED_BYTES)
        digest.update(f"{weights.name}\0{size}\0".encode() + head + tail)
    return f"files:{digest.hexdigest()}"


def check_same_base_model(fleet_fingerprint: str | None, model_path: str, revision: str | None, where: str) -> None:
    """SystemExit when the fleet at `where` serves another base model than this run's `model.name_or_path`.

    A fleet that names its model one way (a hub name) and the run another (a local folder) cannot be
    compared without downloading: that is logged, not refused."""
    if not fleet_fingerprint:
        raise SystemExit(f"the fleet at {where} does not say which base model it serves (an older spotrl?)")
    ours = model_fingerprint(model_path, revision)
    if fleet_fingerprint == ours:
        return
    if fleet_fingerprint.split(":", 1)[0] != ours.split(":", 1)[0]:
        logger.warning(
            "cannot check that the fleet at %s serves this run's base model (%s there, %s here)",
            where,
            fleet_fingerprint,
            ours,
        )
        return
    raise SystemExit(
        f"model.name_or_path: the fleet at {where} serves another base model ({fleet_fingerprint}) than "
        f"{model_path} ({ours}); a run trains adapters of the fleet's base model, so use the same one"
    )


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


def completion_text(tokenizer, token_ids: list[int]) -> str:
    """The text of generated token ids, decoded as the fleet decodes them (special tokens skipped)."""
    return tokenizer.decode(token_ids, skip_special_tokens=True)


def prompt_token_ids(tokenizer, prompt) -> list[int]:
    """Token ids of a prompt: plain text as is, chat messages through the model's template."""
    if isinstance(prompt, str):
        return tokenizer(prompt, add_special_tokens=False)["input_ids"]
    # return_dict=False: transformers 5 answers a BatchEncoding by default, whose list() is its keys, not the ids.
    return list(tokenizer.apply_chat_template(prompt, add_generation_prompt=True, tokenize=True, return_dict=False))


# Texts two tokenizers must split into the same ids to be one (a teacher's and its student's): digits, words,
# spaces, punctuation, non-ASCII text and the special tokens of chat templates.
TOKEN_PROBES = (
    "Q: 12+345=? A: 357",
    "0123456789 9876543210 1000000 3.14159 -42",
    "The quick brown fox jumps over the lazy dog. What is the answer? Let us think step by step.",
    "  two  spaces,\ttabs\nand newlines\n\n",
    "\\boxed{\\frac{1}{2}} (x^2 + y_1) * [a, b] {c: d} #$%&@!~`|<>",
    "naïve café über straße 東京 🙂",
    "<|endoftext|><|im_start|>user\nhello<|im_end|>\n<|im_start|>assistant\n",
)


def check_same_token_ids(
    student, teacher_ids: Callable[[str], list[int]], where: str, texts: Iterable[str] = ()
) -> None:
    """ConfigError unless `teacher_ids` (a teacher's tokenizer, or a server's `/tokenize`) gives the student
    tokenizer's ids for every probe text and `texts`: the ids are compared, never the tokenizers' names. A teacher of
    another tokenizer would score other tokens than the student sampled, and distillation would learn noise."""
    for text in (*TOKEN_PROBES, *texts):
        ours = student(text, add_special_tokens=False)["input_ids"]
        theirs = list(teacher_ids(text))
        if theirs != ours:
            raise ConfigError(
                f"{where}: its tokenizer is not the student's: {text[:40]!r} is {theirs[:12]} there, {ours[:12]} "
                "here; a teacher must give the student's token ids"
            )


def check_same_tokenizer(student, teacher_path: str, where: str) -> None:
    """`check_same_token_ids` for a teacher model folder, whose whole vocabulary is compared too."""
    teacher = load_tokenizer(teacher_path)
    if teacher.get_vocab() != student.get_vocab():
        raise ConfigError(f"{where}: the vocabulary of {teacher_path} is not the student's (token ids differ)")
    check_same_token_ids(student, lambda text: teacher(text, add_special_tokens=False)["input_ids"], where)
