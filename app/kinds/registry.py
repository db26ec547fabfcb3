"""The kinds of environment a run may play, and the one its config names: every caller asks here (the rollout, the
evaluation, the teachers' checks, the driver), so that no code outside a kind's own module tells kinds apart.

Adding a kind is its config (a field of `core.config.envs.EnvConfig` made by `env_kind`) and its runtime (a module
of `app.kinds` with an `EnvKind`), and one line in `KINDS` below (docs/tasks-and-environments.md shows one). A kind
of one's own outside spotrl is one module: its config a field of an `EnvConfig` subclass, and one `register_kind` line
(`examples/kind_inline.py`, docs/extending.md).
"""

from __future__ import annotations

import functools
from contextlib import ExitStack

from app.kinds.kind import EnvKind, FleetSeat
from app.kinds.openenv_kind import OpenEnv
from app.kinds.single_turn import SingleTurn
from app.kinds.spotrl_kind import SpotrlEnvironments
from app.kinds.trl_kind import TrlEnvironments
from app.kinds.verifiers_kind import VerifiersTasksets
from app.rollout.sampling import Sampler
from app.tasks.problems import TaskSplits
from contracts.rollouts import Generate

# Each kind by the field of `EnvConfig` that names it (None: no environment, single-turn completions).
KINDS: dict[str | None, EnvKind] = {
    kind.field: kind for kind in (SingleTurn(), SpotrlEnvironments(), OpenEnv(), TrlEnvironments(), VerifiersTasksets())
}


def register_kind(kind: EnvKind) -> EnvKind:
    """Add a kind defined outside this package, by the `EnvConfig` field that names it. Call it where the kind's
    config is defined (at its module's import), so that every process that reads such a config (the rollout's and
    the evaluation's, in Ray workers) has the kind too. Registering the same class again (its module imported under
    a second name) replaces it; another class under a field already taken is refused."""
    taken = KINDS.get(kind.field)
    if taken is not None and type(taken).__qualname__ != type(kind).__qualname__:
        raise ValueError(f"env.{kind.field}: already the field of {type(taken).__qualname__}")
    KINDS[kind.field] = kind
    return kind


def kind_of(cfg) -> EnvKind:
    """The kind of environment the run's config names."""
    try:
        return KINDS[cfg.env.kind]
    except KeyError:
        raise ValueError(f"env.{cfg.env.kind}: no kind registered for it (app.kinds.registry.register_kind)") from None


def problems_of(cfg) -> TaskSplits:
    """The run's train and held-out problems, from where its kind takes them (the task's, or a verifiers taskset's)."""
    return kind_of(cfg).problems(cfg)


def sampler_for(
    cfg, tokenizer, generate: Generate, *, fleet_url: str = "", token: str | None = None, model_path: str = ""
) -> Sampler:
    """The run's sampler: its kind's episodes, or completions scored by its rewards; a kind whose own client reaches
    the fleet (verifiers) does so at `fleet_url` with `token` and renders with the tokenizer at `model_path`."""
    from core.models import completion_text

    decode = functools.partial(completion_text, tokenizer)
    return kind_of(cfg).sampler(cfg, tokenizer, generate, decode, FleetSeat(fleet_url, token, model_path))


def serve_environment(stack: ExitStack, cfg):
    """The run's config with what its kind serves for the run held up in `stack` (an OpenEnv app)."""
    return kind_of(cfg).serve(stack, cfg)
