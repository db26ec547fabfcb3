"""One way to sample and score a problem, for the rollout and the evaluation alike.

A `Sampler` answers the `n` scored samples of one problem under a model name and sampling settings:
`CompletionSampler` asks the fleet for `n` single completions in one request (the router keeps them
on one replica and vLLM prefills the prompt once) and sums the task's reward functions over them,
with every column the problem has; `app.rollout.episodes.EpisodeRunner` plays `n` multi-turn
episodes that the environment rewards. The rollout trains on what a sampler answers, the evaluation
counts it, so both score a problem the same way.

A sampler asks the fleet through a `Continuation` (`app.rollout.continuation`): a choice cut by a weight
update comes back continued under the model its group's `Flight` names now, token-exact, with the version
that sampled each token, which the sampler keeps as the sample's `versions` stream.

A sampler also meters its requests (`RequestMeter`): how many are on the wire, how long none was, the
tokens that came back; the rollout reports them.
"""

from __future__ import annotations

import asyncio
import time
from abc import ABC, abstractmethod
from collections import Counter, deque
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field

from app.rollout.continuation import Continuation, Flight, version_of
from app.tasks.problems import Problem
from app.tasks.rewards import RewardScorer, reward_columns
from contracts.rollouts import VERSIONS, Generate, Sample


class GroupStale(Exception):
    """The learner moved on while the group was still being sampled: it could never be trained."""


@dataclass(frozen=True)
class SamplingArgs:
    """How a sampler samples (the run's GRPO settings, or greedy for evaluation); an episode, every turn."""

    max_completion_length: int
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = -1
    min_p: float = 0.0


@dataclass
class Sampled:
    """A problem's scored samples, and how many samples each reward function failed to score."""

    samples: list[Sample]
    reward_errors: dict[str, int] = field(default_factory=dict)
    # The prompt the samples continue, when the sampler made it (a TRL environment's, rendered with its tools and
    # its reset's observation); None: the prompt it was given.
    prompt_ids: list[int] | None = None


class RequestMeter:
    """Generation requests on the wire: how many now, how long there were none, the tokens that came back."""

    def __init__(self):
        self.inflight = 0
        self._idle_s, self._idle_since = 0.0, time.monotonic()
        self._token_times: deque[tuple[float, int]] = deque(maxlen=512)

    @contextmanager
    def on_the_wire(self) -> Iterator[None]:
        now = time.monotonic()
        if self.inflight == 0:
            self._idle_s += now - self._idle_since
        self.inflight += 1
        try:
            yield
        finally:
            self.inflight -= 1
            if self.inflight == 0:
                self._idle_since = time.monotonic()

    def generated(self, tokens: int) -> None:
        self._token_times.append((time.monotonic(), tokens))

    def idle_s(self) -> float:
        """Seconds so far with no generation request on the wire (the fleet idle, as far as we know)."""
        return self._idle_s + (time.monotonic() - self._idle_since if self.inflight == 0 else 0.0)

    def generated_tok_s(self, window_s: float = 30.0) -> float:
        now = time.monotonic()
        recent = [(t, n) for t, n in self._token_times if now - t <= window_s]
        if len(recent) < 2:
            return 0.0
        return sum(n for _, n in recent[1:]) / max(1e-6, recent[-1][0] - recent[0][0])


class Sampler(ABC):
    """Samples and scores the `n` samples of one problem under a model, through the fleet's `generate`; `decode`
    (the rollout's tokenizer's) gives a choice continued after a cut its text."""

    def __init__(self, generate: Generate, decode: Callable[[list[int]], str] | None = None):
        self.generate = generate
        self.continuation = Continuation(generate, decode)
        self.meter = RequestMeter()
        self.counters: Counter = Counter()  # a sampler's own: `env/errors/<cause>`, tool calls, dropped branches

    @abstractmethod
    async def sample(
        self,
        problem: Problem,
        prompt_ids: list[int],
        model: str,
        n: int,
        sampling: SamplingArgs,
        flight: Flight | None = None,
    ) -> Sampled:
        """`n` scored samples of `problem`, first under `model`, then (a cut choice continued, a later turn) under
        what `flight` names now; without a flight, `model` throughout. A sampler that takes turns asks
        `flight.may_go_on` before each later one and raises GroupStale when it says no. What still fails after the
        fleet client's retries raises."""

    def reward_metrics(self) -> dict[str, float]:
        """The reward functions' failures so far, as `reward/errors/<name>` (none where the environment rewards), and
        the sampler's own counters (an environment's losses by cause, a TRL environment's tool calls)."""
        return {k: float(v) for k, v in self.counters.items()}

    @property
    def env_errors(self) -> int:
        """Episodes an environment ended by raising or timing out so far, all causes (none without an environment)."""
        return sum(v for k, v in self.counters.items() if k.startswith("env/errors/"))

    @abstractmethod
    def close(self) -> None:
        """Release the threads the sampler scores in (the reward functions', an environment's)."""


class CompletionSampler(Sampler):
    """Single-turn: `n` completions in one request, scored by the task's reward functions."""

    def __init__(self, generate: Generate, scorer: RewardScorer, decode: Callable[[list[int]], str] | None = None):
        super().__init__(generate, decode)
        self.scorer = scorer

    async def sample(self, problem, prompt_ids, model, n, sampling, flight=None) -> Sampled:
        flight = flight or Flight.pinned(model)
        with self.meter.on_the_wire():
            completions = await self.continuation.complete(
                [prompt_ids], n, [sampling.max_completion_length], sampling, flight
            )
        self.meter.generated(sum(len(c.token_ids) for c in completions))
        texts = [c.text for c in completions]
        truncated = [c.finish_reason == "length" for c in completions]
        columns = reward_columns([problem] * len(texts), truncated)
        scores = await asyncio.to_thread(
            self.scorer.score,
            texts,
            [problem.prompt] * len(texts),
            [c.token_ids for c in completions],
            columns,
            version_of(model) or 0,
        )
        samples = [
            Sample(c.token_ids, c.logprobs, r, t, c.text, streams={VERSIONS: c.version_stream()})
            for c, r, t in zip(completions, scores.rewards, truncated, strict=True)
        ]
        return Sampled(samples, dict(scores.errors))

    def reward_metrics(self) -> dict[str, float]:
        return self.scorer.metrics()

    def close(self) -> None:
        self.scorer.close()
