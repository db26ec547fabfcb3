"""Episodes of a TRL environment (`env.factory`, TRL's `environment_factory`) against the fleet, token-exact.

An episode plays TRL's tool loop (`app.tasks.trl_environments` holds the contract): one environment per episode,
`reset(**row)`, the prompt rendered with the environment's tools, then turns: the model's turn is parsed with the
tokenizer's response template; a turn that calls tools gets their results as `tool` messages and the model goes on,
a turn that calls none ends the episode, and so does `env.max_tool_calling_iterations`. The episode is one token
sequence laid out as GRPOTrainer lays it out: the prompt, the model's tokens as the fleet returned them (never
re-tokenised), the tool results' tokens (TRL's own `_get_tool_suffix_ids`; not trained, `completion_mask` 0). Its
reward is TRL's too: the task's reward functions with TRL's signature, the completions as messages and
`environments=`, plus `get_reward()` where the environment defines it, as a reward named after its class. A judge
among them (`app.rollout.judges`) reads the episode from those messages, its `{transcript}` every one in order.

As in `app.rollout.episodes`, a group's first turn is one `n=G` request when every episode's prompt is the same (a
`reset` that returns the same observation, or none), and each later turn one request holding every episode still
going. When resets differ, the group's prompt is what the episodes' prompts share, and each episode's own rest is
context at the head of its completion.

What costs an episode, never the run, counted per cause in `env/errors/<cause>`: the factory raising or hanging
past `env.timeout_s` (`factory_raised`, `factory_timeout`); `reset` raising (`reset_raised`), hanging
(`reset_timeout`) or returning something other than None or a string (`reset_malformed`); a prompt the template cannot render (`render`); a tool that hangs (`tool_timeout`). A tool that
raises, or a call of a tool that does not exist, is TRL's "tool failure": its error goes back to the model as the
tool's result and the episode goes on (`tools/failures_total`, `tools/unknown_name_total`). A `get_reward` that
raises scores its own episode None (`env/errors/get_reward`); a reward function that fails is counted as every
reward function's failure is (`reward/errors/<name>`).
"""

from __future__ import annotations

import asyncio
import functools
import inspect
import logging
import math
from collections.abc import Callable
from dataclasses import dataclass, field

from app.rollout.continuation import Flight, version_of
from app.rollout.episodes import Episode
from app.rollout.sampling import GroupStale, Sampled, Sampler, SamplingArgs
from app.tasks.problems import Problem
from app.tasks.rewards import RewardScorer, resolve_reward
from app.tasks.timed_calls import TimedCalls
from app.tasks.trl_environments import (
    ENVIRONMENT_FIELD,
    EnvironmentFactory,
    ToolChat,
    env_reward_func,
    probe,
    reset_kwargs,
    resolve_factories,
    tool_methods,
    trl_row,
    with_observation,
)
from contracts.rollouts import Choice, Generate

log = logging.getLogger(__name__)


class EpisodeLost(Exception):
    """The environment failed in a way that ends its episode; `cause` names the counter."""

    def __init__(self, cause: str, message: str):
        super().__init__(message)
        self.cause = cause


@dataclass
class ToolEpisode:
    """One episode as it grows: TRL's messages beside spotrl's token sequence."""

    env: object | None  # None until the factory has made it
    tools: list[Callable]
    messages: list[dict]  # the whole conversation so far (the prompt, with reset's observation, then the completion)
    prompt_len: int  # messages of the prompt
    prompt_ids: list[int]  # this episode's own rendered prompt
    episode: Episode = field(default_factory=Episode)
    lost: str | None = None  # the cause, when the environment cost the episode
    iterations: int = 0  # tool-calling turns answered so far

    @property
    def completion(self) -> list[dict]:
        """The completion as TRL gives it to reward functions: the assistant and tool messages after the prompt."""
        return self.messages[self.prompt_len :]


