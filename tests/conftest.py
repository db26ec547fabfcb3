"""Shared fixtures: the tiny model (built once, cached), and every test bound to loopback only."""

import os

import pytest

# Nothing in tests may reach a hub or any address but 127.0.0.1.
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
os.environ.setdefault("RAY_USAGE_STATS_ENABLED", "0")
os.environ.setdefault("VLLM_NO_USAGE_STATS", "1")
os.environ.setdefault("DO_NOT_TRACK", "1")
# Spot notices are watched by default (`contracts.notices`); in tests the clouds' metadata endpoints are a closed port
# on loopback (tests that need notices start a fake server there), so nothing ever asks 169.254.169.254.
os.environ.setdefault("AWS_EC2_METADATA_SERVICE_ENDPOINT", "http://127.0.0.1:9")
os.environ.setdefault("GCE_METADATA_HOST", "127.0.0.1:9")


@pytest.fixture(scope="session", autouse=True)
def _figures_past_capture(request):
    """Fault tests print their recovery figures into `make test`'s output (`tests.support.spot_cluster.report`)."""
    from tests.support import spot_cluster

    spot_cluster.PYTEST["config"] = request.config
    yield
    spot_cluster.PYTEST.clear()


@pytest.fixture(scope="session")
def default_config():
    from core.config import load_config

    return load_config()


@pytest.fixture(scope="session")
def tiny_model_path(default_config) -> str:
    """The embedded default's tiny model folder (built on first use, then reused from the cache)."""
    from tiny.build import prepare_model

    return prepare_model(default_config.model, default_config.task)


from tests.support.s3_server import bucket_url, file_bucket_url, s3_bucket_url, s3_server  # noqa: E402, F401
