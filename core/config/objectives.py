"""The terms of the learner's loss as a run's config names them (`objectives`), each with its own settings:
GRPO's clip and importance sampling, distillation's teacher and divergence. What they share, the optimizer and the
sampling, is `core.config.training`'s; their code is `app.objectives`."""

from __future__ import annotations

from typing import Annotated, Any, Literal, Union

from pydantic import AfterValidator, Field, model_validator

from contracts.adapters import RUN_NAME
from core.config.sections import Section
from core.config.teacher import SelfTeacher, TeacherConfig


class GRPOObjectiveConfig(Section):
    """GRPO as a term of the learner's loss (`app.objectives.grpo`), with its own settings (named as in TRL)."""

    kind: Literal["grpo"] = Field(description="The objective: grpo (group-normalised advantages, TRL's clipped loss).")
    weight: float = Field(1.0, gt=0, description="Weight of this objective's loss in the learner's sum.")
    epsilon: float = Field(0.2, ge=0, lt=1, description="Lower clip: ratio is clipped at 1 - epsilon.")
    epsilon_high: float = Field(0.2, ge=0, description="Upper clip: ratio is clipped at 1 + epsilon_high.")
    vllm_importance_sampling_correction: bool = Field(
        False, description="Truncated importance sampling against the sampler's log-probs."
    )
    vllm_importance_sampling_cap: float = Field(2.0, gt=0, description="Cap of the truncated importance weight.")
    sequence_is: Literal["off", "mask", "truncate"] = Field(
        "off",
        description="Sequence-level importance ratio (MIS, the product of a sample's token ratios): mask drops a "
        "sample outside [sequence_is_low, sequence_is_high], truncate caps it into that band; off: none.",
    )
    sequence_is_low: float = Field(0.5, gt=0, description="Lower bound of the sequence ratio's band.")
    sequence_is_high: float = Field(2.0, gt=0, description="Upper bound of the sequence ratio's band.")
    token_mask: bool = Field(
        False,
        description="IcePop-style: tokens whose learner/sampler ratio is outside [token_mask_low, token_mask_high] "
        "contribute nothing.",
    )
    token_mask_low: float = Field(0.5, gt=0, description="Lower bound of a token's ratio under token_mask.")
    token_mask_high: float = Field(2.0, gt=0, description="Upper bound of a token's ratio under token_mask.")

    @model_validator(mode="after")
    def _off_policy_guards(self) -> GRPOObjectiveConfig:
        """Bands that hold something, and one off-policy correction at a time (each replaces the PPO ratio's)."""
        for low, high in (("sequence_is_low", "sequence_is_high"), ("token_mask_low", "token_mask_high")):
            if getattr(self, low) >= getattr(self, high):
                raise ValueError(f"{low} must be below {high}")
        if self.sequence_is == "truncate" and self.vllm_importance_sampling_correction:
            raise ValueError(
                "sequence_is truncate and vllm_importance_sampling_correction both carry the off-policy correction "
                "(per sample, per token): choose one"
            )
        return self


# The most alternatives a fleet's scoring request may ask for (`deployments.api.bodies.MAX_LOGPROBS`, vLLM's default
# max_logprobs); a teacher that is asked more answers 400.
MAX_TEACHER_TOP_K = 20
TOPK_FIELDS = frozenset({"top_k", "alpha", "tail", "is_clip"})  # what only the topk mode reads


