"""Joining a shared fleet (`app.fleet_run`) over real HTTP, against the fleet's own API on a fake backend: which
token makes the run whose, where it publishes, that it stays alive, and what it releases when it leaves."""

import threading
import time

import pytest

from app import fleet_run
from app.fleet_client import FleetClient
from core.config import load_config
from deployments.api import make_app
from tests.support.fake_fleet import BASE, TOKEN, FakeBackend, api_settings
from tests.support.fleet_helpers import free_port
from tests.support.served_app import served


@pytest.fixture
def fleet(tmp_path):
    """The fleet's FastAPI app served by uvicorn on 127.0.0.1, its registrations recorded under `tmp_path`."""
    from contracts.retry import Backoff
    from core.bucket.records import RunRecords

    records = RunRecords(f"file://{tmp_path}/bucket", backoff=Backoff(attempts=1, first_s=0.0))
    backend = FakeBackend()
    app = make_app(backend, api_settings(max_loras=7, max_staleness=1, run_idle_timeout_s=2.0), None, records)
    with served(app) as url:
        yield url, backend, tmp_path


def _cfg(url, name="alice"):
    return load_config(None, [f"join.url={url}", f"logging.run_name={name}"])


def _admin(url):
    return FleetClient(url, token=TOKEN)


def test_with_the_admin_token_the_driver_registers_its_run_publishes_under_its_prefix_and_removes_it(
    fleet, monkeypatch
):
    url, _, work = fleet
    monkeypatch.delenv(fleet_run.RUN_TOKEN_ENV, raising=False)
    monkeypatch.setenv("SPOTRL_ADMIN_TOKEN", TOKEN)
    cfg = _cfg(url)
    run = fleet_run.join(cfg, BASE)
    assert run.name == "alice" and run.registered_with is not None and run.token.value.startswith("spotrl-run-")
    assert _admin(url).list_runs() == ["alice"]
    fleet_run.publish_to_fleet_bucket(cfg, run)
    assert cfg.bucket_url == f"file://{work}/bucket/runs/alice"
    assert cfg.fleet_run == "alice"
    fleet_run.leave(run)
    assert _admin(url).list_runs() == []


def test_a_handed_over_token_must_be_this_runs_and_its_run_stays_registered_with_its_adapters_unloaded(
    fleet, monkeypatch
):
    url, backend, _ = fleet
    token = _admin(url).register_run("alice", max_staleness=2)["token"]  # the run's own rollout.max_staleness
    monkeypatch.setenv(fleet_run.RUN_TOKEN_ENV, token)
    with pytest.raises(SystemExit, match="belongs to run 'alice', not logging.run_name='bob'"):
        fleet_run.join(_cfg(url, "bob"), BASE)
    run = fleet_run.join(_cfg(url), BASE)
    assert run.registered_with is None and run.token.value == token
    client = FleetClient(url, token=token)
    client.load_adapter("alice/policy-v1", "policy-v1")
    assert "alice/policy-v1" in {m["id"] for m in client.models()}
    fleet_run.leave(run)
    assert {m["id"] for m in client.models()} == {BASE}
    assert _admin(url).list_runs() == ["alice"]  # the admin who registered it removes it


def test_a_run_states_its_rank_and_window_and_a_registration_that_cannot_hold_them_is_refused(fleet, monkeypatch):
    """The driver registers with its own `rollout.max_staleness` and `lora.rank`; a token the admin registered for a
    smaller window or rank would have the fleet unpin versions the run still samples, or refuse its adapters."""
    url, _, _ = fleet
    monkeypatch.delenv(fleet_run.RUN_TOKEN_ENV, raising=False)
    monkeypatch.setenv("SPOTRL_ADMIN_TOKEN", TOKEN)
    run = fleet_run.join(_cfg(url), BASE)
    info = FleetClient(url, token=run.token.value).run_info("alice")
    assert (info["max_staleness"], info["lora_rank"]) == (2, 8)  # tiny-cpu's rollout.max_staleness and lora.rank
    fleet_run.leave(run)
    for terms, message in (
        ({"max_staleness": 1}, "rollout.max_staleness=2: run 'alice' is registered .* with max_staleness 1"),
        ({"max_staleness": 2, "lora_rank": 4}, "lora.rank=8: run 'alice' is registered .* with lora_rank 4"),
    ):
        monkeypatch.setenv(fleet_run.RUN_TOKEN_ENV, _admin(url).register_run("alice", **terms)["token"])
        with pytest.raises(SystemExit, match=message):
            fleet_run.join(_cfg(url), BASE)
        _admin(url).remove_run("alice")


def test_a_run_with_an_ema_teacher_registers_two_lineages_and_a_token_registered_for_one_is_refused(fleet, monkeypatch):
    """An `ema` self teacher's learner publishes `ema-vN` beside `policy-vN`: the driver registers both lineages'
    windows, and a token the admin registered for one would leave the average's slots uncounted."""
    url, _, _ = fleet
    ema = "objectives=[{kind: distill, teacher: {self: {model: ema, context: '{answer} {prompt}'}}}]"
    monkeypatch.delenv(fleet_run.RUN_TOKEN_ENV, raising=False)
    monkeypatch.setenv("SPOTRL_ADMIN_TOKEN", TOKEN)
    cfg = load_config(None, [f"join.url={url}", "logging.run_name=alice", "rollout.max_staleness=1", ema])
    run = fleet_run.join(cfg, BASE)
    assert FleetClient(url, token=run.token.value).run_info("alice")["lineages"] == 2
    fleet_run.leave(run)
    monkeypatch.setenv(fleet_run.RUN_TOKEN_ENV, _admin(url).register_run("alice", max_staleness=1)["token"])
    with pytest.raises(SystemExit, match="registered .* with lineages 1; have the admin register it with lineages 2"):
        fleet_run.join(cfg, BASE)


