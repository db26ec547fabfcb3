"""What a kind of environment is at run time: one `EnvKind` per kind, the registry picks the run's
(`app.kinds.registry`).

A kind answers, for a run's config: where its problems come from (`problems`: the task's splits unless the kind
brings its own), whether the config can run (`check`, at start, before Ray or the fleet: one ConfigError naming the
field; `check_budget` once the model's tokenizer exists), what the run must hold up for it (`serve`, entered in the
driver's ExitStack) and what plays its groups (`sampler`). Its config is the field of `EnvConfig` named `field`.
A kind whose sampler asks the run's judges for its samples (`app.rollout.judges`) says so (`unjudged` None); a run
that names a judge with any other kind is refused at start, with the kind's reason.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Callable
from contextlib import ExitStack
from dataclasses import dataclass

from app.rollout.sampling import Sampler
from app.tasks.problems import Problem, TaskSplits, load_task
from contracts.rollouts import Generate
from core.config import ConfigError


@dataclass(frozen=True)
class FleetSeat:
    """Where a sampler reaches the fleet beyond `generate`: a kind whose own client talks to it (verifiers) needs
    its HTTP address, the run's token and the model folder whose tokenizer renders as the fleet's does."""

    url: str = ""
    token: str | None = None
    model_path: str = ""


class EnvKind(ABC):
    """One kind of environment at run time; `field` is its field of `EnvConfig` (None: no environment)."""

    field: str | None
    # Why the run's judges cannot score this kind's samples (a run naming one is refused at start with it), or None
    # where its sampler asks them: a kind of one's own is unjudged until its sampler asks them too.
    unjudged: str | None = "its sampler does not ask the run's judges"

    def problems(self, cfg) -> TaskSplits:
        """The run's train and held-out problems: its task's, unless the kind brings its own."""
        return load_task(cfg.task)

    def first_problem(self, cfg) -> Problem:
        """The held-out split's first problem: the one a check plays, as the rollout and the evaluation will."""
        try:
            return self.problems(cfg).heldout[0]
        except ConfigError:
            raise
        except ValueError as e:
            raise ConfigError(f"task: {e}") from None

    def check(self, cfg) -> None:
        """At start: the kind's names resolve and its classes fit (ConfigError naming the field else)."""
        return None  # a kind with nothing to resolve

    def check_budget(self, cfg, model_path: str) -> None:
        """Once the model's tokenizer exists: the first problem leaves the model room (ConfigError else)."""
        return None  # a kind whose prompts are the task's, which the config's lengths bound

    def serve(self, stack: ExitStack, cfg):
        """The run's config, with whatever the kind serves for the run's length entered in `stack` (as it is here)."""
        return cfg

    @abstractmethod
    def sampler(
        self, cfg, tokenizer, generate: Generate, decode: Callable[[list[int]], str], fleet: FleetSeat
    ) -> Sampler:
        """What plays a group of the kind's episodes (or completions) and scores it."""
