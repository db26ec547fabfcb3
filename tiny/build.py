"""The embedded default model: a tiny Qwen2 built here, with nothing downloaded, and named by its folder.

GRPO needs a base that is sometimes right and sometimes wrong, so groups have mixed rewards. We build a ~0.5M-parameter
Qwen2 (random init, `tiny.network`) with a byte-level BPE tokenizer in Qwen2's own shape (`tiny.tokenizer`), and warm
it up on the task's own problems (`tiny.warmup`) as the task's recipe says (`tiny.recipes`), or as a variant that
`model.tiny` switches on says (`tiny.variants`: a self teacher's context, tool episodes, chat-rendered prompts). The
folder is cached under a key of its config (`tiny.folder`), so it is built once; it is what names the built model.

The entry points build it before anything loads it (`prepare_model`, `prepare_run`); a fleet's config names no task:
"tiny" there is the embedded default's model (`EMBEDDED_TASK`), and another task's is named by its folder.

    python -m tiny [--config FILE] [--set model.tiny.seed=1]      (make tiny-model: prints the folder)
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import sys
import tempfile
import time
from pathlib import Path

import torch

from core.config import ModelConfig, RunConfig, TaskConfig, add_config_args, config_errors_exit, config_from_args
from core.models import load_tokenizer
from tiny.folder import tiny_model_folder
from tiny.network import build_model
from tiny.recipe import Built
from tiny.recipes import recipe_for
from tiny.variants import VARIANTS
from tiny.warmup import warm_up

# The task of the embedded default (configs/tiny-cpu.yaml's): the one a fleet's "tiny" is warmed up on.
EMBEDDED_TASK = TaskConfig()


def _warmed_up(model_cfg: ModelConfig, task_cfg: TaskConfig, log) -> Built:
    """A tiny model built from scratch and warmed up on the task, as its recipe says."""
    tiny = model_cfg.tiny
    recipe = recipe_for(task_cfg)
    data = recipe.data(task_cfg, tiny)
    tokenizer = recipe.tokenizer(model_cfg, task_cfg, data)
    model = build_model(tiny, len(tokenizer), tokenizer.eos_token_id, tiny.max_position_embeddings)
    render = None
    if tiny.warmup_chat:  # additions under the chat template, held out ones too
        data, render = recipe.chat(tokenizer, data)
    with recipe.judge(task_cfg) as judge:
        plan = recipe.plan(tokenizer, tiny, task_cfg, data, judge, render)
        acc, steps = warm_up(model, tokenizer, tiny, plan, log=log)
    return model, tokenizer, {"heldout_accuracy": acc, "warmup_steps": steps}


def ensure_tiny_model(model_cfg: ModelConfig, task_cfg: TaskConfig, log=print) -> tuple[Path, dict]:
    """Build the tiny model folder once per config (atomically, so concurrent callers are safe); reuse after."""
    tiny = model_cfg.tiny
    folder = tiny_model_folder(model_cfg, task_cfg)
    root = folder.parent
    info_file = folder / "spotrl_tiny.json"
    if info_file.exists():
        return folder, {**json.loads(info_file.read_text()), "cached": True}

    t0 = time.time()
    variant = next((v for v in VARIANTS if v.build is not None and v.on(tiny)), None)
    if variant is not None:
        model, tokenizer, measured = variant.build(model_cfg, task_cfg, log, ensure_tiny_model)
    else:
        model, tokenizer, measured = _warmed_up(model_cfg, task_cfg, log)
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


def prepare_model(model_cfg: ModelConfig, task_cfg: TaskConfig = EMBEDDED_TASK, log=print) -> str:
    """The model folder (or hub name) the run or the fleet loads, the tiny model built first when it is the one (warmed
    up on `task_cfg`: a run's task, or for a fleet, which names none, the embedded default's)."""
    if model_cfg.name_or_path == "tiny":
        return str(ensure_tiny_model(model_cfg, task_cfg, log=log)[0])
    return model_cfg.name_or_path


def name_built(model_cfg: ModelConfig, task_cfg: TaskConfig = EMBEDDED_TASK, log=print) -> str:
    """`prepare_model`, and `model_cfg` made to name what it built (a tiny model's folder): a teacher deployment's
    model, which the fleet loads as its config names it."""
    model_cfg.name_or_path = prepare_model(model_cfg, task_cfg, log=log)
    return model_cfg.name_or_path


def prepare_run(cfg: RunConfig, log=print) -> str:
    """A run's model folder (or hub name), built first where it is the tiny model; a `model` teacher's built too and
    named by its folder in `cfg`, which its own fleet's teacher deployment loads."""
    model_path = prepare_model(cfg.model, cfg.task, log=log)
    if (model_teacher := cfg.teacher_of("model")) is not None:
        name_built(model_teacher.model, cfg.task, log=log)
    return model_path


def main(argv: list[str] | None = None) -> None:
    """Build (or find) the config's tiny model: what the build measured on stderr, its folder on stdout."""
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    add_config_args(parser)
    cfg = config_from_args(parser.parse_args(argv))
    torch.set_num_threads(max(1, os.cpu_count() or 1))
    with config_errors_exit():  # the build's own checks (a demo's budget against the context) are config errors too
        path, info = ensure_tiny_model(cfg.model, cfg.task, log=lambda m: print(m, file=sys.stderr))
    print(json.dumps({k: v for k, v in info.items() if k != "config"}), file=sys.stderr)
    print(path)
