"""Fixtures of the fleet's API tests, over `fake_fleet`'s backend."""

import pytest
from fastapi.testclient import TestClient

from deployments.api import make_app
from tests.support.fake_fleet import FakeBackend, api_settings


@pytest.fixture
def backend():
    return FakeBackend()


@pytest.fixture
def client(backend):
    return TestClient(make_app(backend, api_settings()))


@pytest.fixture
def fleet():
    """A fleet with room for two runs of the default window beside its own lineage (max_loras 7, max_staleness 1)."""
    backend = FakeBackend()
    return backend, TestClient(make_app(backend, api_settings(max_loras=7, max_staleness=1)))
