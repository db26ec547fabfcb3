"""The fleet's own HTTP API (`deployments.api`: runs, tokens, heartbeats, fair share) on a fake backend, served by
uvicorn on 127.0.0.1: what the Tinker service's fleet calls are tested against."""

import asyncio
import contextlib

import httpx
import pytest

from tests.support.fake_fleet import ADMIN, FakeBackend, api_settings
from tests.support.served_app import served


class SlowBackend(FakeBackend):
    """The fake replicas, each generation taking `delay_s`; the most generations in flight at once is counted."""

    def __init__(self, delay_s: float = 0.0):
        super().__init__()
        self.delay_s, self.in_flight, self.most_in_flight = delay_s, 0, 0

    async def generate(self, request):
        self.in_flight += 1
        self.most_in_flight = max(self.most_in_flight, self.in_flight)
        try:
            await asyncio.sleep(self.delay_s)
            return await super().generate(request)
        finally:
            self.in_flight -= 1


class Fleet:
    """A served fleet API: its URL, backend, and the admin's calls the tests make."""

    def __init__(self, url: str, backend: SlowBackend):
        self.url, self.backend = url, backend

    def register(self, name: str) -> str:
        """A run registered by the admin; its Tinker API key (`tml-` and the run's token)."""
        reply = httpx.post(f"{self.url}/v1/runs", json={"name": name}, headers=ADMIN, timeout=10)
        assert reply.status_code == 200, reply.text
        return "tml-" + reply.json()["token"]

    def remove(self, name: str) -> None:
        assert httpx.delete(f"{self.url}/v1/runs/{name}", headers=ADMIN, timeout=10).status_code == 200

    def runs(self) -> list[str]:
        return httpx.get(f"{self.url}/v1/runs", headers=ADMIN, timeout=10).json()["runs"]


@contextlib.contextmanager
def served_fleet(tmp_path, backend: SlowBackend, **settings):
    from contracts.retry import Backoff
    from core.bucket.records import RunRecords
    from deployments.api import make_app

    records = RunRecords(f"file://{tmp_path}/bucket", backoff=Backoff(attempts=1, first_s=0.0))
    app = make_app(backend, api_settings(max_loras=16, max_staleness=1, **settings), None, records)
    with served(app) as url:
        yield Fleet(url, backend)


@pytest.fixture
def fleet(tmp_path):
    """The fleet API, generations taking no time, runs released after 2 s without a sign of life."""
    with served_fleet(tmp_path, SlowBackend(), run_idle_timeout_s=2.0) as served:
        yield served


@pytest.fixture
def slow_fleet(tmp_path):
    """The fleet API, each generation taking 0.5 s."""
    with served_fleet(tmp_path, SlowBackend(delay_s=0.5)) as served:
        yield served
