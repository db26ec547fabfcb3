"""What the Tinker API's HTTP side (`deployments/tinker/`) and its learner (`app/learner/tinker_learner.py`) agree on.

The two sit in products that never import each other, so the learner is reached as a named Ray actor
(`LEARNER_ACTOR` in `LEARNER_NAMESPACE`, started by `launch/tinker.py`) and every call crosses as one of these typed
messages: plain lists and numbers, never the SDK's pydantic objects (the learner needs no SDK), never dicts with
string-named fields. `TinkerBackend` is the learner as the service sees it, one method per call (as SkyRL's Tinker
server's `AbstractBackend`): `deployments.tinker.learner_handle.RayLearner` implements it over Ray, and a route's
call reads as the learner method it reaches (`backend.forward_backward(call)` -> `TinkerLearner.forward_backward`).
The learner answers numbers; the tinker paths the user is given for them are the service's to record
(`core.bucket.tinker_registry`).

`LOSS_INPUTS` is the one list of the built-in losses the service accepts and the `loss_fn_inputs` each needs
(Tinker's documented names); what each computes is `app.objectives.tinker_losses`'.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Protocol

LEARNER_ACTOR = "spotrl-tinker-learner"
LEARNER_NAMESPACE = "spotrl-tinker"
TINKER_APP = "tinker"  # the Serve application beside the fleet's
TINKER_ROUTE_PREFIX = "/api"  # the SDK's paths are /api/v1/...
API_KEY_PREFIX = "tml-"  # what the SDK requires of an API key; the rest is the tenant's run token
# Under a tenant's prefix of the fleet's bucket: its saved states, and its exported weights (`save_weights_external`),
# each a `core.bucket.CheckpointStore`; the learner writes both, the service serves exports' files for download.
STATES_PREFIX = "tinker"
EXPORTS_PREFIX = "tinker/external"
# In the fleet's bucket, beside the tenants' prefixes: one pointer per tinker path its owner published to every key.
PUBLIC_PREFIX = "tinker-public"


def learner_name(index: int) -> str:
    """The name of learner `index` of the service's learners (`TinkerSettings.learners`): the first is `LEARNER_ACTOR`."""
    return LEARNER_ACTOR if index == 0 else f"{LEARNER_ACTOR}-{index}"


# The built-in losses and the loss_fn_inputs each reads, besides `target_tokens` (every loss reads those).
LOSS_INPUTS: dict[str, tuple[str, ...]] = {
    "cross_entropy": ("weights",),
    "importance_sampling": ("logprobs", "advantages"),
    "ppo": ("logprobs", "advantages"),
    "cispo": ("logprobs", "advantages"),
    "dro": ("logprobs", "advantages"),
    "gspo": ("logprobs", "advantages", "sequence_ratio_mask"),
}
# loss_fn_config keys each loss reads, with Tinker's defaults.
LOSS_CONFIG: dict[str, dict[str, float]] = {
    "cross_entropy": {},
    "importance_sampling": {},
    "ppo": {"clip_low_threshold": 0.8, "clip_high_threshold": 1.2},
    "cispo": {"clip_low_threshold": 0.8, "clip_high_threshold": 1.2},
    "dro": {"beta": 0.05},
    "gspo": {"clip_low_threshold": 0.8, "clip_high_threshold": 1.2},
}


@dataclass(frozen=True)
class AdapterSpec:
    """A training client's adapter: LoRA rank, seed, which layers it adapts (attention, MLP)."""

    rank: int
    seed: int | None = None
    train_attn: bool = True
    train_mlp: bool = True


@dataclass(frozen=True)
class Datum:
    """One sequence to score: `input_tokens` predicts `target_tokens` position by position; `inputs` are the other
    loss_fn_inputs (`weights`, `logprobs`, `advantages`), each one value per position."""

    input_tokens: list[int]
    target_tokens: list[int]
    inputs: dict[str, list[float]] = field(default_factory=dict)


