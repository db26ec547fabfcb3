"""The service's futures: a result is kept for its tenant until `ttl_s` after it finished, a running one for as long
as it runs, and another tenant never sees either."""

import asyncio

from deployments.tinker.futures import Futures, RequestFailed, Result


def test_a_result_is_kept_until_its_ttl_after_it_finished_and_a_running_one_as_long_as_it_runs():
    clock = [0.0]
    futures = Futures(ttl_s=10.0, clock=lambda: clock[0])

    async def main():
        release = asyncio.Event()

        async def slow() -> Result:
            await release.wait()
            return Result(json={"slow": True})

        async def fast() -> Result:
            return Result(json={"fast": True})

        running = futures.submit("alice", slow())
        done = futures.submit("alice", fast())
        assert await futures.wait(done, 1.0) == Result(json={"fast": True})
        assert not futures.owned(done, "bob")  # another key's id is unknown to it
        clock[0] = 9.0
        futures.submit("bob", fast())  # each submit expires what is due: nothing yet
        assert futures.owned(done, "alice") and futures.owned(running, "alice")
        clock[0] = 10.5
        later = futures.submit("bob", fast())
        assert not futures.owned(done, "alice")  # 10.5 s after it finished: gone
        assert futures.owned(running, "alice")  # still running: kept, however long
        assert await futures.wait(running, 0.01) is None
        release.set()
        assert await futures.wait(running, 1.0) == Result(json={"slow": True})
        await futures.wait(later, 1.0)
        clock[0] = 30.0
        futures.submit("bob", fast())
        assert not futures.owned(running, "alice") and not futures.owned(later, "bob")
        assert len(futures) == 1  # the one just submitted

    asyncio.run(main())


def test_a_failure_is_answered_as_such_and_a_tenants_futures_go_with_it():
    futures = Futures(ttl_s=10.0)

    async def main():
        async def refused() -> Result:
            raise RequestFailed("no such thing", "user")

        async def broken() -> Result:
            raise KeyError("oops")

        async def forever() -> Result:
            await asyncio.Event().wait()
            raise AssertionError("never")

        user = await futures.wait(futures.submit("alice", refused()), 1.0)
        assert isinstance(user, RequestFailed) and user.category == "user"
        server = await futures.wait(futures.submit("alice", broken()), 1.0)
        assert isinstance(server, RequestFailed) and server.category == "server" and "KeyError" in server.message
        pending = [futures.submit("alice", forever()) for _ in range(3)]
        bobs = futures.submit("bob", forever())
        assert futures.cancel_tenant("alice") == 5  # the two failed and the three still running
        assert not any(futures.owned(p, "alice") for p in pending) and futures.owned(bobs, "bob")
        futures.cancel(bobs)

    asyncio.run(main())