def test_joining_without_a_token_or_with_a_name_taken_says_what_to_do(fleet, monkeypatch):
    url, _, _ = fleet
    monkeypatch.delenv(fleet_run.RUN_TOKEN_ENV, raising=False)
    monkeypatch.delenv("SPOTRL_ADMIN_TOKEN", raising=False)
    with pytest.raises(SystemExit, match="needs SPOTRL_RUN_TOKEN .* or SPOTRL_ADMIN_TOKEN"):
        fleet_run.join(_cfg(url), BASE)
    monkeypatch.setenv("SPOTRL_ADMIN_TOKEN", TOKEN)
    fleet_run.join(_cfg(url), BASE)
    with pytest.raises(SystemExit, match="registering run 'alice'.*already registered"):
        fleet_run.join(_cfg(url), BASE)
    monkeypatch.setenv(fleet_run.RUN_TOKEN_ENV, TOKEN)
    with pytest.raises(SystemExit, match="SPOTRL_RUN_TOKEN is not a run token"):
        fleet_run.join(_cfg(url), BASE)
    monkeypatch.setenv(fleet_run.RUN_TOKEN_ENV, "spotrl-run-not-a-token-of-this-fleet")
    with pytest.raises(SystemExit, match="SPOTRL_RUN_TOKEN on .*: 401 missing or invalid token"):
        fleet_run.join(_cfg(url), BASE)


def test_a_fleet_of_another_base_model_is_refused_and_the_run_registered_for_it_removed(fleet, monkeypatch):
    url, _, _ = fleet
    monkeypatch.delenv(fleet_run.RUN_TOKEN_ENV, raising=False)
    monkeypatch.setenv("SPOTRL_ADMIN_TOKEN", TOKEN)
    with pytest.raises(SystemExit, match=f"model.name_or_path: the fleet at {url} serves another base model"):
        fleet_run.join(_cfg(url), "/models/another")
    assert _admin(url).list_runs() == []
    # With a handed-over token nothing is released: the run may be training from another driver.
    token = _admin(url).register_run("alice")["token"]
    monkeypatch.setenv(fleet_run.RUN_TOKEN_ENV, token)
    with pytest.raises(SystemExit, match="another base model"):
        fleet_run.join(_cfg(url), "/models/another")
    assert _admin(url).list_runs() == ["alice"]
    # What a driver checks of a fleet it finds running in its Ray cluster.
    fleet_run.check_base_model(_admin(url), BASE, None)
    with pytest.raises(SystemExit, match="another base model"):
        fleet_run.check_base_model(_admin(url), "/models/another", None)


def test_the_heartbeat_keeps_a_quiet_run_alive_and_without_it_the_fleet_releases_the_run(fleet, monkeypatch):
    url, _, _ = fleet
    monkeypatch.delenv(fleet_run.RUN_TOKEN_ENV, raising=False)
    monkeypatch.setenv("SPOTRL_ADMIN_TOKEN", TOKEN)
    alive = fleet_run.join(_cfg(url), BASE)
    assert alive.heartbeat_s == 0.5  # a quarter of the fleet's 2 s idle timeout
    with fleet_run.Heartbeat(alive) as beat:
        time.sleep(3.0)  # longer than the idle timeout, with no request of its own
        assert _admin(url).list_runs() == ["alice"]
    assert beat.beats >= 3
    time.sleep(2.5)  # silent now, as a driver that died
    assert _admin(url).list_runs() == []
    fleet_run.leave(alive)  # already released: a warning, no error


def test_a_run_the_admin_removes_while_it_trains_is_stopped_instead_of_waiting_for_groups_forever(fleet, monkeypatch):
    url, _, _ = fleet
    monkeypatch.delenv(fleet_run.RUN_TOKEN_ENV, raising=False)
    monkeypatch.setenv("SPOTRL_ADMIN_TOKEN", TOKEN)
    run = fleet_run.join(_cfg(url), BASE)
    lost = threading.Event()
    with fleet_run.Heartbeat(run, on_lost=lost.set) as beat:
        time.sleep(0.7)
        assert not lost.is_set()
        _admin(url).remove_run("alice")
        assert lost.wait(timeout=3.0)
    assert "401" in beat.lost


def test_leaving_a_fleet_that_cannot_be_reached_never_raises(caplog):
    run = fleet_run.FleetRun(
        f"http://127.0.0.1:{free_port()}", "alice", fleet_run.Secret("spotrl-run-x"), "file:///b", 600.0, None
    )
    fleet_run.leave(run)
    assert "the fleet releases it after 600 s" in caplog.text


def test_a_shared_fleet_run_needs_a_run_name_the_fleet_accepts_and_an_http_url():
    from core.config import ConfigError

    with pytest.raises(ConfigError, match="logging.run_name='Tiny CPU' cannot name a run of a shared fleet"):
        load_config(None, ["join.url=http://127.0.0.1:8000", "logging.run_name=Tiny CPU"])
    with pytest.raises(ConfigError, match="expected an http:// or https:// URL"):
        load_config(None, ["join.url=127.0.0.1:8000"])
    assert load_config(None, []).fleet_run is None