class ToolEpisodeRunner(Sampler):
    """Plays groups of episodes of TRL environments against the fleet; as a sampler, answers them scored."""

    def __init__(
        self,
        factories: dict[str | None, EnvironmentFactory],
        chat: ToolChat,
        generate: Generate,
        reward_funcs: list[Callable],
        *,
        max_tool_calling_iterations: int | None,
        max_episode_tokens: int,
        timeout_s: float,
        reward_timeout_s: float = 10.0,
        max_steps: int = 0,
        max_threads: int = 32,
        decode: Callable[[list[int]], str] | None = None,
        reward_weights: list[float] | None = None,
        reward_workers: int = 2,
    ):
        super().__init__(generate, decode)
        self.factories, self.chat = factories, chat
        self.multi = None not in factories
        self.max_iterations, self.max_episode_tokens = max_tool_calling_iterations, max_episode_tokens
        kinds = [probe(name, factory) for name, factory in factories.items()]
        owners = list(dict.fromkeys(k.env_type for k in kinds if k.owns_reward))  # one column per class, as TRL
        self.env_rewards = [env_reward_func(t) for t in owners]
        funcs = list(reward_funcs) + self.env_rewards
        if not funcs:  # TRL's message (GRPOTrainer.__init__)
            raise ValueError(
                "No reward source provided. Pass `reward_funcs`, or an `environment_factory` whose environment "
                "defines a `get_reward` method."
            )
        # As TRL: `reward_weights` weigh `reward_funcs`; an environment's `get_reward` added after them weighs 1.0.
        weights = list(reward_weights) if reward_weights is not None else [1.0] * len(reward_funcs)
        self.scorer = RewardScorer(
            funcs, reward_timeout_s, max_steps, reward_workers, weights + [1.0] * len(self.env_rewards)
        )
        self._calls = TimedCalls(max_threads, timeout_s, "env")

    @classmethod
    def from_config(
        cls, cfg, tokenizer, generate: Generate, decode=None, reward_funcs: list[Callable] | None = None
    ) -> ToolEpisodeRunner:
        """The runner of the config's environment factories, rendering with the model's template (the tiny model's
        made able to call tools, `tool_tokenizer`), scored by `reward_funcs` (`task.reward_funcs` as its kind calls
        them, judges included, `app.rollout.judges.task_rewards`; None: the registered or `module:function` ones)."""
        from app.rollout.judges import scoring_workers
        from app.tasks.trl_environments import tool_tokenizer

        funcs = [resolve_reward(n) for n in cfg.task.reward_funcs] if reward_funcs is None else reward_funcs
        return cls(
            resolve_factories(cfg.env.factory),
            ToolChat(tool_tokenizer(tokenizer)),
            generate,
            funcs,
            max_tool_calling_iterations=cfg.env.max_tool_calling_iterations,
            max_episode_tokens=cfg.max_episode_tokens,
            timeout_s=cfg.env.timeout_s,
            reward_timeout_s=cfg.task.reward_timeout_s,
            max_steps=cfg.train.max_steps,
            decode=decode,
            reward_weights=cfg.task.weights(),
            reward_workers=scoring_workers(cfg, funcs),
        )

    @property
    def env_errors(self) -> int:
        """Episodes an environment cost (a `get_reward` that raised costs its score, not its episode)."""
        return sum(v for k, v in self.counters.items() if k.startswith("env/errors/") and k != "env/errors/get_reward")

    def reward_metrics(self) -> dict[str, float]:
        """The reward functions' failures, and the episodes' own counters: losses by cause, tool calls."""
        return self.scorer.metrics() | super().reward_metrics()

    async def sample(self, problem, prompt_ids, model, n, sampling, flight=None) -> Sampled:
        """`n` scored episodes of `problem`; `prompt_ids` is not used: the environment's reset and tools make the
        prompt, which the answer carries (`Sampled.prompt_ids`)."""
        with self.meter.on_the_wire():
            group_prompt, episodes = await self.run_group(problem, model, n, sampling, flight)
        rewards, errors = await self._score(problem, episodes, version_of(model) or 0)
        samples = []
        for e, reward in zip(episodes, rewards, strict=True):
            if e.lost is None:
                e.episode.turn_rewards = [0.0] * (e.episode.turns - 1) + [reward]
            samples.append(e.episode.sample(judged=(e.messages[: e.prompt_len], e.completion)))  # as `_score` does
        self.meter.generated(sum(sum(s.completion_mask) for s in samples))
        return Sampled(samples, errors, prompt_ids=group_prompt)

    async def _call(self, cause: str, fn: Callable, *args, **kwargs):
        """`fn(*args, **kwargs)` in a worker thread under `env.timeout_s`: a timeout is EpisodeLost(`<cause>_timeout`),
        an exception raised as it is."""
        try:
            return await self._calls.acall(functools.partial(fn, *args, **kwargs))
        except TimeoutError as e:
            raise EpisodeLost(f"{cause}_timeout", str(e)) from None

    async def _start(self, problem: Problem) -> ToolEpisode:
        """A fresh environment, reset from the problem's row, and its episode's prompt."""
        row = trl_row(problem)
        name = row.get(ENVIRONMENT_FIELD) if self.multi else None
        if name not in self.factories:  # TRL's message
            raise ValueError(
                f"Example has `environment={name!r}`, which is not among the environments passed to "
                f"`environment_factory`. Expected one of: {list(self.factories)}."
            )
        start = ToolEpisode(None, [], list(row["prompt"]), len(row["prompt"]), [])
        try:  # a factory may start a sandbox or a server: off the event loop, under the timeout, like reset
            start.env = await self._call("factory", self.factories[name])
            start.tools = tool_methods(start.env)
            observation = await self._call("reset", start.env.reset, **reset_kwargs(row, self.multi))
        except EpisodeLost as e:
            start.lost = e.cause
        except Exception as e:
            start.lost = "factory_raised" if start.env is None else "reset_raised"
            log.warning("environment %s raised %s: %s; its episode is lost", start.lost[:-7], type(e).__name__, e)
        else:
            try:
                start.messages = with_observation(start.messages, observation)
            except TypeError as e:
                start.lost = "reset_malformed"
                log.warning("environment %s; its episode is lost", e)
        start.prompt_len = len(start.messages)
        try:
            start.prompt_ids = await asyncio.to_thread(self.chat.prompt_ids, start.messages, start.tools)
        except Exception as e:  # a template that cannot render this prompt (a user's message it rejects)
            start.lost, start.prompt_ids = start.lost or "render", []
            log.warning("the chat template failed on an episode's prompt (%s: %s); it is lost", type(e).__name__, e)
        return start

    async def run_group(
        self, problem: Problem, model: str, n: int, sampling: SamplingArgs, flight: Flight | None = None
    ) -> tuple[list[int], list[ToolEpisode]]:
        """The group's prompt and its `n` episodes, turn by turn (`app.rollout.episodes.EpisodeRunner.run_group`'s
        scheme: one request per turn for every episode still going; GroupStale once the group could not be trained)."""
        flight = flight or Flight.pinned(model)
        episodes = list(await asyncio.gather(*(self._start(problem) for _ in range(n))))
        for e in episodes:
            if e.lost is not None:
                self.counters[f"env/errors/{e.lost}"] += 1
                e.episode.env_error = True
        playing = [e for e in episodes if e.lost is None]
        if not playing:  # no prompt to sample from: the group is lost as one whose request fails
            raise RuntimeError(f"every environment of the group failed to start ({episodes[0].lost})")
        group_prompt = _shared_prefix([e.prompt_ids for e in playing])
        for e in playing:  # what this episode's prompt has beyond the group's: context at the head of its completion
            rest = e.prompt_ids[len(group_prompt) :]
            e.episode.add_observation(rest, self.chat.tokenizer.decode(rest))
        # A lost episode still takes its first turn from the group's prompt, so that every sample has model tokens
        # (its reward is None: no advantage), as in `app.rollout.episodes`.
        if all(len(e.prompt_ids) == len(group_prompt) for e in playing):
            choices = await self._sample([group_prompt], n, sampling, 1, flight)
        else:
            prompts = [group_prompt + e.episode.completion_ids for e in episodes]
            choices = await self._sample(prompts, 1, sampling, 1, flight)
        going = episodes
        while True:
            went_on = await asyncio.gather(
                *(self._take_turn(e, c, group_prompt) for e, c in zip(going, choices, strict=True))
            )
            going = [e for e, more in zip(going, went_on, strict=True) if more]
            if not going:
                return group_prompt, episodes
            if not flight.may_go_on():
                raise GroupStale(f"the group started under {model} is too old to train by now")
            turn = going[0].episode.turns + 1
            choices = await self._sample(
                [group_prompt + e.episode.completion_ids for e in going], 1, sampling, turn, flight
            )

    async def _sample(
        self, prompts: list[list[int]], n: int, sampling: SamplingArgs, turn: int, flight: Flight
    ) -> list[Choice]:
        rooms = [min(sampling.max_completion_length, self.max_episode_tokens - len(p)) for p in prompts]
        if min(rooms) < 1:
            raise ValueError(
                f"a prompt of {max(len(p) for p in prompts)} tokens leaves no room in {self.max_episode_tokens} "
                "(env.max_episode_tokens, model.max_model_len): the tools' schemas are part of the prompt"
            )
        return await self.continuation.complete(prompts, n, rooms, sampling, flight, turn)

    async def _take_turn(self, e: ToolEpisode, choice: Choice, group_prompt: list[int]) -> bool:
        """Add the model's turn, and, when it calls tools, their results; True when the episode goes on."""
        prefix = group_prompt + e.episode.completion_ids
        e.episode.add_model_turn(choice)
        if e.lost is not None:
            return False
        message = await asyncio.to_thread(self.chat.parse, choice.token_ids, prefix, e.tools)
        e.messages.append(message)
        calls = message.get("tool_calls")
        used = len(group_prompt) + len(e.episode.completion_ids)
        if choice.finish_reason == "length" and used >= self.max_episode_tokens:
            e.episode.truncated = True  # cut mid-turn by the budget
            return False
        if not calls:
            return False
        if self.max_iterations is not None and e.iterations >= self.max_iterations:
            e.episode.truncated = True  # TRL's "loop exhausted": the model asked for one more tool, refused
            self.counters["tools/loop_exhausted_total"] += 1
            return False
        try:
            tool_messages = [await self._run_tool(e, call) for call in calls]
            suffix = await asyncio.to_thread(self.chat.tool_suffix_ids, tool_messages)
        except EpisodeLost as lost:
            e.lost = lost.cause
            self.counters[f"env/errors/{lost.cause}"] += 1
            e.episode.env_error = True
            log.warning("environment failed, its episode is lost: %s", lost)
            return False
        e.iterations += 1
        if used + len(suffix) >= self.max_episode_tokens:
            e.episode.truncated = True  # no room for the results and a next turn (GRPOTrainer drops them too)
            return False
        e.messages.extend(tool_messages)
        e.episode.add_observation(suffix, self.chat.tokenizer.decode(suffix))
        return True

    async def _run_tool(self, e: ToolEpisode, call: dict) -> dict:
        """One tool call's `tool` message, as TRL's worker makes it (an error becomes the tool's result); a tool that
        hangs is EpisodeLost('tool_timeout')."""
        self.counters["tools/calls_total"] += 1
        function = call.get("function") or {}
        name = function.get("name", "unknown")
        tool = next((t for t in e.tools if t.__name__ == name), None) if call.get("type") == "function" else None
        if tool is None:
            self.counters["tools/unknown_name_total"] += 1
            return {"role": "tool", "name": name, "content": str({"error": f"unknown tool {name}"})}
        arguments = function.get("arguments", {})
        try:
            if inspect.iscoroutinefunction(tool):
                result = await asyncio.wait_for(tool(**arguments), self._calls.timeout_s)
            else:
                result = await self._call("tool", tool, **arguments)
        except (TimeoutError, EpisodeLost) as err:
            raise EpisodeLost("tool_timeout", f"tool {name}: {err or 'timed out'}") from None
        except Exception as err:
            self.counters["tools/failures_total"] += 1
            result = {"error": str(err)}
        return {"role": "tool", "name": name, "content": str(result)}

    async def _score(
        self, problem: Problem, episodes: list[ToolEpisode], step: int
    ) -> tuple[list[float], dict[str, int]]:
        """Each episode's reward: the reward functions and `get_reward` summed over the episodes that were played
        (called as TRL calls them, `environments=` included); NaN for a lost one."""
        scored = [i for i, e in enumerate(episodes) if e.lost is None]
        rewards = [math.nan] * len(episodes)
        if not scored:
            return rewards, {}
        row = trl_row(problem)
        failures_before = sum(f.failures for f in self.env_rewards)
        columns = {k: [v] * len(scored) for k, v in row.items() if k not in ("prompt", "completion", "completion_ids")}
        columns["truncated"] = [episodes[i].episode.truncated for i in scored]
        columns["environments"] = [episodes[i].env for i in scored]
        scores = await asyncio.to_thread(
            self.scorer.score,
            [episodes[i].completion for i in scored],
            [episodes[i].messages[: episodes[i].prompt_len] for i in scored],
            [episodes[i].episode.sample().model_token_ids() for i in scored],
            columns,
            step,
        )
        for i, reward in zip(scored, scores.rewards, strict=True):
            rewards[i] = reward
        self.counters["env/errors/get_reward"] += sum(f.failures for f in self.env_rewards) - failures_before
        return rewards, dict(scores.errors)

    def close(self) -> None:
        self._calls.close()
        self.scorer.close()


def _shared_prefix(seqs: list[list[int]]) -> list[int]:
    """The longest prefix every sequence starts with."""
    first = seqs[0]
    end = len(first)
    for s in seqs[1:]:
        end = min(end, len(s))
        end = next((k for k in range(end) if s[k] != first[k]), end)
    return first[:end]
