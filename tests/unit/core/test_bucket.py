"""Pure logic of core.bucket.store: URL and name rules, error classification, the retry loop.

No server here: stores are constructed (s3fs connects lazily) and their naming methods exercised;
the retry loop is driven with a fake failing function and a fake sleep.
"""

import os

import pytest
from botocore.exceptions import ClientError, EndpointConnectionError, ReadTimeoutError

from core.bucket.filesystem import (
    BucketError,
    InvalidName,
    VersionExists,
    is_precondition_failed,
    is_transient,
    make_filesystem,
)
from core.bucket.store import AdapterStore, CheckpointStore
from core.config import load_config
from tests.support.flaky import Flaky


def client_error(code: str, status: int, op: str = "PutObject") -> ClientError:
    return ClientError({"Error": {"Code": code, "Message": code}, "ResponseMetadata": {"HTTPStatusCode": status}}, op)


def wrapped(cause: BaseException, outer: BaseException) -> BaseException:
    """An exception the way s3fs raises it: a translated OSError whose __cause__ is botocore's."""
    outer.__cause__ = cause
    return outer


def test_errors_are_classified_as_s3fs_raises_them():
    assert is_transient(EndpointConnectionError(endpoint_url="http://127.0.0.1:1"))
    assert is_transient(ReadTimeoutError(endpoint_url="http://127.0.0.1:1"))
    assert is_transient(ConnectionRefusedError())
    assert is_transient(wrapped(client_error("SlowDown", 503), OSError(5, "SlowDown")))
    assert is_transient(wrapped(client_error("InternalError", 500), OSError(121, "InternalError")))
    assert is_transient(client_error("TooManyRequests", 429))
    assert is_transient(client_error("ConditionalRequestConflict", 409))
    assert not is_transient(wrapped(client_error("AccessDenied", 403), PermissionError("denied")))
    assert not is_transient(FileNotFoundError("bucket/key"))
    # SeaweedFS answers a lost create-only race with EINVAL, AWS with FileExistsError: both are a lost race.
    seaweed = wrapped(client_error("PreconditionFailed", 412), OSError(22, "pre-conditions"))
    assert is_precondition_failed(seaweed) and not is_transient(seaweed)
    assert is_precondition_failed(FileExistsError("MANIFEST.json"))
    assert not is_precondition_failed(OSError(22, "The specified bucket is not valid."))


@pytest.mark.parametrize(
    "url, scheme, root",
    [
        ("file:///tmp/b", "file", "/tmp/b"),
        ("file://runs/x/bucket", "file", os.path.join(os.getcwd(), "runs/x/bucket")),
        ("runs/x/bucket", "file", os.path.join(os.getcwd(), "runs/x/bucket")),
        ("s3://bkt/a/b/", "s3", "bkt/a/b"),
        ("s3://bkt", "s3", "bkt"),
    ],
)
def test_bucket_urls(url, scheme, root):
    fs, got = make_filesystem(url)
    assert got == root
    assert ("s3" in type(fs).__name__.lower()) == (scheme == "s3")


@pytest.mark.parametrize("url", ["gs://bkt/x", "s3://", "s3://bkt/../x", "s3://bkt//x", "file://", ""])
def test_bad_bucket_urls_are_refused(url):
    with pytest.raises(InvalidName):
        AdapterStore(url)


@pytest.mark.parametrize("url", ["s3://bkt/run", "file:///tmp/spotrl-unit/bucket", "file://runs/r/bucket"])
def test_resolve_accepts_our_names_and_urls(url):
    store = AdapterStore(url)
    assert store.resolve("policy-v3") == 3
    assert store.resolve("policy-v0") == 0
    assert store.resolve("adapters/policy-v12") == 12
    assert store.resolve("policy-v3/") == 3
    assert store.resolve(store.url_of(7)) == 7
    assert store.resolve(store.url_of(7) + "/") == 7
    if url.startswith("file://runs"):  # the relative spelling of the same place
        assert store.resolve("file://runs/r/bucket/adapters/policy-v5") == 5


