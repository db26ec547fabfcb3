"""A tenant's tinker paths as the Tinker service keeps them: recorded, listed, looked up, shared, expired, deleted.

The learner commits weights and answers their numbers; the service gives the user a tinker path for a number and
records it here (`remember`), in the tenant's prefix of the fleet's bucket (`core.bucket.tinker_paths`), so that a
service that restarted, knowing no path any more, finds them again. Every call reads or writes the bucket (blocking:
the service runs them in a worker thread) and none passes through a learner: a listing never waits for training,
nor for a learner that is gone. A record may carry an expiry (the SDK's `ttl_seconds`), past which its path is gone:
not listed, not found by `record`, and deleted from the bucket at the next listing.
"""

from __future__ import annotations

from contracts.tinker import AdapterSpec, Lineage
from core.bucket import tinker_paths
from core.bucket.tinker_paths import own_record, record_kind


class PathRegistry:
    """The tinker paths of the tenant whose lineage is `lineage` (its prefix, its run, the learner's cache)."""

    def __init__(self, lineage: Lineage):
        self.lineage, self.prefix = lineage, lineage.bucket_url

    def _store(self, kind: str):
        return tinker_paths.store(self.prefix, kind, self.lineage.cache_dir)

    def _public(self):
        """The pointers to the paths their owners published (`share`), in the fleet's bucket beside the tenants'
        prefixes."""
        return tinker_paths.public(self.prefix, self.lineage.run)

    def remember(
        self,
        path: str,
        kind: str,
        number: int,
        model: str,
        spec: AdapterSpec,
        expires: float | None,
        user_metadata: dict[str, str] | None = None,
        size_bytes: int | None = None,
    ) -> None:
        """Record the tinker `path` the user was given for `number` of the tenant's `kind` store, made by training
        client `model`, gone after `expires` (epoch seconds; None: kept until deleted). What an earlier save of the same
        path named is deleted: a name saved again is replaced, never left in the bucket where no path reaches it."""
        fields = {"model": model, "expires": expires, "size_bytes": size_bytes, "user_metadata": user_metadata}
        adapter = {"rank": spec.rank, "train_attn": spec.train_attn, "train_mlp": spec.train_mlp}
        replaced = tinker_paths.remember(self.prefix, path, kind, number, **fields, **adapter)
        if replaced is not None and (record_kind(replaced), int(replaced["number"])) != (kind, number):
            self._delete(replaced, record=False)

    def record(self, path: str) -> dict | None:
        """The tenant's tinker `path` as recorded when it was saved (the fields `checkpoints` lists), or, for a path
        another tenant published to every key (`share`), its owner's record with `prefix`, the owner's prefix of the
        bucket, where what it names lies; None for a path the tenant cannot reach, or one past its expiry."""
        own = own_record(self.prefix, path)
        if own is not None:
            return {**own, "kind": record_kind(own)}
        pointer = self._public().get(tinker_paths.record_name(path))
        if pointer is None or pointer.get("path") != path:
            return None
        owners = own_record(pointer["prefix"], path)  # the owner's record decides: deleted, expired, unpublished
        if owners is None or not owners.get("public"):
            return None
        return {**owners, "kind": record_kind(owners), "prefix": pointer["prefix"]}

    def expire(self, path: str, expires: float | None) -> bool:
        """Set (or with None remove) the expiry of the tenant's own `path`; False for a path it does not own."""
        return self._update(path, expires=expires)

    def share(self, path: str, public: bool) -> bool:
        """Publish the tenant's own `path` to every key of the fleet (`public`), or take it back; False for a path it
        does not own. A published state starts other keys' training clients, published sampler weights sample under
        their own lineage (the learner's `adopt`), a published export downloads; only the owner deletes, expires or
        unpublishes."""
        if not self._update(path, public=public):
            return False
        if public:
            self._public().put(tinker_paths.record_name(path), {"path": path, "prefix": self.prefix})
        else:
            self._public().delete(tinker_paths.record_name(path))
        return True

    def _update(self, path: str, **fields) -> bool:
        saved = own_record(self.prefix, path)
        if saved is None:
            return False
        tinker_paths.paths(self.prefix).put(tinker_paths.record_name(path), {**saved, **fields})
        return True

    def checkpoints(self) -> list[dict]:
        """Every tinker path the tenant was given and not expired, as recorded (`path`, `number`, `time`, `model`,
        `expires`, the adapter's `rank`, `train_attn`, `train_mlp`, an export's `size_bytes`; records written before
        carry no model or adapter), newest first: what the SDK's checkpoint and training-run listings show. Expired
        ones are deleted from the bucket on the way."""
        live = []
        for saved in tinker_paths.paths(self.prefix).all():
            if not tinker_paths.expired(saved):
                live.append(saved)
                continue
            try:
                self._delete(saved)
            except ValueError:  # the newest sampler weights: out of sight now, deleted once newer ones exist
                pass
        return sorted(live, key=lambda r: r.get("time", 0.0), reverse=True)

    def forget(self, path: str) -> bool:
        """Delete what the tenant's tinker `path` names (a saved state, sampler version or export) from the bucket,
        then its record; whether there was one. A fleet that loaded the version keeps serving it until it unloads it;
        no new sampling client can name the path.

        The tenant's newest sampler version stays (ValueError): the next one takes the number after the newest
        committed, and the fleet names what it serves by that number, so deleting the newest would hand its number,
        and its name on the fleet, to other weights."""
        saved = own_record(self.prefix, path)
        if saved is None:
            return False
        self._delete(saved)
        return True

    def supersede(self, model: str, number: int) -> None:
        """State `number` is the newest the service saved for training client `model` on its own (a spot notice's,
        which no path names): the ones it saved before beyond the newest two leave the bucket, their numbers retired."""
        states = self._store("training")
        for earlier in tinker_paths.keep(self.prefix, model, number):
            tinker_paths.retire(self.prefix, "training", earlier)
            states.delete(earlier)

    def _delete(self, saved: dict, record: bool = True) -> None:
        """Delete what `saved` names (its number retired for good first), its public pointer and, with `record`, the
        record itself (a record replaced by a new save of its path stays: it is the new one's now)."""
        path, number, kind = saved["path"], int(saved["number"]), record_kind(saved)
        store = self._store(kind)
        if kind == "sampler" and store.latest() == number:
            raise ValueError(f"{path} is the newest sampler weights of this key: save newer ones before deleting it")
        tinker_paths.retire(self.prefix, kind, number)
        store.delete(number)
        if saved.get("public"):
            self._public().delete(tinker_paths.record_name(path))
        if record:
            tinker_paths.paths(self.prefix).delete(tinker_paths.record_name(path))
