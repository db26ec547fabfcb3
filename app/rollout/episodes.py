"""Multi-turn episodes against the fleet, kept token-exact from the first turn to the last.

An episode is one token sequence: prompt, model turn 1, observation 1, model turn 2, ... The
runner never re-tokenises what the model wrote: it appends the token ids the fleet returned, with
vLLM's sampling log-probs, tokenises each observation once (or takes the environment's ids), and
asks the fleet to continue from the ids so far. Each turn's request therefore extends the previous
one's prompt, which is what the prefix-hash router matches on to keep a trajectory on the replica
that holds its KV cache; the request says its `turn`, so the router counts affinity per turn.

A group's first turn is one request for all G episodes (`n=G`: one prefill, one replica); after
that the episodes diverge, and each later turn is one request holding every episode still going,
one prompt each (so one HTTP round trip per turn, not per episode; the ingress routes each prompt
on its own, to the replica that holds its trajectory). An episode ends when the environment says
done; one cut by `env.max_turns` or by its token budget (`env.max_episode_tokens`) is marked
truncated. The environment's `reset` and `step` run in worker threads under `env.timeout_s` (counted from when
the call starts, not while it waits for a thread): one that raises or hangs ends its own episode with reward None
(NaN) and `env_error`, never the group or the run, and a hung one leaves its thread behind
(`app.tasks.timed_calls`) rather than taking one of the runner's for ever. Each loss is counted by cause in
`env/errors/<cause>`: `reset_raised`, `reset_timeout`, `step_raised`, `step_timeout`, `step_malformed` (not an
`EnvStep`, a reward that is not a finite number, bad token ids), or the cause an environment names itself
(`EnvLost`: an OpenEnv server that went away, `app.tasks.openenv_env`). Every environment is closed once its group
is over, however it ended. A generation request that still fails
after the fleet client's retries costs the group, as in single-turn sampling. Each later turn names the model its
group's `Flight` names now:
the version the episode started under, or, with partial rollouts on, the newest one served (a turn
cut by a weight update is continued there too, `app.rollout.continuation`), so every model token
carries the version that sampled it. A group outlives its oldest token only so long: once it could
never be trained (`app.rollout.staleness`), the runner stops it before the next turn (`GroupStale`)
instead of sampling for nothing.

The environment rewards each episode; a run whose `task.reward_funcs` names judges (`app.rollout.judges`) also has
them score each played episode, as TRL's reward functions are called (`prompts=`, `completions=` as chat messages:
the model's turns the assistant's, the environment's observations the user's), their weighted verdicts added to its
last turn's reward; a judge that fails costs what it costs a single-turn group (its fallback, or its group dropped).

The runner is a `Sampler` (`app.rollout.sampling`): the rollout and the evaluation both take a group
of episodes as scored samples from it. No Ray here; tests drive it with a fake `generate`.
"""

from __future__ import annotations

import asyncio
import logging
import math
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from app.rollout.continuation import Flight, version_of
from app.rollout.sampling import GroupStale, Sampled, Sampler, SamplingArgs
from app.tasks.environments import Environment, EnvLost, EnvStep
from app.tasks.problems import Problem
from app.tasks.rewards import RewardScorer, reward_columns
from app.tasks.timed_calls import TimedCalls
from contracts.rollouts import VERSIONS, Choice, Generate, Sample

log = logging.getLogger(__name__)


class EnvFailed(Exception):
    """The environment raised or timed out: its episode ends with reward None; `cause` names the counter."""

    def __init__(self, cause: str, message: str):
        super().__init__(message)
        self.cause = cause


class Malformed(TypeError):
    """`step` answered something the runner cannot use (`step_malformed`)."""


