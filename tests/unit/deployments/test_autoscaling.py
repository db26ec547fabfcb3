"""An elastic fleet (`deployments.autoscaling`, `fleet.autoscaling`): replicas for the sequences in flight, one more
when every engine is full, Serve's own config built from ours, and the live fleet followed by the fair share's
budget and `/server_info` (`deployments.control.upkeep`, `membership`)."""

import asyncio
from types import SimpleNamespace

import pytest
from fastapi.testclient import TestClient

from core.config import ConfigError, FleetSettings, load_config
from deployments.autoscaling import SequencesPolicy, autoscaling_config, desired_replicas


def test_replicas_for_the_sequences_in_flight_and_one_more_when_every_engine_is_full():
    assert desired_replicas([100, 60], queued=0, target=64, full=256) == 3  # 160 / 64
    assert desired_replicas([10, 0], queued=0, target=64, full=256) == 1
    assert desired_replicas([10, 0], queued=70, target=64, full=256) == 2  # requests waiting at the handles count
    assert desired_replicas([256, 256], queued=0, target=256, full=256) == 3  # the backlog waits in the ingress


def test_the_policy_reads_what_each_replica_reports_and_stays_put_before_any_report():
    policy = SequencesPolicy(target=8, full=16)
    ctx = SimpleNamespace(aggregated_metrics={"sequences": {"r1": 12.0, "r2": 9.0}}, total_queued_requests=0.0)
    assert policy(ctx) == (3, {})
    assert policy(SimpleNamespace(aggregated_metrics={}, target_num_replicas=2, total_queued_requests=0.0)) == (2, {})


def test_serve_takes_the_autoscaling_config_and_our_bounds_are_checked():
    from ray.serve.config import AutoscalingConfig

    fleet = FleetSettings(
        num_replicas=2,
        max_num_seqs=32,
        autoscaling={"min_replicas": 1, "max_replicas": 3, "target_sequences": 16, "upscale_delay_s": 5},
    )
    serve_config = AutoscalingConfig(**autoscaling_config(fleet))
    assert (serve_config.min_replicas, serve_config.max_replicas, serve_config.initial_replicas) == (1, 3, 2)
    assert serve_config.upscale_delay_s == 5 and serve_config.policy.policy_kwargs == {"target": 16, "full": 32}
    assert autoscaling_config(FleetSettings()) is None
    with pytest.raises(ConfigError, match="fleet.autoscaling.max_replicas"):
        load_config(None, ["fleet.autoscaling={min_replicas: 3, max_replicas: 2}", "fleet.num_replicas=3"])
    with pytest.raises(ConfigError, match="fleet.num_replicas"):
        load_config(None, ["fleet.autoscaling={min_replicas: 3, max_replicas: 4}"])  # starts at 2


def test_the_fair_share_budget_and_server_info_follow_the_live_replicas():
    from contracts.control import Ping
    from deployments.api import make_app
    from deployments.control.fair_share import FairShare
    from tests.support.fake_fleet import ADMIN, FakeBackend, api_settings

    class Shrinking(FakeBackend):
        live = 2

        async def broadcast(self, command):
            replies = await super().broadcast(command)
            return replies[: self.live] if isinstance(command, Ping) else replies

    backend = Shrinking()
    gate = FairShare(512, lambda run: 1.0)
    settings = api_settings(autoscaling=(1, 3), inflight_per_replica=256)
    client = TestClient(make_app(backend, settings, gate=gate))
    asyncio.run(client.app.state.upkeep.once())
    assert gate.budget == 512
    backend.live = 1  # a node went, or the fleet shrank
    asyncio.run(client.app.state.upkeep.once())
    assert gate.budget == 256
    spotrl = client.get("/server_info", headers=ADMIN).json()["spotrl"]
    assert spotrl["num_replicas"] == 1 and spotrl["autoscaling"] == {"min_replicas": 1, "max_replicas": 3}

    fixed = FairShare(100, lambda run: 1.0)  # a fixed fleet.inflight_budget stays what it is
    client = TestClient(make_app(backend, api_settings(inflight_budget=100), gate=fixed))
    asyncio.run(client.app.state.upkeep.once())
    assert fixed.budget == 100
