"""A run's judges: models that score the policy's completions as a reward (LLM-as-judge, generative reward models).

A run names each judge under `judges:` and rewards with it by naming it in `task.reward_funcs`, beside or instead of
Python reward functions. A judge is:

- a model: `base` (the base model the run's fleet serves), any other name the fleet serves the run (an adapter the
  run may read, `<run>/policy-vN`, or a deployment), or, with `url`, a model of an OpenAI-compatible server elsewhere;
- a prompt `template` over the problem's fields: `{prompt}`, the problem's columns, `{completion}` (the sample
  judged: of an environment's episode, its last turn), `{transcript}` (the whole sample, one `role: text` line per
  turn: the prompt and the completion, or every turn of an episode, the environment's and its tools' replies
  included), one of which every template shows, and `{reference}` (the problem's gold answer, where the task has
  one); a field the task's problems lack is refused at start (`app.tasks.checks`), in one line;
- a verdict: `generative` (the judge writes an answer, read as yes/no or by a regex, an unreadable one scoring
  `unparseable_score`) or `logprob` (one scoring pass, no generation: the probability of a "yes" token after the
  prompt, against a "no" token's).

A judge model of its own is served by a judge deployment of the fleet (`JudgeDeployment`, `judge:` in a fleet's
config, `judge` by default), replicas of its own beside the base model's and the teacher's: every run of the fleet
names it by its name, and each asks it in its own fair share.

A judge that raises or runs out of time scores its samples `fallback_score`, counted (`app.rollout.judges`), or, with
`on_failure: drop`, costs its group, which is not trained (`app.rollout.producer`, counted too); the judge's whole
call, its retries included, must fit in `task.reward_timeout_s`, which bounds every reward function.
"""

from __future__ import annotations

import re
from typing import Annotated, Any, Literal

from pydantic import Field, field_validator, model_validator

from contracts.adapters import ADAPTER_NAME
from core.config.context import template_fields
from core.config.sections import Section
from core.config.teacher import ModelDeployment

JUDGE_NAME = re.compile(r"^[A-Za-z][A-Za-z0-9_-]{0,63}$")  # never a `module:function` reward name
RETRY_PAUSE_MAX_S = 1.0  # the longest pause between two tries of a judge's request (jitter makes it up to 1.5x)


class JudgeDeployment(ModelDeployment):
    """A judge model served by vLLM replicas of its own in the fleet's Serve app, beside the base model's (and the
    teacher's): a judge of any run of the fleet names it by `name` (`judges.<judge>.model`)."""

    name: str = Field("judge", pattern=f"^{ADAPTER_NAME.pattern}$", description="The model name judges give it.")


class GenerativeVerdict(Section):
    """The judge writes an answer, read as its verdict: yes/no, or a score a regular expression finds."""

    kind: Literal["generative"] = Field("generative", description="The judge generates its verdict as text.")
    parse: Literal["yes_no", "regex"] = Field(
        "yes_no", description="yes_no: the answer's first word, yes 1 and no 0; regex: `pattern`'s number."
    )
    pattern: str | None = Field(
        None, description="parse regex: a regular expression whose first group is the score (its last match counts)."
    )
    max_tokens: int = Field(16, ge=1, description="Tokens the judge may write for one verdict.")
    temperature: float = Field(0.0, ge=0, description="The judge's sampling temperature (0: greedy).")
    unparseable_score: float = Field(0.0, description="What a sample scores when its verdict cannot be read.")

    @model_validator(mode="after")
    def _pattern_for_regex(self) -> GenerativeVerdict:
        if self.parse != "regex":
            if self.pattern is not None:
                raise ValueError("pattern reads a verdict with parse: regex; this one is yes_no")
            return self
        if self.pattern is None:
            raise ValueError("parse regex needs a pattern whose first group is the score")
        try:
            groups = re.compile(self.pattern).groups
        except re.error as e:
            raise ValueError(f"pattern {self.pattern!r} is no regular expression: {e}") from None
        if groups < 1:
            raise ValueError(f"pattern {self.pattern!r} has no group: its first group is the score")
        return self


