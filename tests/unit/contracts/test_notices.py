"""Spot notices (`contracts.notices`) against a fake metadata server on 127.0.0.1: AWS IMDSv2 and IMDSv1, GCP,
a scheduler's file, SIGTERM; the watcher reports each kind once and gives up at once where nothing answers."""

import os
import signal
import threading
import time

import pytest

from contracts.notice_sources import AwsMetadata, GcpMetadata, MetadataError, NoticeFile
from contracts.notice_watcher import NoticeWatcher
from contracts.notices import Notice
from tests.support.fake_metadata import TOKEN, FakeMetadata
from tests.support.fleet_helpers import free_port


@pytest.fixture
def metadata(monkeypatch):
    with FakeMetadata() as server:
        for key, value in server.env().items():
            monkeypatch.setenv(key, value)
        yield server


def test_aws_imdsv2_fetches_a_token_once_and_reads_the_instance_action_and_the_rebalance(metadata):
    aws = AwsMetadata()  # the endpoint comes from AWS_EC2_METADATA_SERVICE_ENDPOINT, as botocore's does
    assert aws.endpoint == f"http://127.0.0.1:{metadata.port}"
    assert aws.probe() and aws.poll() is None
    metadata.aws_rebalance()
    rebalance = aws.poll()
    assert rebalance.source == "aws-rebalance" and not rebalance.binding and rebalance.deadline is None
    metadata.aws_notice(in_s=120)
    notice = aws.poll()
    assert notice.source == "aws" and notice.binding and 100 < notice.remaining_s() <= 121
    puts = [r for r in metadata.requests if r[0] == "PUT"]
    gets = [r for r in metadata.requests if r[0] == "GET"]
    assert len(puts) == 1 and all(r[2].get("x-aws-ec2-metadata-token") == TOKEN for r in gets)


def test_aws_falls_back_to_imdsv1_where_tokens_are_refused(monkeypatch):
    with FakeMetadata(refuse_tokens=True) as server:
        monkeypatch.setenv("AWS_EC2_METADATA_SERVICE_ENDPOINT", server.env()["AWS_EC2_METADATA_SERVICE_ENDPOINT"])
        aws = AwsMetadata()
        assert aws.probe()
        server.aws_notice(in_s=60, action="stop")
        notice = aws.poll()
        assert notice.source == "aws" and "stop" in notice.detail and 40 < notice.remaining_s() <= 61
        assert [r[1] for r in server.requests if r[0] == "PUT"] == ["/latest/api/token"]  # asked once, then v1


def test_a_failed_token_request_leaves_an_imdsv2_only_instance_heard_not_switched_to_imdsv1(metadata):
    """A throttled (429) or failing (503) token request is no sign that IMDSv2 is missing: the next poll asks for a
    token again, and an instance that answers IMDSv1 reads with 401 still gets its notice read."""
    aws = AwsMetadata()
    metadata.fail_tokens(429, 503)
    with pytest.raises(MetadataError):
        aws.poll()
    with pytest.raises(MetadataError):
        aws.poll()
    metadata.aws_notice(in_s=120)
    notice = aws.poll()
    assert notice is not None and notice.source == "aws"
    assert all(r[2].get("x-aws-ec2-metadata-token") == TOKEN for r in metadata.requests if r[0] == "GET")


def test_an_instance_that_wants_tokens_after_a_v1_fallback_is_read_with_a_token_again(metadata):
    aws = AwsMetadata()
    aws._v1 = True  # as after a token refusal
    metadata.aws_notice(in_s=120)
    assert aws.poll().source == "aws"  # its 401 to a plain GET: a token after all


def test_gcp_counts_the_deadline_from_the_last_poll_that_saw_no_notice(metadata):
    """The notice came somewhere between two polls: its 30 s run from the earlier one, never from when it was seen."""
    gcp = GcpMetadata(interval_s=5.0)
    before = time.time()
    assert gcp.poll() is None
    time.sleep(1.0)
    metadata.gcp_preempt()
    notice = gcp.poll()
    assert notice.deadline == pytest.approx(before + 30.0, abs=0.2)
    first = GcpMetadata(interval_s=5.0).poll()  # seen at the first poll: from one poll interval before it
    assert first.deadline == pytest.approx(time.time() - 5.0 + 30.0, abs=0.5)


