"""The Tinker API's records in a tenant's prefix (`core.bucket.tinker_paths`), on a real local bucket: a record says
the kind its number counts in, a number is never handed out twice in a store (a deleted one stays retired), and two
savers racing for one number each get one of their own."""

import pytest

from core.bucket import tinker_paths
from core.bucket.filesystem import VersionExists
from core.bucket.store import CheckpointStore


@pytest.fixture
def prefix(tmp_path):
    return f"file://{tmp_path}/bucket/runs/alice"


def _save(store: CheckpointStore, tmp_path):
    source = tmp_path / "state"
    source.mkdir(exist_ok=True)
    (source / "weights.bin").write_bytes(b"w")
    return lambda n: store.save(n, source)


def test_a_record_says_its_kind_and_one_written_before_kinds_were_recorded_says_it_by_its_path(prefix):
    tinker_paths.remember(prefix, "tinker://m/weights/a", "training", 1)
    assert tinker_paths.record_kind(tinker_paths.own_record(prefix, "tinker://m/weights/a")) == "training"
    assert tinker_paths.record_kind({"path": "tinker://m/sampler_weights/a", "number": 1}) == "sampler"
    replaced = tinker_paths.remember(prefix, "tinker://m/weights/a", "training", 2)
    assert replaced["number"] == 1 and tinker_paths.own_record(prefix, "tinker://m/weights/a")["number"] == 2


def test_a_deleted_newest_number_is_never_handed_out_again(prefix, tmp_path):
    store = tinker_paths.store(prefix, "training", str(tmp_path / "cache"))
    save = _save(store, tmp_path)
    assert tinker_paths.commit_new(prefix, "training", store.latest, save) == 1
    assert tinker_paths.commit_new(prefix, "training", store.latest, save) == 2
    tinker_paths.retire(prefix, "training", 2)
    store.delete(2)
    assert store.latest() == 1
    assert tinker_paths.commit_new(prefix, "training", store.latest, save) == 3  # not 2 again
    for number in (1, 3):
        tinker_paths.retire(prefix, "training", number)
        store.delete(number)
    assert store.latest() is None
    assert tinker_paths.commit_new(prefix, "training", store.latest, save) == 4
    marked = tinker_paths.records(prefix, f"{tinker_paths.RETIRED}/training").all()
    assert [m["number"] for m in marked] == [
        3
    ]  # the lower markers were dropped on the way: one file, not one per delete
    exports = tinker_paths.store(prefix, "external", str(tmp_path / "cache"))
    assert tinker_paths.commit_new(prefix, "external", exports.latest, _save(exports, tmp_path)) == 1  # its own count


def test_two_savers_that_read_the_same_newest_number_each_commit_one_of_their_own(prefix, tmp_path):
    store = tinker_paths.store(prefix, "training", str(tmp_path / "cache"))
    save = _save(store, tmp_path)
    stale = lambda: None  # noqa: E731 - what a saver read before the other committed
    assert tinker_paths.commit_new(prefix, "training", stale, save) == 1
    assert tinker_paths.commit_new(prefix, "training", stale, save) == 2
    assert store.steps() == [2, 1]

    def always_taken(number):
        raise VersionExists(f"{number} taken")

    with pytest.raises(VersionExists, match="no free number"):
        tinker_paths.commit_new(prefix, "training", stale, always_taken)


def test_a_prefix_names_its_run():
    assert tinker_paths.owner_run("s3://bucket/fleet-a/runs/alice") == "alice"
    for not_a_run in ("s3://bucket", "s3://bucket/runs/", "s3://bucket/runs/a/b"):
        with pytest.raises(ValueError):
            tinker_paths.owner_run(not_a_run)
