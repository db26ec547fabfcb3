"""Where a run's metrics go (`logging.report_to`): the trackers a run may name, checked at start.

tensorboard and wandb come with the `trackers` extra (`make setup` installs it): a run that names one the machine
lacks stops at its config, naming the extra, rather than at its first step after the fleet's start.
"""

from __future__ import annotations

import importlib.util
import sys
from typing import Any, Literal

Tracker = Literal["jsonl", "trackio", "ray", "tensorboard", "wandb"]
DEFAULT_TRACKERS: list[Tracker] = ["jsonl", "trackio", "ray"]
EXTRA = ("tensorboard", "wandb")  # each the module of its own name, from the `trackers` extra
_warned = False


def check_trackers(trackers: list[str]) -> list[str]:
    """`trackers` once each; ValueError without metrics.jsonl or with a tracker that is not installed."""
    if "jsonl" not in trackers:
        raise ValueError("jsonl is always written: a resumed run reads its steps back from metrics.jsonl")
    missing = [name for name in EXTRA if name in trackers and importlib.util.find_spec(name) is None]
    if missing:
        raise ValueError(
            f"{' and '.join(missing)} not installed: pip install -e '.[trackers]' (the trackers extra; make setup "
            "installs it)"
        )
    return list(dict.fromkeys(trackers))


def move_trackio_switch(section: Any) -> Any:
    """The logging section as read, its old `trackio: false` (read for one more release) moved to `report_to`."""
    global _warned
    if not isinstance(section, dict) or "trackio" not in section:
        return section
    section = dict(section)
    others = [t for t in section.get("report_to", DEFAULT_TRACKERS) if t != "trackio"]
    section["report_to"] = others + ["trackio"] if section.pop("trackio") else others
    if not _warned:
        _warned = True
        print(
            "deprecated: logging.trackio is now logging.report_to (trackio is read for one more release)",
            file=sys.stderr,
        )
    return section
