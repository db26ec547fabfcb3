"""One training client's turns: a number refused, cancelled or lost never holds the client's later requests."""

import asyncio

import pytest

from deployments.tinker.futures import RequestFailed
from deployments.tinker.turns import TurnRefused, Turns


async def run(turns: Turns, seq_id: int, ran: list[int], hold: asyncio.Event | None = None) -> None:
    async with turns.turn(seq_id):
        ran.append(seq_id)
        if hold is not None:
            await hold.wait()


def test_a_number_refused_after_its_claim_still_takes_its_turn():
    async def scenario():
        turns, ran = Turns(wait_s=5.0, max_ahead=8), []
        for seq_id in (1, 2, 3):
            turns.claim(seq_id)
        later = asyncio.create_task(run(turns, 3, ran))
        turns.give_up(2)  # refused at HTTP time: its turn is taken without running
        await run(turns, 1, ran)
        await asyncio.wait_for(later, 1.0)
        assert ran == [1, 3] and turns.next == 4

    asyncio.run(scenario())


def test_a_request_cancelled_while_it_waits_takes_its_turn():
    async def scenario():
        turns, ran, hold = Turns(wait_s=5.0, max_ahead=8), [], asyncio.Event()
        for seq_id in (1, 2, 3):
            turns.claim(seq_id)
        first = asyncio.create_task(run(turns, 1, ran, hold))
        waiting = asyncio.create_task(run(turns, 2, ran))
        third = asyncio.create_task(run(turns, 3, ran))
        await asyncio.sleep(0.01)
        waiting.cancel()  # cancel_future of a request waiting for its turn
        await asyncio.sleep(0.01)
        hold.set()
        await asyncio.wait_for(asyncio.gather(first, third), 1.0)
        assert ran == [1, 3] and waiting.cancelled()

    asyncio.run(scenario())


def test_a_turn_that_waits_past_its_bound_fails_and_the_client_goes_on():
    """The requests before it never came (lost on the way): it fails after `wait_s`, they are given up, and the
    client's next request runs at once."""

    async def scenario():
        turns, ran = Turns(wait_s=0.2, max_ahead=8), []
        turns.claim(3)
        with pytest.raises(RequestFailed, match="never arrived"):
            await run(turns, 3, ran)
        turns.claim(4)
        await asyncio.wait_for(run(turns, 4, ran), 1.0)
        assert ran == [4]
        with pytest.raises(TurnRefused, match="already used"):
            turns.claim(1)  # one of the lost ones, arriving after all

    asyncio.run(scenario())


def test_used_numbers_and_numbers_too_far_ahead_are_refused_when_they_arrive():
    turns = Turns(wait_s=5.0, max_ahead=4)
    turns.claim(2)
    with pytest.raises(TurnRefused) as twice:
        turns.claim(2)
    assert twice.value.status == 400
    with pytest.raises(TurnRefused) as ahead:
        turns.claim(10**9)
    assert ahead.value.status == 429 and "ahead of its turn" in ahead.value.message
    turns.claim(4)  # within the bound
    with pytest.raises(TurnRefused):
        turns.claim(0)  # the SDK numbers from 1


def test_a_turn_behind_requests_that_arrived_waits_for_them_however_long_they_run():
    """Only a number that never arrived is given up: one running long (a slow learner, a learner coming back) is
    waited for past `wait_s`."""

    async def scenario():
        turns, ran, hold = Turns(wait_s=0.1, max_ahead=8), [], asyncio.Event()
        turns.claim(1)
        turns.claim(2)
        slow = asyncio.create_task(run(turns, 1, ran, hold))
        behind = asyncio.create_task(run(turns, 2, ran))
        await asyncio.sleep(0.35)  # three of its bounds
        assert ran == [1] and not behind.done()
        hold.set()
        await asyncio.wait_for(asyncio.gather(slow, behind), 1.0)
        assert ran == [1, 2]

    asyncio.run(scenario())
