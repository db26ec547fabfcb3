"""A teacher's config: the model that scores the student's own samples token by token for on-policy distillation.

A run names its teacher in its distill objective (`objectives: [{kind: distill, teacher: ...}]`), one of five kinds:

- `base`: the base model its fleet serves, without adapter;
- `{adapter: URL-or-folder}`: a LoRA of that base model (a committed version's bucket URL or its folder in a
  file:// bucket, or a PEFT folder), which the run's fleet loads as `teacher-v0`;
- `{model: {...}}`: another model of the student's tokenizer, served by a teacher deployment of its own in the
  run's fleet (`TeacherDeployment`, which a fleet's own config can name too);
- `{url: URL}`: an OpenAI-compatible server elsewhere that answers `prompt_logprobs` (vLLM's, another fleet);
- `{self: {model: base | live | ema, context: TEMPLATE}}`: the student itself (its base, its newest version, or an
  exponential average of its versions that the learner publishes as a lineage of the run's own), shown
  what the student is not: its prompt filled into `context` with the
  problem's answer, solution or an episode's feedback (self-distillation: SDFT, SDPO). It costs no deployment: the
  fleet serves the base and the run's own lineages already.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any, Literal

from pydantic import ConfigDict, Field, field_validator, model_validator

from contracts.adapters import ADAPTER_NAME, split_version_url
from core.config.context import check_template
from core.config.sections import ModelConfig, Section

TEACHER_ADAPTER = "teacher-v0"  # what an adapter teacher is loaded as: a family of its own, so its slot is pinned
TEACHER_KINDS = ("adapter", "model", "url", "self")  # besides `base`, which names none of them
EMA_DEFAULTS = {"update_rate": 0.05, "sync_steps": 1}  # TRL's teacher_update_rate and teacher_sync_steps


def size_to_student_context(student: ModelConfig, reader: ModelConfig, field: str, who: str = "teacher") -> None:
    """A model that reads the student's samples whole (a teacher scores them, a judge judges them: `who` says which)
    holds at least the student's context: one that names no `max_model_len` gets the student's; one that names a
    shorter one is refused (ValueError naming `field`), since every sample longer than it would be refused."""
    if "max_model_len" not in reader.model_fields_set:
        reader.max_model_len = student.max_model_len
    elif reader.max_model_len < student.max_model_len:
        raise ValueError(
            f"{field}.max_model_len={reader.max_model_len} is shorter than the student's model.max_model_len="
            f"{student.max_model_len}: the {who} could not read the longer samples; give it at least that"
        )


class ModelDeployment(Section):
    """A model served by vLLM replicas of its own in the fleet's Serve app, beside the base model's: a teacher's
    (`TeacherDeployment`) or a judge's (`core.config.judges.JudgeDeployment`), built alike
    (`deployments.replica.teacher`) and reached by the name requests give it."""

    name: str = Field(pattern=f"^{ADAPTER_NAME.pattern}$", description="The model name requests give it.")
    model: ModelConfig = Field(description="The model; its tokenizer must give the base model's token ids.")
    num_replicas: int = Field(1, ge=1, description="vLLM replicas of the model.")


class TeacherDeployment(ModelDeployment):
    """A teacher model served by vLLM replicas of its own in the fleet's Serve app, beside the base model's."""

    name: str = Field("teacher", pattern=f"^{ADAPTER_NAME.pattern}$", description="The model name requests give it.")


class SelfTeacher(Section):
    """A self teacher: the student's own model, scoring under a privileged prompt (`context`)."""

    model: Literal["base", "live", "ema"] = Field(
        description="base: the base model, no adapter; live: the run's newest version; ema: an average of its versions."
    )
    update_rate: float = Field(
        EMA_DEFAULTS["update_rate"],
        gt=0,
        le=1,
        description="ema: the newest version's share at each update (TRL's teacher_update_rate); 1 copies it.",
    )
    sync_steps: int = Field(
        EMA_DEFAULTS["sync_steps"],
        ge=1,
        description="ema: optimizer steps between two updates of the average (TRL's teacher_sync_steps).",
    )
    context: str = Field(
        description="The teacher's prompt: {prompt} and the problem's {answer}, {solution}, {feedback} or columns."
    )
    feedback: Literal["last_observation", "none"] = Field(
        "last_observation",
        description="What {feedback} holds for a failed episode: the environment's last observation, or nothing.",
    )

    @field_validator("context")
    @classmethod
    def _a_template(cls, template: str) -> str:
        return check_template(template)

    @model_validator(mode="after")
    def _ema_fields_for_ema(self) -> SelfTeacher:
        """update_rate and sync_steps set the average an `ema` teacher scores with: named for another, nothing reads
        them, and a run that meant ema but says live or base should hear so."""
        if self.model == "ema":
            return self
        # Their defaults pass (a teacher's dump, which names every field, reads back); any other value is refused.
        named = [f"{name}={getattr(self, name)}" for name in EMA_DEFAULTS if getattr(self, name) != EMA_DEFAULTS[name]]
        if named:
            raise ValueError(f"{' and '.join(named)} set the average of an ema teacher; this one is {self.model}")
        return self