@dataclass
class Episode:
    """One trajectory as it grows: everything after the prompt, which tokens are the model's, their log-probs."""

    completion_ids: list[int] = field(default_factory=list)
    completion_mask: list[int] = field(default_factory=list)
    sampling_logprobs: list[float] = field(default_factory=list)
    versions: list[float] = field(default_factory=list)  # per token, the version that sampled it (NaN: observation)
    turn_rewards: list[float] = field(default_factory=list)
    text: str = ""
    truncated: bool = False
    env_error: bool = False
    solved: bool | None = None  # the environment's verdict at the end, if it gave one
    turns: int = 0  # model turns so far
    feedback: str = ""  # what the environment said last: its last observation, or its error (a self teacher's context)
    messages: list[dict] = field(default_factory=list)  # the turns as chat messages, as a judge reads them

    @property
    def reward(self) -> float:
        return math.nan if self.env_error else sum(self.turn_rewards)

    @property
    def succeeded(self) -> bool:
        """Held-out success: the environment's `solved`, else a positive reward."""
        return self.sample().succeeded

    def add_model_turn(self, choice: Choice) -> None:
        self.completion_ids += choice.token_ids
        self.completion_mask += [1] * len(choice.token_ids)
        self.sampling_logprobs += choice.logprobs
        self.versions += choice.version_stream()
        self.text += choice.text
        self.turns += 1
        self.messages.append({"role": "assistant", "content": choice.text})

    def add_observation(self, ids: list[int], text: str, said: str | None = None) -> None:
        """The environment's answer: its token ids and text (`said`: what it reads as, where `text` is empty because
        the environment gave ids)."""
        self.completion_ids += ids
        self.completion_mask += [0] * len(ids)
        self.sampling_logprobs += [math.nan] * len(ids)  # not the model's: never scored
        self.versions += [math.nan] * len(ids)
        self.text += text
        self.messages.append({"role": "user", "content": text if said is None else said})

    def sample(self, judged: tuple[Any, list[dict]] | None = None) -> Sample:
        """The episode as a sample, carrying itself as its judges read it where `judged` says so (its prompt and its
        completion as messages: `Sample.judged`), for a judge's agreement with the held-out measure
        (`app.evaluate`)."""
        return Sample(
            self.completion_ids,
            self.sampling_logprobs,
            self.reward,
            self.truncated,
            self.text,
            completion_mask=self.completion_mask,
            turn_rewards=self.turn_rewards,
            env_error=self.env_error,
            num_turns=self.turns,
            solved=self.solved,
            streams={VERSIONS: list(self.versions)},
            feedback=self.feedback,
            judged=judged,
        )