class LogprobVerdict(Section):
    """The judge's probability of a "yes" token after the prompt, from its log-probs: one scoring pass, no text."""

    kind: Literal["logprob"] = Field(description="The verdict is read from the judge's log-probs.")
    yes_token: str = Field(" yes", min_length=1, description="The token whose probability is the score (one token).")
    no_token: str | None = Field(
        " no", min_length=1, description="With it the score is p(yes) / (p(yes) + p(no)); None: p(yes) alone."
    )


Verdict = Annotated[GenerativeVerdict | LogprobVerdict, Field(discriminator="kind")]


class JudgeConfig(Section):
    """One judge: its model, its prompt, how its verdict is read, and what a sample scores when it fails."""

    model: str = Field(
        "base",
        min_length=1,
        description="base: the fleet's base model; else a model the fleet serves the run (an adapter, a deployment such as "
        "judge), or `url`'s.",
    )
    url: str | None = Field(
        None, description="An OpenAI-compatible server's base URL (token SPOTRL_JUDGE_TOKEN); None: the run's fleet."
    )
    template: str = Field(
        description="The judge's prompt: {completion} or {transcript}, and {prompt}, {reference}, the problem's columns."
    )
    verdict: Verdict = Field(default_factory=GenerativeVerdict, description="generative or logprob, with settings.")
    fallback_score: float = Field(0.0, description="What a sample scores when the judge raised or timed out.")
    on_failure: Literal["fallback", "drop"] = Field(
        "fallback",
        description="fallback: a failed call's samples score fallback_score; drop: its group is not trained, counted.",
    )
    timeout_s: float = Field(4.0, gt=0, description="Timeout of one request of the judge (a group's samples).")
    max_retries: int = Field(1, ge=0, description="Retries of a failed request before its samples score the fallback.")

    @field_validator("verdict", mode="before")
    @classmethod
    def _verdict_by_kind(cls, verdict: Any) -> Any:
        """`verdict: logprob` (or `generative`) is that verdict with its defaults; one that names no kind generates."""
        if isinstance(verdict, str):
            return {"kind": verdict}
        if isinstance(verdict, dict) and "kind" not in verdict:
            return {"kind": "generative", **verdict}
        return verdict

    @field_validator("template")
    @classmethod
    def _shows_the_completion(cls, template: str) -> str:
        if not {"completion", "transcript"} & template_fields(template):
            raise ValueError(
                f"{template!r} must show the judge the sample it judges ({{completion}} or {{transcript}})"
            )
        return template

    @model_validator(mode="after")
    def _where(self) -> JudgeConfig:
        if self.url is None:
            return self
        if not self.url.startswith(("http://", "https://")):
            raise ValueError(f"url={self.url!r}: expected an http:// or https:// URL")
        if self.model == "base":
            raise ValueError("model: name the model `url` serves (base is the run's fleet's)")
        if isinstance(self.verdict, LogprobVerdict):
            raise ValueError(
                "verdict logprob reads the log-probs of the run's tokenizer's ids, which only a judge on the run's "
                "fleet shares; use a generative verdict with url"
            )
        return self

    @property
    def budget_s(self) -> float:
        """The longest a judge's call may take: every try to its timeout, and the pauses between them."""
        return (self.max_retries + 1) * self.timeout_s + self.max_retries * 1.5 * RETRY_PAUSE_MAX_S


def check_judges(judges: dict[str, JudgeConfig], reward_timeout_s: float) -> None:
    """Each judge's name reads as no other reward's, and its call fits in `task.reward_timeout_s` (past it the
    reward's call is given up on and its samples get nothing, not the judge's fallback): ValueError else."""
    for name, judge in judges.items():
        if not JUDGE_NAME.match(name):
            raise ValueError(
                f"judges.{name[:64]}: a judge's name is a letter, then letters, digits, _ or - (64 at most)"
            )
        if judge.budget_s >= reward_timeout_s:
            raise ValueError(
                f"judges.{name}: {judge.max_retries + 1} tries of timeout_s {judge.timeout_s} take up to "
                f"{judge.budget_s:.1f} s, not below task.reward_timeout_s {reward_timeout_s}: raise it, or lower theirs"
            )