class TeacherConfig(Section):
    """The teacher of a distill objective: `base` (nothing named), or one of `adapter`, `model`, `url`, `self`."""

    model_config = ConfigDict(extra="forbid", validate_assignment=True, populate_by_name=True)  # `self` or its name

    adapter: str | None = Field(
        None,
        description="A LoRA of the base model: a committed version (.../adapters/policy-vN, URL or path) or a PEFT folder.",
    )
    model: ModelConfig | None = Field(
        None, description="Another model of the student's tokenizer, served by a teacher deployment in the run's fleet."
    )
    num_replicas: int = Field(1, ge=1, description="vLLM replicas of the teacher deployment (`model` only).")
    url: str | None = Field(
        None, description="An OpenAI-compatible server that answers prompt_logprobs (token SPOTRL_TEACHER_TOKEN)."
    )
    served_model: str | None = Field(
        None, description="The model name to ask `url` for; default the first of its /v1/models."
    )
    self_teacher: SelfTeacher | None = Field(
        None, alias="self", description="The student itself under a privileged prompt (self-distillation)."
    )
    request_timeout_s: float = Field(60.0, gt=0, description="Timeout of one scoring request.")
    max_retries: int = Field(2, ge=0, description="Retries of a failed scoring request before its group is dropped.")
    self_test_tolerance: float = Field(
        1e-2,
        ge=0,
        description="Largest difference between two scorings of one sequence at start; a teacher beyond is refused.",
    )

    @field_validator("adapter")
    @classmethod
    def _committed_version_by_path(cls, adapter: str | None) -> str | None:
        """A committed version named by its folder on disk (`runs/<run>/bucket/adapters/policy-v150`, what a finished
        run leaves in a file:// bucket) is that version, as a `file://` URL; a PEFT folder stays a folder."""
        if adapter is None or "://" in adapter:
            return adapter
        folder = Path(adapter).expanduser()
        url = f"file://{folder.resolve()}"
        if split_version_url(url) is not None and not (folder / "adapter_config.json").is_file():
            return url
        return adapter

    @model_validator(mode="before")
    @classmethod
    def _base_by_name(cls, data: Any) -> Any:
        if data == "base":
            return {}
        if isinstance(data, str):
            raise ValueError("expected 'base' or a mapping with one of adapter, model, url, self")
        return data

    @model_validator(mode="after")
    def _one_kind(self) -> TeacherConfig:
        named = [k for k in TEACHER_KINDS if self._named(k) is not None]
        if len(named) > 1:
            raise ValueError(f"name one of adapter, model, url, self, not {' and '.join(named)}")
        if self.url is not None and not self.url.startswith(("http://", "https://")):
            raise ValueError(f"url={self.url!r}: expected an http:// or https:// URL")
        if self.served_model is not None and self.url is None:
            raise ValueError("served_model names the model of a teacher `url`; none is given")
        return self

    def _named(self, kind: str):
        return self.self_teacher if kind == "self" else getattr(self, kind)

    @property
    def kind(self) -> Literal["base", "adapter", "model", "url", "self"]:
        return next((k for k in TEACHER_KINDS if self._named(k) is not None), "base")

    @property
    def context(self) -> str | None:
        """The privileged prompt's template of a self teacher; None for the others, which see the student's prompt."""
        return self.self_teacher.context if self.self_teacher is not None else None

    def deployment(self) -> TeacherDeployment | None:
        """The teacher deployment the run's fleet adds for a `model` teacher; None for the other kinds."""
        if self.model is None:
            return None
        return TeacherDeployment(model=self.model, num_replicas=self.num_replicas)