class FlakySource:
    """A notice source that raises what Ray's GCS client raises when the GCS is out of reach, then a notice."""

    name = "flaky"

    def __init__(self, failures: int):
        self.failures, self.polls = failures, 0

    def probe(self) -> bool:
        return True

    def poll(self):
        self.polls += 1
        if self.polls <= self.failures:
            raise RuntimeError("failed to connect to GCS (RpcError)")
        return Notice("ray-drain", time.time() + 30.0, "draining") if self.polls == self.failures + 1 else None

    def close(self) -> None:
        pass


def test_a_source_that_errs_is_asked_again_with_backoff_and_the_others_keep_being_watched(metadata):
    flaky = FlakySource(failures=2)
    seen: list[Notice] = []
    heard = threading.Event()
    watcher = NoticeWatcher([lambda n: (seen.append(n), heard.set())], interval_s=0.05, sources=[flaky, AwsMetadata()])
    watcher.start()
    assert heard.wait(5), "an erring source ended the watching"
    assert [n.source for n in seen] == ["ray-drain"] and flaky.polls == 3 and watcher._thread.is_alive()
    watcher.clear(seen[0])  # the node stayed: the watcher watches for the next notice, AWS's included
    heard.clear()
    metadata.aws_notice(in_s=120)
    assert heard.wait(5) and [n.source for n in seen] == ["ray-drain", "aws"]
    watcher.stop()


def test_gcp_reads_preempted_and_terminating_maintenance_but_not_a_live_migration(metadata):
    gcp = GcpMetadata()
    assert gcp.host == f"127.0.0.1:{metadata.port}" and gcp.probe() and gcp.poll() is None
    metadata.gcp_maintenance("MIGRATE_ON_HOST_MAINTENANCE")
    assert gcp.poll() is None  # a live migration: the VM stays
    metadata.gcp_maintenance()
    assert gcp.poll().source == "gcp-maintenance"
    metadata.gcp_preempt()
    notice = gcp.poll()
    assert notice.source == "gcp" and 25 < notice.remaining_s() <= 30


def test_a_metadata_server_of_the_other_cloud_is_not_taken_for_gcp(monkeypatch):
    with FakeMetadata(cloud="aws") as server:
        monkeypatch.setenv("GCE_METADATA_HOST", server.env()["GCE_METADATA_HOST"])
        assert not GcpMetadata().probe()


def test_a_schedulers_file_is_a_notice_with_its_deadline_or_the_default_grace(tmp_path):
    path = tmp_path / "preempt"
    source = NoticeFile(path, default_grace_s=30.0)
    assert source.probe() and source.poll() is None
    path.write_text("")
    assert 25 < source.poll().remaining_s() <= 30
    path.write_text('{"in_s": 90}')
    assert 85 < source.poll().remaining_s() <= 90
    path.write_text(f'{{"deadline": {time.time() + 10}}}')
    assert 5 < source.poll().remaining_s() <= 10


def test_the_watcher_reports_a_recommendation_then_the_interruption_each_once_and_stops(metadata):
    seen: list[Notice] = []
    got_binding = threading.Event()

    def handler(notice):
        seen.append(notice)
        if notice.binding:
            got_binding.set()

    watcher = NoticeWatcher([handler], interval_s=0.05).start()
    time.sleep(0.3)
    assert seen == []
    metadata.aws_rebalance()
    time.sleep(0.3)
    metadata.aws_notice(in_s=120)
    assert got_binding.wait(5)
    time.sleep(0.3)
    assert [n.source for n in seen] == ["aws-rebalance", "aws"]  # each once, though every poll still sees them
    asked = len(metadata.requests)
    time.sleep(0.3)
    assert len(metadata.requests) == asked  # the machine is going: nothing more to poll for
    watcher.stop()
    watcher._thread.join(5)
    assert not watcher._thread.is_alive()


def test_where_no_metadata_service_answers_the_watcher_gives_up_at_once(monkeypatch):
    closed = free_port()
    monkeypatch.setenv("AWS_EC2_METADATA_SERVICE_ENDPOINT", f"http://127.0.0.1:{closed}")
    monkeypatch.setenv("GCE_METADATA_HOST", f"127.0.0.1:{closed}")
    started = time.monotonic()
    watcher = NoticeWatcher([lambda n: None], interval_s=5.0).start()
    watcher._thread.join(5)
    assert not watcher._thread.is_alive() and time.monotonic() - started < 2


