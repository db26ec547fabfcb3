"""A verifiers v1 taskset of two-digit additions, which spotrl trains unchanged (verifiers 0.4.0, `verifiers.v1`).

Nothing here knows spotrl: it is a verifiers taskset (`vf.Taskset` of `vf.Task`s scored by a `@vf.reward`) and a
harness (`vf.Harness`) that verifiers runs as it runs its own. Name it in a spotrl config
(`env: {verifiers: {taskset: "examples.verifiers_arithmetic:ArithmeticTaskset"}}`, `configs/tiny-verifiers.yaml`) or
give verifiers this module's name as the taskset id where it is importable.

The harness: verifiers' own chat harnesses (`null`, `bash`) run a PEP 723 program that `uv` installs from the network
on first use, which a loopback-only machine cannot do. `ChatHarness` plays the same chat loop in-process, as
verifiers' `Harness.launch` allows ("a harness may run its loop in-process instead of launching a program, as long as
every model call goes through `endpoint` + `secret`"): every model call goes through verifiers' interception server,
which the rollout's client (`TrainClientConfig`) sends on to the fleet. The module exports it beside the taskset, so
verifiers picks it as the taskset's default harness (`default_harness_id`).

`ArithmeticTaskset` takes three knobs (`ArithmeticConfig`): how many tasks, their seed, and `fault`, which makes its
reward misbehave on purpose (raise, hang, or return garbage) for the tests of what a failing environment costs.
"""

from __future__ import annotations

import asyncio
import random
from typing import Literal

import verifiers.v1 as vf
from verifiers.v1.runtimes import ProgramResult

PROMPT = "Compute {a}+{b}. Answer: "  # spotrl's arithmetic wording, which the tiny model was warmed up on


class ArithmeticData(vf.TaskData):
    """One addition and its sum."""

    answer: str


class ArithmeticTaskConfig(vf.TaskConfig):
    """How a task's reward behaves: `fault` makes it misbehave on purpose (the tests of a failing environment)."""

    fault: Literal["none", "raise", "hang", "garbage"] = "none"


class ArithmeticTask(vf.Task[ArithmeticData, vf.State, ArithmeticTaskConfig]):
    """Scored 1 when the model's reply, stripped, is the sum, else 0."""

    @vf.reward(weight=1.0)
    async def correct(self, trace: vf.Trace) -> float:
        fault = self.config.fault
        if fault == "raise":
            raise RuntimeError("the reward's grader is down")
        if fault == "hang":
            await asyncio.sleep(3600)
        if fault == "garbage":
            return "forty-six"  # not a number: verifiers refuses it
        return float(trace.last_reply.strip() == self.data.answer)


class ArithmeticConfig(vf.TasksetConfig):
    """How many additions, and under which seed; each task's config (`task`) is the reward's."""

    task: ArithmeticTaskConfig = ArithmeticTaskConfig()
    num_tasks: int = 512
    seed: int = 0
    digits: int = 2


class ArithmeticTaskset(vf.Taskset[ArithmeticTask, ArithmeticConfig]):
    """`num_tasks` distinct additions of operands below 10**digits, in a seeded order."""

    def load(self) -> list[ArithmeticTask]:
        rng, limit = random.Random(self.config.seed), 10**self.config.digits
        seen: set[tuple[int, int]] = set()
        tasks = []
        while len(tasks) < self.config.num_tasks:
            a, b = rng.randrange(limit), rng.randrange(limit)
            if (a, b) in seen:
                continue
            seen.add((a, b))
            data = ArithmeticData(id=f"{a}+{b}", prompt=PROMPT.format(a=a, b=b), answer=str(a + b))
            tasks.append(ArithmeticTask(data, self.config.task))
        return tasks


AGAIN = "Once more. Answer: "  # what the harness says after each reply but the last, when it plays several turns


class ChatHarnessConfig(vf.HarnessConfig):
    """The in-process chat loop's config: how many model turns it plays (more than one: it asks for the answer again,
    and the task scores the last reply)."""

    turns: int = 1


class ChatHarness(vf.Harness[ChatHarnessConfig]):
    """verifiers' `null` chat loop played in-process: chat completions through the interception server, the task's
    prompt as the conversation (a Messages prompt as it is), no tools; `turns` model turns, each after the first
    asked for by a user message (`AGAIN`), so that one rollout's turns are one session of several requests."""

    APPENDS_SYSTEM_PROMPT = True
    SUPPORTS_RESUME = True
    EXECUTES_CODE = False
    NEEDS_CONTAINER = False

    async def launch(self, ctx, trace, runtime, endpoint, secret, mcp_urls, data, **_) -> ProgramResult:
        from openai import AsyncOpenAI

        system, prompt = self.resolve_prompt(data)
        messages = [] if system is None else [{"role": "system", "content": system}]
        if isinstance(prompt, str):
            messages.append({"role": "user", "content": prompt})
        else:
            messages += [m.model_dump(exclude_none=True) for m in prompt or []]
        content = None
        async with AsyncOpenAI(base_url=endpoint, api_key=secret, max_retries=0) as client:
            for turn in range(self.config.turns):
                if turn:  # the reply exactly as it came (None when empty): verifiers' trace graph extends its branch
                    messages += [{"role": "assistant", "content": content}, {"role": "user", "content": AGAIN}]
                reply = await client.chat.completions.create(model=ctx.model, messages=messages)
                content = reply.choices[0].message.content
        return ProgramResult(0, content or "", "")


__all__ = ["ArithmeticTaskset", "ChatHarness"]
