"""The bucket on both backends, a file:// folder and a real SeaweedFS S3 server (tests/support/s3_server.py).

What must hold: a version exists only once committed, racing publishers get exactly one winner, a
crash (publisher or server) never leaves half a version, a corrupted file is refused with nothing
left in the cache, other processes see a commit at once, and names outside the prefix are refused.
"""

import hashlib
import json
import os
import subprocess
import sys
import textwrap
import threading
import time
from pathlib import Path

import pytest

from core.bucket.filesystem import BucketError, IntegrityError, InvalidName, VersionExists, VersionNotFound
from core.bucket.manifest import MANIFEST
from core.bucket.store import AdapterStore, CheckpointStore

REPO = Path(__file__).resolve().parents[2]


def make_adapter(folder: Path, seed: int, size: int = 64 * 1024) -> Path:
    """A PEFT-shaped adapter folder; the bucket treats the weights as opaque bytes."""
    folder.mkdir(parents=True, exist_ok=True)
    config = {"peft_type": "LORA", "r": 1, "lora_alpha": 2, "base_model_name_or_path": "tiny",
              "target_modules": ["v_proj", "q_proj"]}  # fmt: skip
    (folder / "adapter_config.json").write_text(json.dumps(config))
    (folder / "adapter_model.safetensors").write_bytes(hashlib.sha256(str(seed).encode()).digest() * (size // 32))
    return folder


def sha(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


def remote_files(store, number: int) -> list[str]:
    """Every object under a version's folder, relative to it (what a listing of the bucket shows)."""
    base = store._path(number)
    # s3fs answers find() on an emptied prefix with the prefix itself (SeaweedFS keeps empty folders).
    return sorted(p[len(base) + 1 :] for p in store._fs.find(base) if p != base)


def run_child(code: str, *args: str, **popen) -> subprocess.Popen:
    """Another process on this machine (a replica, a second learner) running `code` with the same env."""
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    return subprocess.Popen(
        [sys.executable, "-c", textwrap.dedent(code), *args], env=env, cwd=REPO, text=True,
        stdout=subprocess.PIPE, stderr=subprocess.PIPE, **popen,
    )  # fmt: skip


@pytest.fixture
def cache(tmp_path) -> Path:
    return tmp_path / "cache"


def test_publish_versions_fetch_gc_round_trip(bucket_url, tmp_path, cache):
    store = AdapterStore(bucket_url, cache_dir=cache)
    assert store.versions() == [] and store.latest() is None
    for v in (1, 2, 3):
        manifest = store.publish(make_adapter(tmp_path / f"a{v}", seed=v), v)
    assert manifest["name"] == "policy-v3" and manifest["lora_rank"] == 1
    assert manifest["base_model"] == "tiny" and manifest["target_modules"] == ["q_proj", "v_proj"]
    assert set(manifest["files"]) == {"adapter_config.json", "adapter_model.safetensors"}
    assert store.versions() == [3, 2, 1] and store.latest() == 3

    path = store.fetch(2)
    assert sha(path / "adapter_model.safetensors") == sha(tmp_path / "a2" / "adapter_model.safetensors")
    assert json.loads((path / MANIFEST).read_text())["version"] == 2
    assert store.fetch(2) == path  # idempotent: the verified folder is reused
    explicit = store.fetch(3, tmp_path / "dest")
    assert explicit == tmp_path / "dest" and (explicit / "adapter_config.json").is_file()
    assert store.fetch(3, tmp_path / "dest") == explicit
    latest = store.fetch(3)
    assert store.prune_cache(keep=1) == [path]  # a replica's disk keeps only what it may still serve
    assert latest.is_dir() and not path.exists()

    with pytest.raises(VersionExists):
        store.publish(tmp_path / "a1", 3)
    assert store.gc(keep=2) == [1]
    assert store.versions() == [3, 2]
    assert remote_files(store, 1) == []
    with pytest.raises(VersionNotFound):
        store.fetch(1)
    assert store.gc(keep=2) == []


def test_sixteen_racing_publishers_have_exactly_one_winner(bucket_url, tmp_path, cache):
    n = 16
    stores = [AdapterStore(bucket_url, cache_dir=cache) for _ in range(n)]
    folders = [make_adapter(tmp_path / f"p{i}", seed=100 + i) for i in range(n)]
    for store in stores:
        store.versions()  # open every client first, so the race is on the commit, not on start-up
    start = threading.Barrier(n)
    outcome: list = [None] * n

    def publish(i: int) -> None:
        start.wait()
        try:
            outcome[i] = stores[i].publish(folders[i], 1)
        except BaseException as exc:  # noqa: BLE001 - recorded and checked below
            outcome[i] = exc

    threads = [threading.Thread(target=publish, args=(i,)) for i in range(n)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    winners = [i for i, o in enumerate(outcome) if isinstance(o, dict)]
    assert len(winners) == 1, outcome
    assert all(isinstance(o, VersionExists) for i, o in enumerate(outcome) if i != winners[0]), outcome
    (w,) = winners
    fetched = stores[0].fetch(1)
    assert sha(fetched / "adapter_model.safetensors") == sha(folders[w] / "adapter_model.safetensors")
    # Losers removed their uploads: only the winner's commit and the manifest remain.
    commit = outcome[w]["commit"]
    assert set(remote_files(stores[0], 1)) == {
        MANIFEST, f"{commit}/adapter_config.json", f"{commit}/adapter_model.safetensors"
    }  # fmt: skip


KILLABLE_PUBLISHER = """
    import sys, time
    from core.bucket.store import AdapterStore
    store = AdapterStore(sys.argv[1], max_attempts=2, backoff_s=0.05)
    upload = store._upload
    def upload_then_hang(source, remote):
        upload(source, remote)
        print("uploaded", remote, flush=True)
        time.sleep(120)  # the parent kills us here, between the first file and the commit
    store._upload = upload_then_hang
    store.publish(sys.argv[2], 1)
"""


def test_publisher_killed_mid_publish_leaves_no_version_and_a_retry_succeeds(bucket_url, tmp_path, cache):
    folder = make_adapter(tmp_path / "a", seed=1)
    child = run_child(KILLABLE_PUBLISHER, bucket_url, str(folder))
    line = child.stdout.readline()
    assert line.startswith("uploaded"), child.stderr.read()
    child.kill()
    child.wait()

    store = AdapterStore(bucket_url, cache_dir=cache)
    assert store.versions() == []
    assert remote_files(store, 1) != []  # half a publish is in the bucket, and invisible
    with pytest.raises(VersionNotFound):
        store.fetch(1)
    manifest = store.publish(folder, 1)
    assert store.versions() == [1]
    assert sha(store.fetch(1) / "adapter_model.safetensors") == manifest["files"]["adapter_model.safetensors"]["sha256"]


@pytest.mark.parametrize("kill_at", ["after_first_file", "before_manifest"])
def test_s3_server_killed_mid_publish_then_restarted(s3_server, s3_bucket_url, tmp_path, cache, kill_at):
    folder = make_adapter(tmp_path / "a", seed=1)
    store = AdapterStore(s3_bucket_url, cache_dir=cache, max_attempts=3, backoff_s=0.05)
    store.publish(make_adapter(tmp_path / "a0", seed=0), 0)
    hooked = "_upload" if kill_at == "after_first_file" else "_create_only"
    original = getattr(store, hooked)

    def kill_server(*args):
        if kill_at == "after_first_file":  # the first file lands, then the server dies under the second
            original(*args)
            setattr(store, hooked, original)
            s3_server.kill()
            return None
        s3_server.kill()  # every data file landed; the manifest write meets a dead server
        return original(*args)

    setattr(store, hooked, kill_server)
    try:
        with pytest.raises(BucketError) as info:
            store.publish(folder, 1)
        assert "publish" in str(info.value) and s3_bucket_url in str(info.value)
    finally:
        setattr(store, hooked, original)
        s3_server.start()  # same data folder, same ports
    assert store.versions() == [0]  # absent, never partial; and the old version survived the crash
    with pytest.raises(VersionNotFound):
        store.fetch(1)
    store.publish(folder, 1)
    assert store.versions() == [1, 0]
    assert sha(store.fetch(1) / "adapter_model.safetensors") == sha(folder / "adapter_model.safetensors")


def test_s3_outage_shorter_than_the_retries_is_ridden_over(s3_server, s3_bucket_url, tmp_path, cache):
    folder = make_adapter(tmp_path / "a", seed=1)
    store = AdapterStore(s3_bucket_url, cache_dir=cache, max_attempts=8, backoff_s=0.2)
    upload = store._upload
    restarter = threading.Timer(1.0, s3_server.start)

    def upload_then_crash(source, remote):
        upload(source, remote)
        store._upload = upload
        s3_server.kill()
        restarter.start()

    store._upload = upload_then_crash
    try:
        store.publish(folder, 1)
    finally:
        restarter.join()
        s3_server.start()
    assert store.versions() == [1]
    assert sha(store.fetch(1) / "adapter_model.safetensors") == sha(folder / "adapter_model.safetensors")


@pytest.mark.parametrize("damage", ["flipped_byte", "truncated"])
def test_corrupted_file_is_refused_and_the_cache_holds_nothing_of_it(bucket_url, tmp_path, cache, damage):
    store = AdapterStore(bucket_url, cache_dir=cache)
    manifest = store.publish(make_adapter(tmp_path / "a", seed=1), 1)
    remote = store._path(1, manifest["commit"], "adapter_model.safetensors")
    data = store._fs.cat_file(remote)
    bad = data[:100] + bytes([data[100] ^ 1]) + data[101:] if damage == "flipped_byte" else data[:-1]
    store._fs.pipe_file(remote, bad)

    with pytest.raises(IntegrityError, match="adapter_model.safetensors") as info:
        store.fetch(1)
    assert bucket_url in str(info.value)
    leftovers = [p for p in cache.rglob("*") if "policy-v1" in p.name] if cache.exists() else []
    assert leftovers == []
    with pytest.raises(IntegrityError):
        store.fetch(1, tmp_path / "dest")
    assert not (tmp_path / "dest").exists()


SECOND_PROCESS = """
    import sys
    from core.bucket.store import AdapterStore
    store = AdapterStore(sys.argv[1])
    print(store.versions(), flush=True)       # warm: a listing cache, if there were one, is filled now
    store.publish(sys.argv[2], 1)
    print("published", flush=True)
    sys.stdin.readline()                       # the parent publishes version 2 meanwhile
    print(store.versions(), flush=True)
"""


def test_a_second_process_sees_a_new_version_at_once(bucket_url, tmp_path, cache):
    store = AdapterStore(bucket_url, cache_dir=cache)
    assert store.versions() == []  # warm this side too
    child = run_child(SECOND_PROCESS, bucket_url, str(make_adapter(tmp_path / "a1", seed=1)), stdin=subprocess.PIPE)
    try:
        assert child.stdout.readline().strip() == "[]", child.stderr.read()
        assert child.stdout.readline().strip() == "published", child.stderr.read()
        assert store.versions() == [1]
        store.publish(make_adapter(tmp_path / "a2", seed=2), 2)
        child.stdin.write("go\n")
        child.stdin.flush()
        assert child.stdout.readline().strip() == "[2, 1]", child.stderr.read()
    finally:
        child.kill()
        child.wait()


CONCURRENT_FETCHER = """
    import sys
    from core.bucket.store import AdapterStore
    store = AdapterStore(sys.argv[1], cache_dir=sys.argv[2])
    store.versions()                           # imports and client start-up done before the race
    print("ready", flush=True)
    sys.stdin.readline()
    print(store.fetch(1), flush=True)
"""


def test_processes_fetching_one_version_at_once_share_one_verified_folder(bucket_url, tmp_path, cache):
    store = AdapterStore(bucket_url, cache_dir=cache)
    store.publish(make_adapter(tmp_path / "a", seed=1, size=4 << 20), 1)
    children = [run_child(CONCURRENT_FETCHER, bucket_url, str(cache), stdin=subprocess.PIPE) for _ in range(2)]
    try:
        for child in children:
            assert child.stdout.readline().strip() == "ready", child.stderr.read()
        for child in children:
            child.stdin.write("go\n")
            child.stdin.flush()
        paths = [str(store.fetch(1))]  # this process races the two children
        for child in children:
            out, err = child.communicate(timeout=120)
            assert child.returncode == 0, err
            paths.append(out.strip())
    finally:
        for child in children:
            child.kill()
    assert len(set(paths)) == 1
    assert sha(Path(paths[0]) / "adapter_model.safetensors") == sha(tmp_path / "a" / "adapter_model.safetensors")
    assert [p.name for p in Path(paths[0]).parent.iterdir()] == [Path(paths[0]).name]  # no staging left behind


def test_bad_names_and_paths_outside_the_prefix_are_refused(bucket_url, tmp_path, cache):
    store = AdapterStore(bucket_url, cache_dir=cache)
    folder = make_adapter(tmp_path / "a", seed=1)
    for bad in (-1, "3", True, 2.0):
        with pytest.raises(InvalidName):
            store.publish(folder, bad)
    with pytest.raises(VersionNotFound):
        store.fetch(5)
    store.publish(folder, 1)
    assert store.resolve(store.url_of(1)) == 1
    for ref in ("policy-v01", "adapters/../checkpoints/step-1", store.url_of(1) + "/../policy-v2",
                bucket_url + "/../elsewhere/adapters/policy-v1", "s3://someone-else/adapters/policy-v1"):  # fmt: skip
        with pytest.raises(InvalidName):
            store.resolve(ref)

    # A manifest planted by someone else that points outside the folder is refused, and nothing is written.
    evil = {**json.loads(store._fs.cat_file(store._path(1, MANIFEST))), "name": "policy-v2"}
    evil["files"] = {"../../../escaped": {"size": 1, "sha256": "0" * 64}}
    store._fs.pipe_file(store._path(2, MANIFEST), json.dumps(evil).encode())
    assert 2 in store.versions()  # it is committed as far as listing goes
    with pytest.raises(IntegrityError, match="malformed"):
        store.fetch(2, tmp_path / "out" / "dest")
    assert not (tmp_path / "escaped").exists() and not (tmp_path / "out").exists()


def test_gc_sweeps_uploads_that_never_committed(bucket_url, tmp_path, cache):
    store = AdapterStore(bucket_url, cache_dir=cache)
    store._fs.pipe_file(store._path(1, "0123456789ab", "adapter_model.safetensors"), b"orphan")
    for v in (2, 3, 4):
        store.publish(make_adapter(tmp_path / f"a{v}", seed=v), v)
    store._fs.pipe_file(store._path(5, "0123456789ab", "adapter_model.safetensors"), b"in progress")
    assert store.versions() == [4, 3, 2]
    assert store.gc(keep=2) == [2]
    assert remote_files(store, 1) == [] and remote_files(store, 2) == []
    assert remote_files(store, 5) != []  # newer than anything kept: may be a publish in progress


def test_one_version_is_deleted_manifest_first_and_deleting_it_again_is_no_error(bucket_url, tmp_path, cache):
    store = AdapterStore(bucket_url, cache_dir=cache)
    for v in (1, 2, 3):
        store.publish(make_adapter(tmp_path / f"a{v}", seed=v), v)
    store.delete(2)
    assert store.versions() == [3, 1] and remote_files(store, 2) == []
    with pytest.raises(VersionNotFound):
        store.fetch(2)
    store.delete(2)  # gone already: as a racing gc would have left it
    with pytest.raises(InvalidName):
        store.delete(-1)


def test_json_records_are_written_read_listed_and_removed_whole(bucket_url):
    from contracts.retry import Backoff
    from core.bucket.records import JsonRecords

    records = JsonRecords(bucket_url, "tinker/paths", backoff=Backoff(attempts=2, first_s=0.0))
    assert records.all() == [] and records.get("a") is None  # no folder yet
    records.delete("a")  # nothing to remove is no error
    records.put("a", {"n": 1})
    records.put("b", {"n": 2})
    records.put("a", {"n": 3})  # the newest write of a name wins
    assert records.get("a") == {"n": 3} and sorted(r["n"] for r in records.all()) == [2, 3]
    records.delete("a")
    assert records.get("a") is None and records.all() == [{"n": 2}]


def test_checkpoints_save_load_gc_with_the_same_commit_rule(bucket_url, tmp_path, cache):
    store = CheckpointStore(bucket_url, cache_dir=cache)
    state = tmp_path / "ckpt"
    (state / "adapter").mkdir(parents=True)
    (state / "adapter" / "adapter_model.safetensors").write_bytes(os.urandom(1000))
    (state / "optimizer.pt").write_bytes(os.urandom(5000))
    store.save(10, state, meta={"policy_version": 3, "data_cursor": 160})
    store.save(20, {"optimizer.pt": state / "optimizer.pt", "trainer_state.json": b'{"step": 20}'})
    with pytest.raises(VersionExists):
        store.save(20, {"trainer_state.json": b'{"step": 20, "again": true}'})
    assert store.steps() == [20, 10] and store.latest() == 20
    assert store.manifest(10)["meta"] == {"policy_version": 3, "data_cursor": 160}

    loaded = store.load(10, tmp_path / "restore")
    assert sha(loaded / "adapter" / "adapter_model.safetensors") == sha(state / "adapter" / "adapter_model.safetensors")
    assert (store.load(20, tmp_path / "r20") / "trainer_state.json").read_bytes() == b'{"step": 20}'
    with pytest.raises(BucketError, match="holds something else"):
        store.load(20, tmp_path / "restore")  # never clobber a folder holding something else
    store.save(30, {"trainer_state.json": b"{}"})
    assert store.gc(keep=2) == [10] and store.steps() == [30, 20]


def test_s3_errors_name_the_url_and_operation_and_never_the_credentials(s3_server, s3_bucket_url, monkeypatch):
    store = AdapterStore(s3_bucket_url, max_attempts=2, backoff_s=0.01)
    s3_server.kill()
    try:
        with pytest.raises(BucketError) as info:
            store.versions()
    finally:
        s3_server.start()
    message = str(info.value)
    assert message.startswith(f"versions {s3_bucket_url}/adapters: list failed after 2 attempts")
    assert s3_server.secret_key not in message and s3_server.access_key not in message

    with pytest.raises(BucketError, match="the bucket does not exist"):
        AdapterStore("s3://no-such-bucket-anywhere/run").versions()  # not an empty list: a typo must be loud

    monkeypatch.setenv("AWS_SECRET_ACCESS_KEY", "a-wrong-secret-that-must-not-show")
    started = time.monotonic()
    with pytest.raises(BucketError) as info:
        AdapterStore(s3_bucket_url, max_attempts=5).versions()
    assert time.monotonic() - started < 5  # refused credentials are not retried
    assert "a-wrong-secret" not in str(info.value) and info.value.__cause__ is None