@pytest.mark.parametrize(
    "ref",
    [
        "policy-v03", "policy-v-1", "policy-v", "policy-3", "Policy-v3", "step-3", "policy-v3.0", " policy-v3",
        "../policy-v3", "adapters/../adapters/policy-v3", "adapters/policy-v3/../policy-v4", "/adapters/policy-v3",
        "checkpoints/policy-v3", "x/adapters/policy-v3", "adapters/policy-v3/MANIFEST.json", "adapters\\policy-v3",
        "s3://other/run/adapters/policy-v3", "s3://bkt/run/adapters/../adapters/policy-v3", "s3://bkt/adapters/policy-v3",
        "s3://bkt/run/checkpoints/policy-v3", "file:///bkt/run/adapters/policy-v3", "http://bkt/run/adapters/policy-v3",
        "", 3, None,
    ],
)  # fmt: skip
def test_resolve_refuses_everything_else(ref):
    with pytest.raises(InvalidName):
        AdapterStore("s3://bkt/run").resolve(ref)


def test_url_of_and_bad_numbers():
    assert AdapterStore("s3://bkt/run").url_of(3) == "s3://bkt/run/adapters/policy-v3"
    assert CheckpointStore("file:///tmp/b").url_of(40) == "file:///tmp/b/checkpoints/step-40"
    for bad in (-1, True, "3", 1.0, None):
        with pytest.raises(InvalidName):
            AdapterStore("s3://bkt/run").url_of(bad)


def test_from_config_fills_run_name_and_bucket_settings():
    cfg = load_config(None, ["bucket.url=s3://bkt/{run_name}", "bucket.max_attempts=3", "logging.run_name=r1"])
    store = CheckpointStore.from_config(cfg)
    assert store.url_of(1) == "s3://bkt/r1/checkpoints/step-1"
    assert store.max_attempts == 3


def store_with_fake_sleep(**kwargs) -> tuple[AdapterStore, list[float]]:
    store = AdapterStore("s3://bkt/run", **kwargs)
    pauses: list[float] = []
    store._sleep = pauses.append
    return store, pauses


def test_retry_backs_off_exponentially_then_succeeds():
    store, pauses = store_with_fake_sleep(max_attempts=6, backoff_s=0.1)
    flaky = Flaky(4, EndpointConnectionError(endpoint_url="http://127.0.0.1:1"))
    assert store._retry("publish", "s3://bkt/run", "upload", flaky) == "ok"
    assert flaky.calls == 5 and len(pauses) == 4
    for i, pause in enumerate(pauses):  # 0.1 * 2**i, jittered by 0.5x..1.5x
        assert 0.05 * 2**i <= pause <= 0.15 * 2**i


def test_retry_is_bounded_and_its_error_names_url_and_operation(monkeypatch):
    monkeypatch.setenv("AWS_SECRET_ACCESS_KEY", "do-not-leak-this-secret")
    store, pauses = store_with_fake_sleep(max_attempts=3)
    error = wrapped(client_error("SlowDown", 503), OSError(5, "SlowDown do-not-leak-this-secret"))
    flaky = Flaky(10, error)
    with pytest.raises(BucketError) as info:
        store._retry("fetch", "s3://bkt/run/adapters/policy-v1", "download adapter_model.safetensors", flaky)
    message = str(info.value)
    assert flaky.calls == 3 and len(pauses) == 2
    assert message.startswith(
        "fetch s3://bkt/run/adapters/policy-v1: download adapter_model.safetensors failed after 3"
    )
    assert "do-not-leak" not in message and info.value.__cause__ is None


def test_retry_does_not_retry_what_a_retry_cannot_fix():
    store, pauses = store_with_fake_sleep()
    flaky = Flaky(1, wrapped(client_error("AccessDenied", 403), PermissionError("Forbidden")))
    with pytest.raises(PermissionError):
        store._retry("publish", "s3://bkt/run", "upload", flaky)
    assert flaky.calls == 1 and pauses == []


def test_error_hierarchy_lets_callers_catch_broadly_or_precisely():
    assert issubclass(VersionExists, BucketError) and issubclass(BucketError, RuntimeError)
    assert issubclass(InvalidName, ValueError)


def test_publish_refuses_a_folder_that_is_not_an_adapter(tmp_path):
    store = AdapterStore(f"file://{tmp_path}/bucket")
    (tmp_path / "a").mkdir()
    with pytest.raises(BucketError, match="adapter_config.json"):
        store.publish(tmp_path / "a", 1)
    (tmp_path / "a" / "adapter_config.json").write_text("{}")
    with pytest.raises(BucketError, match="adapter_model"):
        store.publish(tmp_path / "a", 1)
    assert store.versions() == []