class DistillObjectiveConfig(Section):
    """On-policy distillation (`app.objectives.distill`): the reverse KL to a teacher at every sampled token, or a
    divergence over the teacher's top-k tokens at every position (`mode: topk`)."""

    kind: Literal["distill"] = Field(
        description="The objective: distill (a teacher scores the student's samples; per-token reverse KL)."
    )
    weight: float = Field(1.0, gt=0, description="Weight of this objective's loss in the learner's sum.")
    teacher: TeacherConfig | None = Field(
        None, description="The teacher: base, {adapter: ...}, {model: {...}}, {url: ...} or {self: {...}}."
    )
    teachers: dict[str, TeacherConfig] | None = Field(
        None, description="Several teachers by name, instead of `teacher`: each problem picks one by `teacher_field`."
    )
    teacher_field: str = Field(
        "teacher", description="With `teachers`: the problem's column naming its teacher (none: the one named default)."
    )
    coef: float = Field(
        1.0,
        gt=0,
        description="Scale of the signal: sampled, advantage = -coef x (sampler's - teacher's log-prob); topk, "
        "coef x divergence.",
    )
    max_gap: float = Field(
        20.0, gt=0, description="Largest per-token gap (nats) counted; a token the teacher rules out counts this much."
    )
    mode: Literal["sampled", "topk"] = Field(
        "sampled",
        description="sampled: reverse KL at the sampled token; topk: a divergence over the teacher's top_k (TRL's "
        "topk_logits).",
    )
    top_k: int = Field(
        20,
        ge=1,
        le=MAX_TEACHER_TOP_K,
        description=f"topk: the teacher's most likely tokens per position distilled (the fleet answers at most "
        f"{MAX_TEACHER_TOP_K}).",
    )
    alpha: float = Field(
        0.5,
        ge=0,
        le=1,
        description="topk: generalised JSD between forward KL (0) and reverse KL (1), TRL's distillation_alpha.",
    )
    tail: bool = Field(
        False, description="topk: one more bucket for the mass outside the top k (else both are renormalised over it)."
    )
    is_clip: float | None = Field(
        2.0,
        gt=0,
        description="topk: clip of the importance weight exp(learner - sampler log-prob) per token; null: none.",
    )

    @model_validator(mode="after")
    def _topk_fields_in_topk_mode(self) -> DistillObjectiveConfig:
        """A top-k setting given in sampled mode would be ignored without a word: refuse it instead (its default
        is no setting, so that a dumped config loads again)."""
        fields = type(self).model_fields
        given = sorted(f for f in TOPK_FIELDS if getattr(self, f) != fields[f].default)
        if self.mode == "sampled" and given:
            raise ValueError(f"{', '.join(given)}: only for mode topk (mode is sampled)")
        return self

    @model_validator(mode="after")
    def _one_or_several(self) -> DistillObjectiveConfig:
        if (self.teacher is None) == (self.teachers is None):
            raise ValueError("name a teacher, or several as teachers: {<name>: <teacher>}, not both nor neither")
        if self.teachers is not None:
            if not self.teachers:
                raise ValueError("teachers: name at least one")
            for name in self.teachers:
                if not RUN_NAME.fullmatch(name):
                    raise ValueError(f"teachers: {name!r} cannot name a teacher (1-32 of a-z, 0-9, '_', '-')")
            for kind in ("adapter", "model"):  # the fleet a run brings has one teacher slot and one deployment
                named = [n for n, t in self.teachers.items() if t.kind == kind]
                if len(named) > 1:
                    raise ValueError(f"teachers: at most one {kind} teacher (got {', '.join(named)})")
        emas = {(t.update_rate, t.sync_steps) for t in self.ema_teachers()}
        if len(emas) > 1:
            raise ValueError(
                f"ema teachers of one run share the learner's one average: one update_rate and sync_steps, not {sorted(emas)}"
            )
        return self

    def named_teachers(self) -> dict[str, TeacherConfig]:
        """The objective's teachers by name: the one `teacher` as `teacher`, or `teachers`."""
        return dict(self.teachers) if self.teachers is not None else {"teacher": self.teacher}

    def ema_teachers(self) -> list[SelfTeacher]:
        """Its `ema` self teachers: they score with the average of the run's versions that its learner keeps."""
        return [
            t.self_teacher
            for t in self.named_teachers().values()
            if t.self_teacher is not None and t.self_teacher.model == "ema"
        ]


# One term of the learner's loss (`app.objectives`), told apart by its `kind`.
ObjectiveConfig = Annotated[GRPOObjectiveConfig | DistillObjectiveConfig, Field(discriminator="kind")]


def _each_kind_once(objectives: list) -> list:
    kinds = [o.kind for o in objectives]
    if len(set(kinds)) < len(kinds):
        raise ValueError(f"each kind at most once (got {kinds}): their metrics would mix")
    return objectives


# The objectives a run's learner sums: each kind at most once.
Objectives = Annotated[list[ObjectiveConfig], AfterValidator(_each_kind_once)]


def objectives_with(*own: type[Section]) -> Any:
    """The type of `objectives` with objectives of one's own beside the shipped ones, each a Section with a
    `kind: Literal[...]` field (told apart by it, each at most once): a `RunConfig` subclass's field
    (`examples/objective_rloo.py`, docs/extending.md)."""
    union = Union[(GRPOObjectiveConfig, DistillObjectiveConfig, *own)]  # built from a tuple: `A | B` cannot splat
    return Annotated[list[Annotated[union, Field(discriminator="kind")]], AfterValidator(_each_kind_once)]
