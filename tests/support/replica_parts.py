"""A replica's parts for unit tests, without an engine: a stand-in for vLLM's AsyncLLM, adapter folders, and the LoRA
slots of a replica over a local bucket (`test_replica`, `test_adapter_slots`, `test_adapter_sources`, `test_weight_sync`)."""

from __future__ import annotations

from pathlib import Path
from types import SimpleNamespace

from contracts.adapters import POLICY_STEM, run_prefix
from contracts.auth import lineage_key, signing_secret
from core.bucket.store import AdapterStore, adapter_store
from core.config import BucketConfig
from deployments.replica.adapter_slots import AdapterSlots
from deployments.replica.adapter_sources import AdapterSources
from deployments.replica.engine import Engine

REPLICA = "r"
BASE_MODEL = "base"
SECRET = signing_secret("unit-test-admin-token")  # the fleet's, which the replicas verify every lineage's versions by


def lineage_store(bucket_url: str, run: str | None = None, stem: str = POLICY_STEM, **kwargs) -> AdapterStore:
    """The store of run `run`'s lineage `stem` (policy, ema; run None: the fleet's own) in the fleet's bucket,
    signing with its key, as that run's learner publishes."""
    return adapter_store(stem)(run_prefix(bucket_url, run), signing_key=lineage_key(SECRET, run), **kwargs)


class StandInLLM:
    """Stands in for vLLM's `AsyncLLM`: records the adapters added and removed, the LoRA requests sampled and
    pauses; every request samples token 7, or raises `error` (with the engine dead first if `dies`)."""

    def __init__(self, error: BaseException | None = None, dies: bool = False):
        self.error, self.dies, self.errored, self.paused = error, dies, False, False
        self.added, self.removed, self.generated = [], [], []

    async def generate(self, prompt, params, request_id, lora_request=None):
        self.generated.append(lora_request)
        if self.dies:
            self.errored = True
        if self.error is not None:
            raise self.error
        ids = prompt["prompt_token_ids"]
        scored = None  # vLLM's prompt_logprobs when asked: None first, then {token: Logprob} (here -0.5 x position)
        if params.prompt_logprobs is not None:
            scored = [None] + [{t: SimpleNamespace(logprob=-0.5 * i, rank=1)} for i, t in enumerate(ids[1:], 1)]
        yield SimpleNamespace(
            prompt_logprobs=scored,
            outputs=[SimpleNamespace(index=0, token_ids=[7], logprobs=None, finish_reason="length", stop_reason=None)],
        )

    async def add_lora(self, request):
        self.added.append(request)
        return True

    async def remove_lora(self, int_id):
        self.removed.append(int_id)

    async def pause_generation(self, mode, clear_cache):
        self.paused = True

    async def resume_generation(self):
        self.paused = False


def adapter_folder(folder: Path, weights: bytes) -> Path:
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "adapter_config.json").write_text('{"r": 1, "peft_type": "LORA"}')
    (folder / "adapter_model.safetensors").write_bytes(weights)
    return folder


def local_config(tmp_path: Path, *overrides: str):
    """The default run config over a `file://` bucket and a cache under `tmp_path`."""
    from core.config import load_config

    return load_config(None, [f"bucket.url=file://{tmp_path}/bucket", f"bucket.cache_dir={tmp_path}/cache", *overrides])


def publish(store, tmp_path: Path, *versions: int) -> None:
    """Commit `versions` of one small adapter folder to `store` (an `AdapterStore`)."""
    adapter = adapter_folder(tmp_path / "adapter", b"weights")
    for v in versions:
        store.publish(adapter, v)


def adapter_slots(
    tmp_path: Path,
    llm: StandInLLM | None = None,
    *,
    window: int = 3,
    max_loras: int = 6,
    slot_wait_s: float = 30.0,
    cache_keep: int = 2,
) -> AdapterSlots:
    """The slots of replica `REPLICA` around `llm`, over the bucket `tmp_path/bucket` (cache `tmp_path/cache`),
    trusting `tmp_path/trl`."""
    sources = AdapterSources(
        f"file://{tmp_path}/bucket",
        BucketConfig(cache_dir=str(tmp_path / "cache")),
        signing_secret=SECRET,
        window=window,
        trusted_dirs=[tmp_path / "trl"],
        cache_keep=cache_keep,
    )
    return AdapterSlots(
        REPLICA,
        Engine(llm or StandInLLM(), REPLICA),
        sources,
        base_model=BASE_MODEL,
        max_loras=max_loras,
        window=window,
        slot_wait_s=slot_wait_s,
    )