def _adapter(folder, weights: bytes):
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "adapter_config.json").write_text('{"r": 1}')
    (folder / "adapter_model.safetensors").write_bytes(weights)
    return folder


def test_a_cached_folder_held_by_another_process_is_never_pruned_until_that_process_lets_go_or_dies(tmp_path):
    """The replicas of one node share the cache and each prunes it: none deletes what another serves from; a replica
    that is preempted (killed) holds nothing any more."""
    import subprocess
    import sys

    store = AdapterStore(f"file://{tmp_path}/bucket", cache_dir=tmp_path / "cache")
    for v in (1, 2, 3):
        store.publish(_adapter(tmp_path / f"v{v}", f"weights {v}".encode()), v)
    mine = store.fetch_held(1)
    other = store.fetch(2)
    holder = subprocess.Popen(  # another replica of the node, serving v2
        [
            sys.executable,
            "-c",
            "import fcntl, os, sys; fd = os.open(sys.argv[1], os.O_RDONLY); "
            "fcntl.flock(fd, fcntl.LOCK_SH); print('held', flush=True); sys.stdin.read()",
            str(other),
        ],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        text=True,
    )
    try:
        assert holder.stdout.readline() == "held\n"
        assert store.prune_cache(keep=0) == [] and mine.path.is_dir() and other.is_dir()
        assert not store.drop_cache() and store.cache_usage()[0] == 2
        holder.kill()  # preempted
        holder.wait()
        assert store.prune_cache(keep=0) == [other] and mine.path.is_dir()
        mine.release()
        assert store.drop_cache()  # a run that left: nothing of its prefix stays in the cache
        assert list((tmp_path / "cache").iterdir()) == [] and store.cache_usage() == (0, 0)
    finally:
        holder.kill()


def test_a_folder_pruned_between_its_fetch_and_its_hold_is_fetched_again(tmp_path, monkeypatch):
    import core.bucket.fetching as fetching
    import core.bucket.store as store_module

    store = AdapterStore(f"file://{tmp_path}/bucket", cache_dir=tmp_path / "cache")
    store.publish(_adapter(tmp_path / "v1", b"weights"), 1)
    real_hold, pruned = fetching.hold, []

    def hold_after_a_prune(folder):
        if not pruned:  # another replica prunes it just as this one fetched it
            pruned.append(fetching.remove_unheld(folder))
        return real_hold(folder)

    monkeypatch.setattr(store_module, "hold", hold_after_a_prune)
    held = store.fetch_held(1)
    assert pruned == [True] and (held.path / "adapter_model.safetensors").read_bytes() == b"weights"
    held.release()


def test_a_runs_ema_lineage_sits_beside_its_policy_and_each_lists_collects_and_resolves_its_own(tmp_path):
    from core.bucket.store import EmaAdapterStore, adapter_store

    url = f"file://{tmp_path}/bucket"
    policy, ema = AdapterStore(url, cache_dir=tmp_path / "cache"), EmaAdapterStore(url, cache_dir=tmp_path / "cache")
    assert adapter_store("ema") is EmaAdapterStore and adapter_store("policy") is AdapterStore
    folder = _ema_adapter(tmp_path)
    for v in (1, 2, 3):
        policy.publish(folder, v)
        ema.publish(folder, v)
    assert ema.url_of(2).endswith("/adapters/ema-v2") and ema.key_of(2) == "ema-v2"
    assert ema.gc(1) == [2, 1] and ema.versions() == [3] and policy.versions() == [3, 2, 1]  # gc: its own stem
    assert ema.resolve("adapters/ema-v3") == 3 and ema.resolve(ema.url_of(3)) == 3
    with pytest.raises(InvalidName):
        ema.resolve("adapters/policy-v3")
    with pytest.raises(InvalidName):
        policy.resolve("ema-v3")
    assert (ema.fetch(3) / "adapter_config.json").is_file()


def _ema_adapter(tmp_path):
    folder = tmp_path / "adapter"
    folder.mkdir()
    (folder / "adapter_config.json").write_text('{"r": 1, "lora_alpha": 2, "peft_type": "LORA"}')
    (folder / "adapter_model.safetensors").write_bytes(b"weights")
    return folder
