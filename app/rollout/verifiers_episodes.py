"""Episodes of a verifiers v1 taskset against the fleet, as verifiers plays them, turned into groups token-exactly.

verifiers runs the episode (`Env.run_slot`: the env's agents, their harness, the interception server, the task's
`@vf.reward`s); its model calls reach the fleet the way verifiers' own training client sends them
(`TrainClientConfig`: the prompt rendered to token ids client-side by `renderers`, `POST /inference/v1/generate`
with `X-Session-ID` set to the rollout's trace id, which the fleet's router keeps on one replica). The model is the
group's adapter (`ModelContext.model`), the key the run's token (an `Authorization` header of verifiers' client config,
never an environment variable: every subprocess of an episode would inherit it).

A finished trace becomes a `Sample` without re-tokenising anything: its trainable branch (`Trace.branches`) is the
token sequence the renderer built and the fleet returned, `Branch.sampled_mask` marks the model's tokens (the only
ones trained, `completion_mask`), `Branch.logprobs` the fleet's sampling log-probs at them (NaN elsewhere); the reward
is verifiers' (`Trace.reward`, the weighted sum of the task's rewards). The group's prompt is what its episodes'
sequences share before their first sampled token; what an episode has beyond it is context at the head of its
completion.

What costs an episode, never the run, counted per cause in `env/errors/<cause>`: `timeout` (verifiers' episode
deadline, `env.verifiers.episode_timeout_s`, or spotrl's guard a little past it), `task_raised` (the task's setup or a
reward raised), `reward_malformed` (a reward returned what verifiers refuses as a score, or NaN or infinity), `harness_raised`,
`env_raised`, `model_call` (the model call failed: the fleet refused it or could not be reached), `raised` (any other
error verifiers recorded), `no_tokens` (a trace with no model tokens to train), `unscored` (a reward that never ran).
Such an episode's reward is NaN (no advantage); a group whose every episode is lost is dropped. A trace of several
trainable branches (verifiers' samples) is its last one here, the others counted in `verifiers/branches_dropped`.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import math
import re
from collections.abc import Callable
from dataclasses import dataclass

from app.rollout.continuation import version_of
from app.rollout.sampling import Sampled, Sampler, SamplingArgs
from app.tasks.verifiers_tasksets import VF_INDEX, load_env, taskset_tasks
from contracts.rollouts import VERSIONS, Generate, Sample

log = logging.getLogger(__name__)

# The variable verifiers' client would read a key from (`BaseClientConfig.api_key_var`): never set by spotrl, so no key
# of a run's is in the environment; the token travels as the client's `Authorization` header instead.
API_KEY_VAR = "SPOTRL_VERIFIERS_API_KEY"
GUARD_S = 10.0  # spotrl's own deadline past verifiers' episode deadline, for an episode that ignores its own
# What verifiers says when a reward returned no number (`Trace.record_reward` takes `float(value)`): read from its
# error's text, the only place it says so.
MALFORMED_SCORE = re.compile(r"scoring: (ValueError: could not convert|TypeError: float\(\) argument)")
# verifiers' error types (`verifiers.v1.errors`) by the cause they count under.
CAUSES = {
    "TaskError": "task_raised",
    "HarnessError": "harness_raised",
    "EnvError": "env_raised",
    "ProviderError": "model_call",
    "InterceptionError": "model_call",
    "TunnelError": "model_call",
}


@dataclass
class EpisodeSample:
    """An episode's sequence as a sample: its own prompt (before its first model token) and the rest."""

    prompt_ids: list[int]
    sample: Sample
    lost: str | None = None  # the cause, when the environment cost the episode
    branches_dropped: int = 0  # trainable branches of its trace beside the one it is (`trace_sample`)


def failure_cause(episode) -> str | None:
    """Why verifiers' finished `episode` cannot be trained on, or None: by its deadline, its errors, its trace."""
    traces = list(episode.traces)
    if episode.is_timeout or any(t.is_timeout for t in traces):
        return "timeout"
    errors = [*episode.errors, *(e for t in traces for e in t.errors)]
    if errors:
        first = errors[0]
        if first.type == "TaskError" and MALFORMED_SCORE.search(first.message or ""):
            return "reward_malformed"
        return CAUSES.get(first.type, "raised")
    if not traces or not any(b.trainable and any(b.sampled_mask) for b in traces[-1].branches):
        return "no_tokens"
    if any(r is None for r in traces[-1].rewards.values()):
        return "unscored"
    if not math.isfinite(traces[-1].reward):  # a reward of NaN or infinity: a number, but no score
        return "reward_malformed"
    return None