class EpisodeRunner(Sampler):
    """Plays groups of episodes of one environment class against the fleet; as a sampler, answers them as samples."""

    def __init__(
        self,
        env_factory: Callable[[], Environment],
        encode: Callable[[str], list[int]],
        generate: Generate,
        *,
        max_turns: int,
        max_episode_tokens: int,
        timeout_s: float,
        max_threads: int = 32,
        decode: Callable[[list[int]], str] | None = None,
        judges: RewardScorer | None = None,
    ):
        """`judges`: the run's judges, weighted, that score each played episode besides the environment (None: none)."""
        super().__init__(generate, decode)
        self.env_factory, self.encode, self.judges = env_factory, encode, judges
        self.max_turns, self.max_episode_tokens, self.timeout_s = max_turns, max_episode_tokens, timeout_s
        # Its own threads, never the reward scorer's; a call that hangs past the timeout is given up on.
        self._calls = TimedCalls(max_threads, timeout_s, "env")

    @classmethod
    def from_config(
        cls,
        cfg,
        factory: Callable[[], Environment],
        tokenizer,
        generate: Generate,
        decode=None,
        judges: RewardScorer | None = None,
    ) -> EpisodeRunner:
        """The runner of the environments `factory` makes (one per episode; its kind's, `app.kinds`) under the
        config's budgets, observations tokenised as prompts are, its episodes judged by `judges` too."""
        from core.models import prompt_token_ids

        return cls(
            factory,
            lambda text: prompt_token_ids(tokenizer, text),
            generate,
            max_turns=cfg.env.max_turns,
            max_episode_tokens=cfg.max_episode_tokens,
            timeout_s=cfg.env.timeout_s,
            decode=decode,
            judges=judges,
        )

    async def sample(self, problem, prompt_ids, model, n, sampling, flight=None) -> Sampled:
        with self.meter.on_the_wire():
            episodes = await self.run_group(problem, prompt_ids, model, n, sampling, flight)
        judges, errors = self.judges, {}
        if judges is not None:
            errors = await self._judge(judges, problem, episodes, version_of(model) or 0)
        samples = [e.sample(judged=(problem.prompt, e.messages)) for e in episodes]  # as `_judge` shows them
        self.meter.generated(sum(sum(s.completion_mask) for s in samples))
        return Sampled(samples, errors)

    async def _judge(
        self, judges: RewardScorer, problem: Problem, episodes: list[Episode], step: int
    ) -> dict[str, int]:
        """The judges' weighted verdict on each episode played to its end (one the environment cost has no reward to
        add to), added to its last turn's reward; what each judge failed to score, by name."""
        played = [e for e in episodes if not e.env_error]
        if not played:
            return {}
        scores = await asyncio.to_thread(
            judges.score,
            [e.messages for e in played],
            [problem.prompt] * len(played),
            [e.sample().model_token_ids() for e in played],
            reward_columns([problem] * len(played), [e.truncated for e in played]),
            step,
        )
        for e, score in zip(played, scores.rewards, strict=True):
            e.turn_rewards[-1] += score
        return dict(scores.errors)

    def reward_metrics(self) -> dict[str, float]:
        """The environment's losses by cause, and, with judges, their counts and failures."""
        return (self.judges.metrics() if self.judges is not None else {}) | super().reward_metrics()

    async def _env_call(self, call: str, fn: Callable, *args):
        """`fn(*args)` in a worker thread under the timeout; any failure becomes EnvFailed, its cause named after
        `call` (`reset`, `step`) unless the environment named one (EnvLost)."""
        try:
            return await self._calls.acall(fn, *args)
        except TimeoutError as e:
            raise EnvFailed(f"{call}_timeout", str(e)) from None
        except EnvLost as e:
            raise EnvFailed(e.cause, f"{call}: {e}") from None
        except Malformed as e:
            raise EnvFailed(f"{call}_malformed", str(e)) from None
        except Exception as e:
            name = getattr(fn, "__qualname__", fn)
            raise EnvFailed(f"{call}_raised", f"{name} raised {type(e).__name__}: {e}") from None

    def _step_and_tokenize(self, env: Environment, text: str, token_ids: list[int]) -> tuple[EnvStep, list[int]]:
        """The environment's answer and its observation's token ids (tokenised once, here, off the event loop)."""
        step = env.step(text, list(token_ids))
        if not isinstance(step, EnvStep):
            raise Malformed(f"step() returned {type(step).__name__}, not EnvStep")
        if not isinstance(step.reward, int | float) or not math.isfinite(step.reward):
            raise Malformed(f"step() returned the reward {step.reward!r}, not a finite number")
        obs = step.observation
        if step.done or obs is None:
            return step, []
        if isinstance(obs, str):
            return step, self.encode(obs)
        if not all(isinstance(t, int) and not isinstance(t, bool) and t >= 0 for t in obs):
            raise Malformed("an observation given as token ids must be a list of non-negative ints")
        return step, list(obs)

    async def run_group(
        self,
        problem: Problem,
        prompt_ids: list[int],
        model: str,
        n: int,
        sampling: SamplingArgs,
        flight: Flight | None = None,
    ) -> list[Episode]:
        """`n` episodes of `problem`, turn by turn: one request (`n` samples) for every first turn, under `model`,
        then, per turn, one request holding every episode still going (each prompt routed on its own), under what
        `flight` names now (`model` without a flight).

        `flight.may_go_on` is asked before every later turn: once the group could never be trained, GroupStale
        ends it (the fleet retires old versions, and their requests would fail anyway)."""
        flight = flight or Flight.pinned(model)
        envs = [self.env_factory() for _ in range(n)]
        try:
            return await self._play(envs, problem, prompt_ids, model, n, sampling, flight)
        finally:  # however the group ended (done, cut, stale, a failed request, cancelled): let each go
            await asyncio.gather(*(self._close(env) for env in envs))

    async def _close(self, env: Environment) -> None:
        try:
            await self._calls.acall(env.close)
        except Exception as e:  # the episode is over: a close that fails costs nothing but the log line
            log.warning("an environment's close() failed (%s: %s)", type(e).__name__, e)

    async def _play(
        self,
        envs: list[Environment],
        problem: Problem,
        prompt_ids: list[int],
        model: str,
        n: int,
        sampling: SamplingArgs,
        flight: Flight,
    ) -> list[Episode]:
        resets = await asyncio.gather(
            *(self._env_call("reset", env.reset, problem) for env in envs), return_exceptions=True
        )
        episodes = [Episode() for _ in range(n)]
        failures = [r if isinstance(r, BaseException) else None for r in resets]
        choices = await self._sample([prompt_ids], n, sampling, 1, flight)
        going = list(range(n))
        while True:
            went_on = await asyncio.gather(
                *(
                    self._take_turn(envs[i], episodes[i], choice, len(prompt_ids), failures[i])
                    for i, choice in zip(going, choices, strict=True)
                )
            )
            going = [i for i, more in zip(going, went_on, strict=True) if more]
            if not going:
                return episodes
            if not flight.may_go_on():
                raise GroupStale(f"the group started under {model} is too old to train by now")
            turn = episodes[going[0]].turns + 1  # in lockstep: every episode still going has played as many turns
            choices = await self._sample(
                [prompt_ids + episodes[i].completion_ids for i in going], 1, sampling, turn, flight
            )

    async def _sample(
        self, prompts: list[list[int]], n: int, sampling: SamplingArgs, turn: int, flight: Flight
    ) -> list[Choice]:
        """`n` choices per prompt, prompt by prompt, each allowed what the episode budget leaves it (one request per
        distinct allowance: as a rule one in all, the allowance being `max_completion_length` until the end)."""
        rooms = [min(sampling.max_completion_length, self.max_episode_tokens - len(p)) for p in prompts]
        if min(rooms) < 1:  # only a first turn can get here: later turns are never asked for without room
            raise ValueError(f"a prompt of {len(prompts[0])} tokens leaves no room in {self.max_episode_tokens}")
        return await self.continuation.complete(prompts, n, rooms, sampling, flight, turn)

    async def _take_turn(
        self, env: Environment, episode: Episode, choice: Choice, prompt_len: int, failure: BaseException | None
    ) -> bool:
        """Add the model's turn and the environment's answer to it; True when the episode goes on."""
        episode.add_model_turn(choice)
        if failure is None:
            used = prompt_len + len(episode.completion_ids)
            if choice.finish_reason == "length" and used >= self.max_episode_tokens:
                episode.turn_rewards.append(0.0)  # cut mid-turn by the budget: an unfinished answer earns nothing
                episode.truncated = True
                return False
            try:
                step, obs_ids = await self._env_call(
                    "step", self._step_and_tokenize, env, choice.text, choice.token_ids
                )
            except EnvFailed as e:
                failure = e
            else:
                episode.turn_rewards.append(float(step.reward))
                if isinstance(step.observation, str) and step.observation:
                    episode.feedback = step.observation
                if step.done:
                    episode.solved = step.solved
                    return False
                if episode.turns >= self.max_turns or used + len(obs_ids) >= self.max_episode_tokens:
                    episode.truncated = True  # the environment wanted more, the budget had no room for it
                    return False
                if isinstance(step.observation, str):
                    episode.add_observation(obs_ids, step.observation)
                else:  # ids: no text in the sample, as before; the judges read them decoded
                    decode = self.continuation.decode
                    episode.add_observation(obs_ids, "", decode(obs_ids) if decode is not None else "")
                return True
        cause = failure.cause if isinstance(failure, EnvFailed) else "reset_raised"
        self.counters[f"env/errors/{cause}"] += 1
        episode.env_error = True
        episode.feedback = f"error: {failure}"
        log.warning("environment failed (%s), ending its episode with reward None: %s", cause, failure)
        return False

    def close(self) -> None:
        self._calls.close()
        if self.judges is not None:
            self.judges.close()
        # A factory object that holds something for its environments (an OpenEnv worker) lets it go; an environment
        # class as the factory holds nothing (its `close` is its episodes').
        if not isinstance(self.env_factory, type) and callable(getattr(self.env_factory, "close", None)):
            self.env_factory.close()
