"""Where a tiny model is built: a folder under `model.cache_dir` named by a key of everything the build depends on, so
that it is built once and a changed recipe or config never reuses a stale one.

The key is the build's version, the shape and warm-up (`model.tiny`, less the variants' fields), the held-out split it
avoids (`task.digits`, `seed`, `num_heldout`), then each variant's part when it is on and the task's recipe's part:
nothing else. A model without a variant, of a task whose recipe adds nothing, keeps the key it always had.
"""

from __future__ import annotations

import hashlib
import json
from pathlib import Path

from core.config import ModelConfig, TaskConfig
from tiny.recipes import recipe_for
from tiny.variants import VARIANTS

TINY_BUILD_VERSION = 1  # bump when the tiny model's build recipe changes, so stale caches go unused


def tiny_model_folder(model_cfg: ModelConfig, task_cfg: TaskConfig) -> Path:
    """The folder of the tiny model of these configs (see the module's docstring)."""
    tiny = model_cfg.tiny
    spec = {
        "v": TINY_BUILD_VERSION,
        "tiny": tiny.model_dump(exclude={name for v in VARIANTS for name in v.fields}),
        "task": [task_cfg.digits, task_cfg.seed, task_cfg.num_heldout],
        **{v.name: v.key(tiny) for v in VARIANTS if v.on(tiny)},
        **recipe_for(task_cfg).key(task_cfg),
    }
    key = hashlib.sha256(json.dumps(spec, sort_keys=True).encode()).hexdigest()[:16]
    return Path(model_cfg.cache_dir).expanduser() / f"tiny-qwen2-{key}"