def trace_sample(trace, version: int) -> EpisodeSample:
    """A scored trace as a sample: its last trainable branch's tokens split at its first model token, the model's
    tokens masked in with their sampling log-probs and `version`, the rest context (log-prob and version NaN).

    verifiers makes each branch of a trace a training sample; a trace branches when its agent sends a history that
    is not the one it was sampled (an edited or re-rendered earlier turn). One episode is one sample of its group
    here: the last branch, whose end the reward judged, is it; the others are counted (`branches_dropped`)."""
    branches = [b for b in trace.branches if b.trainable and any(b.sampled_mask)]
    branch = branches[-1]
    ids, mask, logprobs = branch.token_ids, branch.sampled_mask, branch.logprobs
    first = mask.index(True)
    completion_mask = [int(m) for m in mask[first:]]
    sample = Sample(
        completion_ids=ids[first:],
        sampling_logprobs=[lp if m else math.nan for lp, m in zip(logprobs[first:], completion_mask, strict=True)],
        reward=float(trace.reward),
        truncated=trace.is_truncated,
        text=trace.last_reply,
        completion_mask=completion_mask,
        num_turns=trace.num_turns,
        streams={VERSIONS: [float(version) if m else math.nan for m in completion_mask]},
    )
    sample.turn_rewards = [0.0] * (sample.num_turns - 1) + [sample.reward]
    return EpisodeSample(ids[:first], sample, branches_dropped=len(branches) - 1)


def lost_sample(cause: str, feedback: str = "") -> EpisodeSample:
    """An episode the environment cost: no tokens, reward NaN (no advantage), counted by `cause`."""
    sample = Sample([], [], math.nan, env_error=True, completion_mask=[], turn_rewards=[], feedback=feedback)
    return EpisodeSample([], sample, cause)


def common_prompt(episodes: list[EpisodeSample]) -> list[int]:
    """What every kept episode's prompt starts with; each episode's rest goes to the head of its completion as
    context (not trained)."""
    prompts = [e.prompt_ids for e in episodes if e.lost is None]
    if not prompts:
        return []
    shared = prompts[0]
    for p in prompts[1:]:
        n = next((i for i, (a, b) in enumerate(zip(shared, p, strict=False)) if a != b), min(len(shared), len(p)))
        shared = shared[:n]
    for e in episodes:
        if e.lost is None and len(e.prompt_ids) > len(shared):
            rest = e.prompt_ids[len(shared) :]
            s = e.sample
            s.completion_ids = rest + s.completion_ids
            s.completion_mask = [0] * len(rest) + s.completion_mask
            s.sampling_logprobs = [math.nan] * len(rest) + s.sampling_logprobs
            s.streams = {k: [math.nan] * len(rest) + v for k, v in s.streams.items()}
    return list(shared)


def renderers_on_this_loop() -> None:
    """A fresh `renderers.client._max_prompt_len_lock` for the running loop. renderers 0.1.12 keeps one module-level
    asyncio lock for its first `GET /v1/models` per model, bound to the first loop that waits on it: a process that
    plays on a second loop (the driver evaluates before and after training, each in `asyncio.run`) would have every
    model call of a new model name fail ("bound to a different event loop"). Called when no group plays, so no
    holder of the old lock remains."""
    import renderers.client

    renderers.client._max_prompt_len_lock = asyncio.Lock()


