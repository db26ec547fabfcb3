"""Cut choices continued token-exact under the model their group names now, with a version on every token."""

import asyncio

import pytest

from app.rollout.continuation import MAX_EMPTY_CUTS, Continuation, Flight
from app.rollout.sampling import SamplingArgs
from contracts.rollouts import Choice

PROMPT = [101, 102, 103]
SAMPLING = SamplingArgs(max_completion_length=8)


def complete(fleet, flight, n=2, rooms=(8,), prompts=(PROMPT,), decode=None):
    continuation = Continuation(fleet, decode)
    choices = asyncio.run(asyncio.wait_for(continuation.complete(list(prompts), n, list(rooms), SAMPLING, flight), 10))
    return choices, continuation.counters


class Versions:
    """The model a group names now: moves to the next version at each request after the first."""

    def __init__(self, *models):
        self.models = list(models)

    def __call__(self):
        return self.models.pop(0) if len(self.models) > 1 else self.models[0]


def test_a_cut_choice_is_continued_from_its_tokens_and_stitched_token_exact():
    async def fleet(prompt_ids, model, n=1, max_tokens=16, temperature=1.0, top_p=1.0, top_k=-1):
        requests.append((prompt_ids, model, n, max_tokens))
        if model == "policy-v3":  # the first request: choice 0 cut after 3 tokens, choice 1 finished (EOS at 2)
            return [
                Choice(0, [7, 8, 9], [-0.1, -0.2, -0.3], "789", "abort"),
                Choice(1, [4, 0], [-0.4, -0.5], "4", "stop"),
            ]
        assert prompt_ids == PROMPT + [7, 8, 9] and n == 1 and max_tokens == 5  # asked for what is left
        return [Choice(0, [10, 11, 0], [-0.6, -0.7, -0.8], "ab", "stop")]

    requests = []
    flight = Flight(3, Versions("policy-v3", "policy-v5"))
    choices, counters = complete(fleet, flight, decode=lambda ids: "|".join(map(str, ids)))
    cut, whole = choices
    assert cut.token_ids == [7, 8, 9, 10, 11, 0] and cut.logprobs == [-0.1, -0.2, -0.3, -0.6, -0.7, -0.8]
    assert cut.versions == [3, 3, 3, 5, 5, 5] and cut.finish_reason == "stop"
    assert cut.text == "7|8|9|10|11|0"  # decoded from all its ids at once, not its segments' texts
    assert whole.token_ids == [4, 0] and whole.versions == [3, 3] and whole.text == "4"  # untouched
    assert [r[1] for r in requests] == ["policy-v3", "policy-v5"]
    assert (counters.choices, counters.cut_choices, counters.cuts) == (2, 1, 1)
    assert counters.prefilled_again == len(PROMPT) + 3  # the prompt and the cut tokens, prefilled again
    assert flight.got == {3: 5, 5: 3} and flight.newest == 5 and not flight.on_wire


def test_every_cut_choice_of_a_request_is_continued_in_one_request_and_may_be_cut_again():
    async def fleet(prompt_ids, model, n=1, max_tokens=16, temperature=1.0, top_p=1.0, top_k=-1):
        requests.append((prompt_ids, model, n, max_tokens))
        if len(requests) == 1:
            return [Choice(i, [20 + i], [-1.0], "", "abort") for i in range(n)]  # all four cut after one token
        if len(requests) == 2:  # one request, one prompt per cut choice; the last one cut again
            assert prompt_ids == [PROMPT + [20 + i] for i in range(4)] and n == 1 and max_tokens == 3
            return [Choice(0, [30 + i, 0], [-2.0, -2.0], "", "stop") for i in range(3)] + [
                Choice(0, [33], [-2.0], "", "abort")
            ]
        assert prompt_ids == PROMPT + [23, 33] and max_tokens == 2  # a single prompt is sent as one
        return [Choice(0, [40, 41], [-3.0, -3.0], "", "length")]

    requests = []
    choices, counters = complete(fleet, Flight(1, Versions("policy-v1", "policy-v2", "policy-v4")), n=4, rooms=(4,))
    assert [c.token_ids for c in choices[:3]] == [[20, 30, 0], [21, 31, 0], [22, 32, 0]]
    assert choices[3].token_ids == [23, 33, 40, 41] and choices[3].versions == [1, 2, 4, 4]
    assert choices[3].finish_reason == "length"
    assert [c.index for c in choices] == [0, 1, 2, 3] and len(requests) == 3
    assert (counters.cut_choices, counters.cuts) == (4, 5)


def test_a_choice_cut_with_no_room_left_is_finished_and_one_that_never_progresses_fails():
    async def full(prompt_ids, model, n=1, max_tokens=16, temperature=1.0, top_p=1.0, top_k=-1):
        return [Choice(0, [5, 6], [-1.0, -1.0], "56", "abort")]  # cut as it took its last token

    (choice,), counters = complete(full, Flight.pinned("policy-v2"), n=1, rooms=(2,))
    assert choice.finish_reason == "length" and choice.token_ids == [5, 6] and counters.cuts == 0

    async def aborts_everything(prompt_ids, model, n=1, max_tokens=16, temperature=1.0, top_p=1.0, top_k=-1):
        calls.append(model)
        return [Choice(0, [], [], "", "abort")]

    calls = []
    with pytest.raises(RuntimeError, match="without a new token"):
        complete(aborts_everything, Flight.pinned("policy-v2"), n=1)
    assert len(calls) == 1 + MAX_EMPTY_CUTS


def test_a_model_that_is_no_policy_version_leaves_versions_unknown():
    async def fleet(prompt_ids, model, n=1, max_tokens=16, temperature=1.0, top_p=1.0, top_k=-1):
        return [Choice(0, [5], [-1.0], "5", "stop")]

    (choice,), _ = complete(fleet, Flight.pinned("tiny-base"), n=1)
    assert choice.versions is None and all(v != v for v in choice.version_stream())  # NaN: unknown


def test_a_min_p_reaches_the_fleet_only_when_set():
    async def fleet(prompt_ids, model, n=1, max_tokens=16, temperature=1.0, top_p=1.0, top_k=-1, **extra):
        asked.append(extra)
        return [Choice(i, [4, 0], [-0.4, -0.5], "4", "stop") for i in range(n)]

    asked = []
    for sampling in (SAMPLING, SamplingArgs(8, min_p=0.1)):
        continuation = Continuation(fleet)
        asyncio.run(continuation.complete([PROMPT], 2, [8], sampling, Flight(1, lambda: "policy-v1")))
    assert asked == [{}, {"min_p": 0.1}]