def test_sigterm_is_a_notice_with_its_grace_and_the_previous_handler_still_runs(monkeypatch):
    earlier: list[int] = []
    previous = signal.signal(signal.SIGTERM, lambda signum, frame: earlier.append(signum))
    try:
        closed = free_port()
        monkeypatch.setenv("AWS_EC2_METADATA_DISABLED", "true")
        monkeypatch.setenv("GCE_METADATA_HOST", f"127.0.0.1:{closed}")
        seen: list[Notice] = []
        NoticeWatcher([seen.append], sigterm_grace_s=30.0)
        os.kill(os.getpid(), signal.SIGTERM)
        time.sleep(0.1)
        assert [n.source for n in seen] == ["sigterm"] and 25 < seen[0].remaining_s() <= 30
        assert earlier == [signal.SIGTERM]
    finally:
        signal.signal(signal.SIGTERM, previous)


def test_a_process_that_must_checkpoint_first_lives_on_after_its_first_sigterm():
    """The learner's (`chain_sigterm=False`): the first SIGTERM is a notice only, the second does what SIGTERM did."""
    earlier: list[int] = []
    previous = signal.signal(signal.SIGTERM, lambda signum, frame: earlier.append(signum))
    try:
        seen: list[Notice] = []
        NoticeWatcher([seen.append], sources=[], sigterm_grace_s=30.0, chain_sigterm=False)
        os.kill(os.getpid(), signal.SIGTERM)
        deadline = time.monotonic() + 5
        while not seen and time.monotonic() < deadline:
            time.sleep(0.01)
        assert [n.source for n in seen] == ["sigterm"] and earlier == []
        os.kill(os.getpid(), signal.SIGTERM)
        time.sleep(0.1)
        assert earlier == [signal.SIGTERM] and len(seen) == 1
    finally:
        signal.signal(signal.SIGTERM, previous)


def test_the_drivers_first_sigterm_is_a_notice_and_a_second_stops_at_once(monkeypatch):
    from app.spot import DriverNotices
    from core.config import SpotConfig

    closed = free_port()
    monkeypatch.setenv("AWS_EC2_METADATA_SERVICE_ENDPOINT", f"http://127.0.0.1:{closed}")
    monkeypatch.setenv("GCE_METADATA_HOST", f"127.0.0.1:{closed}")
    previous = signal.getsignal(signal.SIGTERM)
    try:
        notices = DriverNotices(SpotConfig(sigterm_grace_s=20.0)).start()
        os.kill(os.getpid(), signal.SIGTERM)
        time.sleep(0.1)
        assert notices.binding.source == "sigterm" and 15 < notices.binding.remaining_s() <= 20
        with pytest.raises(KeyboardInterrupt):
            os.kill(os.getpid(), signal.SIGTERM)
            time.sleep(0.5)
        off = DriverNotices(SpotConfig(watch=False))  # not watching: SIGTERM stops the run as Ctrl-C does
        assert off.binding is None
        with pytest.raises(KeyboardInterrupt):
            os.kill(os.getpid(), signal.SIGTERM)
            time.sleep(0.5)
    finally:
        signal.signal(signal.SIGTERM, previous)


def test_the_driver_hears_its_machines_cloud_notice(metadata):
    from app.spot import DriverNotices
    from core.config import SpotConfig

    previous = signal.getsignal(signal.SIGTERM)
    try:
        notices = DriverNotices(SpotConfig(poll_interval_s=0.05)).start()
        metadata.aws_notice(in_s=120)
        deadline = time.monotonic() + 5
        while notices.binding is None and time.monotonic() < deadline:
            time.sleep(0.05)
        assert notices.binding.source == "aws"
        notices.stop()
    finally:
        signal.signal(signal.SIGTERM, previous)


def test_only_a_notice_for_the_node_drains_it_in_ray():
    """A SIGTERM ends a process, not its node: Ray sends one to every worker of a job that ends, and a learner that
    drained its node then would leave the next run nowhere to start."""
    assert [Notice(s, None).drains_node for s in ("aws", "gcp", "gcp-maintenance", "file")] == [True] * 4
    assert [Notice(s, None).drains_node for s in ("sigterm", "ray-drain", "aws-rebalance")] == [False] * 3