class VerifiersRunner(Sampler):
    """Plays groups of a verifiers taskset's episodes against the fleet; as a sampler, answers them scored."""

    def __init__(
        self,
        env,
        tasks: list,
        base_url: str,
        renderer_model: str,
        generate: Generate,
        *,
        token: str | None = None,
        episode_timeout_s: float = 60.0,
        max_concurrent: int = 64,
        decode: Callable[[list[int]], str] | None = None,
    ):
        super().__init__(generate, decode)
        if not base_url.startswith(("http://", "https://")):
            raise ValueError(
                f"env.verifiers needs the fleet's HTTP address (verifiers' client speaks HTTP): {base_url}"
            )
        self.env, self.tasks = env, tasks
        self.base_url, self.renderer_model = base_url.rstrip("/"), renderer_model
        # The run's token (on a fleet of its own, the admin token) goes to verifiers' client as a header of its config
        # (`context`), never through the environment, which every subprocess of the episode would inherit.
        self._token = token
        self.episode_timeout_s = episode_timeout_s
        self.gate = asyncio.Semaphore(max_concurrent)
        self._metrics: dict[str, list[float]] = {}  # the tasks' `@vf.metric` values since the metrics were last read
        self._serving_lock: tuple[asyncio.AbstractEventLoop, asyncio.Lock] | None = None
        self._serving_users = 0
        self._serving_stack: contextlib.AsyncExitStack | None = None

    @classmethod
    def from_config(cls, cfg, tokenizer, generate, decode=None, *, fleet_url: str, token: str | None, model_path: str):
        env = load_env(cfg.env.verifiers)
        return cls(
            env,
            taskset_tasks(env),
            fleet_url,
            model_path,
            generate,
            token=token,
            episode_timeout_s=cfg.env.verifiers.episode_timeout_s,
            max_concurrent=cfg.env.verifiers.max_concurrent_episodes,
            decode=decode,
        )

    def context(self, model: str, sampling: SamplingArgs):
        """verifiers' `ModelContext` of a group: its adapter, the fleet through verifiers' training client, the run's
        sampling (a top-k only when one is set: verifiers passes extra keys through to vLLM's sampling params)."""
        from verifiers.v1 import ModelContext, SamplingConfig, TrainClientConfig

        auth = {"Authorization": f"Bearer {self._token}"} if self._token else {}  # wins over the key verifiers reads
        client = TrainClientConfig(
            base_url=f"{self.base_url}/v1",
            api_key_var=API_KEY_VAR,
            headers=auth,
            renderer_model_name=self.renderer_model,
        )
        extra = {"top_k": sampling.top_k} if sampling.top_k > 0 else {}
        if sampling.min_p:
            extra["min_p"] = sampling.min_p
        knobs = SamplingConfig(
            temperature=sampling.temperature, top_p=sampling.top_p, max_tokens=sampling.max_completion_length, **extra
        )
        return ModelContext(model=model, client=client, sampling=knobs)

    async def sample(self, problem, prompt_ids, model, n, sampling, flight=None) -> Sampled:
        """`n` episodes of `problem`'s task played by verifiers under `model`, scored by its rewards; the group's
        prompt is what their sequences share (`Sampled.prompt_ids`)."""
        task = self.tasks[problem.columns[VF_INDEX]]
        version = version_of(model) or 0  # every token of the group: no cut is continued (partial rollouts are off)
        ctx = self.context(model, sampling)
        with self.meter.on_the_wire():
            async with self._serving():
                episodes = await asyncio.gather(*(self._play(slot, ctx, version) for slot in self.env.slots(task, n)))
        lost = [e.lost for e in episodes if e.lost is not None]
        for cause in lost:
            self.counters[f"env/errors/{cause}"] += 1
        dropped = sum(e.branches_dropped for e in episodes)
        if dropped:
            self.counters["verifiers/branches_dropped"] += dropped
        if len(lost) == len(episodes):
            raise RuntimeError(f"every episode of {problem.id} was lost ({', '.join(sorted(set(lost)))})")
        group_prompt = common_prompt(episodes)
        samples = [e.sample for e in episodes]
        self.meter.generated(sum(sum(s.completion_mask or []) for s in samples))
        return Sampled(samples, prompt_ids=group_prompt)

    @contextlib.asynccontextmanager
    async def _serving(self):
        """verifiers' serving resources (its interception server), up while any group of this loop plays: the env
        holds one set at a time (`Env.serving` sets them on the env), so groups in flight together share it, the
        first to start brings it up and the last to finish takes it down."""
        loop = asyncio.get_running_loop()
        if self._serving_lock is None or self._serving_lock[0] is not loop:  # a lock binds to its loop
            self._serving_lock = (loop, asyncio.Lock())
            renderers_on_this_loop()
        lock = self._serving_lock[1]
        async with lock:
            if self._serving_users == 0:
                self._serving_stack = contextlib.AsyncExitStack()
                await self._serving_stack.enter_async_context(self.env.serving())
            self._serving_users += 1
        try:
            yield
        finally:
            async with lock:
                self._serving_users -= 1
                if self._serving_users == 0:
                    stack, self._serving_stack = self._serving_stack, None
                    await stack.aclose()

    async def _play(self, slot, ctx, version: int) -> EpisodeSample:
        """One episode, its failures its own."""
        try:
            async with self.gate, asyncio.timeout(self.episode_timeout_s + GUARD_S):
                episode = await self.env.run_slot(slot, ctx)
        except TimeoutError:
            return lost_sample("timeout", "the episode ran past its deadline")
        except Exception as e:  # verifiers records what an episode raises; this is what escaped it
            log.warning("verifiers episode raised %s: %s; it is lost", type(e).__name__, e)
            return lost_sample("raised", str(e))
        cause = failure_cause(episode)
        if cause is not None:
            errors = [*episode.errors, *(e for t in episode.traces for e in t.errors)]
            feedback = errors[0].message if errors else cause
            log.info("verifiers episode lost (%s): %s", cause, feedback[:300])
            return lost_sample(cause, feedback)
        for name, value in getattr(episode.traces[-1], "metrics", {}).items():  # `@vf.metric`s: None where one failed
            if value is not None:
                self._metrics.setdefault(name, []).append(float(value))
        return trace_sample(episode.traces[-1], version)

    def reward_metrics(self) -> dict[str, float]:
        """The losses by cause and dropped branches, and the mean of each `@vf.metric` over the episodes played since
        the last read (`verifiers/metric/<name>`, one figure a step)."""
        metrics, self._metrics = self._metrics, {}
        return super().reward_metrics() | {f"verifiers/metric/{k}": sum(v) / len(v) for k, v in metrics.items()}

    def close(self) -> None:
        """Nothing to release: verifiers' serving resources close with the last group in flight (`_serving`)."""