@dataclass(frozen=True)
class LossCall:
    """forward (`backward=False`: log-probs and the loss, no gradients) or forward_backward (gradients accumulate
    until the next `AdamStep`) of `model` on `data` with the built-in `loss_fn` and its `config`."""

    model: str
    data: list[Datum]
    loss_fn: str
    config: dict[str, float] = field(default_factory=dict)
    backward: bool = True


@dataclass(frozen=True)
class LossReply:
    """Per datum the target tokens' log-probs, and the batch's loss (summed over its datums)."""

    logprobs: list[list[float]]
    loss: float

    @property
    def metrics(self) -> dict[str, float]:
        """As the SDK folds a call's metrics: `name:reduction`."""
        return {"loss:sum": self.loss}


@dataclass(frozen=True)
class AdamStep:
    """One AdamW step of `model` with the SDK's `AdamParams` (grad_clip_norm 0: no clipping)."""

    model: str
    learning_rate: float
    beta1: float
    beta2: float
    eps: float
    weight_decay: float
    grad_clip_norm: float


@dataclass(frozen=True)
class StepReply:
    """An optimizer step: the gradient's norm before clipping, and the client's steps so far."""

    grad_norm: float
    steps: int

    @property
    def metrics(self) -> dict[str, float]:
        """As the SDK folds a step's metrics: `name:reduction`."""
        return {"grad_norm:mean": self.grad_norm, "step:max": float(self.steps)}


@dataclass(frozen=True)
class Lineage:
    """Where a tenant's versions go: its prefix of the fleet's bucket, the key its versions are signed with (the
    fleet verifies it before it loads one), and its run's name (the fleet serves `<run>/policy-vN`)."""

    bucket_url: str
    signing_key: str
    run: str
    cache_dir: str


@dataclass(frozen=True)
class Export:
    """Weights exported in the PEFT format (`save_weights_external`): export `number` of the tenant's exports store
    (`EXPORTS_PREFIX`), its files' sizes by relative name."""

    number: int
    files: dict[str, int]

    @property
    def size_bytes(self) -> int:
        return sum(self.files.values())


@dataclass(frozen=True)
class Publication:
    """A committed version: its number in the tenant's lineage and its key (`policy-vN`), as the fleet loads it."""

    version: int
    key: str


class LearnerLost(RuntimeError):
    """The learner actor is gone (a preempted node, a crash): the request may succeed once it is back."""


class TinkerBackend(Protocol):
    """One learner as the service calls it: a method per call, typed records in and out. Raises `LearnerLost` while
    the learner is gone, `KeyError` for a training client it does not hold (released, or the learner restarted), and
    `ValueError` for what it refuses as sent."""

    async def create(self, model: str, spec: AdapterSpec) -> None:
        """A fresh adapter for training client `model`."""

    async def drop(self, model: str) -> bool:
        """Release `model`'s adapter and optimizer; whether the learner held it."""

    async def models(self) -> list[str]:
        """The training clients whose adapters the learner holds."""

    async def notice(self) -> str | None:
        """The spot notice for the learner's node, in words; None while there is none."""

    async def forward_backward(self, call: LossCall) -> LossReply:
        """Log-probs and loss of `call.data`; with `call.backward`, gradients accumulate until the next step."""

    async def optim_step(self, step: AdamStep) -> StepReply:
        """One AdamW step of `step.model`'s adapter."""

    async def publish(self, model: str, lineage: Lineage) -> Publication:
        """Commit the adapter as the tenant's next sampler version (`policy-vN`), signed with the lineage's key."""

    async def adopt(self, lineage: Lineage, source: str, version: int, source_key: str) -> Publication:
        """Copy sampler `version` of the prefix `source` (verified under `source_key`) into the tenant's lineage."""

    async def save_state(self, model: str, lineage: Lineage, gradient: bool) -> int:
        """Commit adapter, optimizer (and with `gradient`, a gradient not yet applied) as the tenant's next state."""

    async def export(self, model: str, lineage: Lineage) -> Export:
        """Commit the adapter as a PEFT folder to the tenant's exports."""

    async def load_state(
        self, model: str, lineage: Lineage, number: int, optimizer: bool, source: str | None
    ) -> AdapterSpec:
        """A client `model` from state `number` (of the prefix `source`, another tenant's, when not None)."""
