"""How much cheaper is it to ship a LoRA adapter through the bucket than to ship the model?

The design rests on this: after each sync the learner publishes a rank-1 adapter of a few megabytes
and every replica pulls it, where full fine-tuning would move every weight. This measures, on a real
S3 server (SeaweedFS on 127.0.0.1, through s3fs and core.bucket.store's commit protocol), the
publish-to-fetched latency (one store publishes, a second store with its own cache fetches and
verifies, as learner and replica do) and the payload bytes moved (up + down), for
  (a) a rank-1 adapter of the embedded tiny model (core.config's tiny shape),
  (b) a rank-1 adapter of a model with Qwen2.5-1.5B's shapes (all linear layers),
  (c) that model's full bf16 weights as safetensors shards, through the same bucket and protocol.
Weights are random and made here; nothing is downloaded. Adapters get >= 30 versions; the full
weights (~3 GB each way) only a few repetitions, because this is a 2-core box.

    python -m bench.adapter_sync [--versions 30] [--full-reps 3] [--no-full]

Writes bench/results/adapter_sync.json and prints a table.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import tempfile
import time
from pathlib import Path

import torch

from bench.common import fmt_bytes, fmt_seconds, print_table, summarize, write_result
from core.bucket.store import AdapterStore, CheckpointStore
from core.config import TinyModelConfig

# Qwen2.5-1.5B's published config (the seed recipe's base model): 1.54B parameters, tied embeddings.
QWEN25_1_5B = dict(
    vocab_size=151936, hidden_size=1536, intermediate_size=8960, num_hidden_layers=28,
    num_attention_heads=12, num_key_value_heads=2, tie_word_embeddings=True, max_position_embeddings=32768,
)  # fmt: skip
TINY_VOCAB = 384  # tiny.tokenizer trains a 384-token BPE; the vocabulary does not touch an all-linear adapter
KEEP_VERSIONS = 8  # gc as a run would (bucket.keep_versions), so the bucket does not grow through the benchmark
SHARD_BYTES = 1 << 30  # full weights in ~1 GiB safetensors shards, as HF writes them


def tiny_shape() -> dict:
    t = TinyModelConfig()
    return dict(
        vocab_size=TINY_VOCAB, hidden_size=t.hidden_size, intermediate_size=t.intermediate_size,
        num_hidden_layers=t.num_hidden_layers, num_attention_heads=t.num_attention_heads,
        num_key_value_heads=t.num_key_value_heads, tie_word_embeddings=True,
        max_position_embeddings=t.max_position_embeddings,
    )  # fmt: skip


def meta_model(shape: dict):
    """The model's module tree with no memory behind it: shapes are all we need from it."""
    from transformers import Qwen2Config, Qwen2ForCausalLM

    with torch.device("meta"):
        return Qwen2ForCausalLM(Qwen2Config(**shape))


class AdapterMaker:
    """Writes PEFT adapter folders (rank r, all linear layers) with fresh random weights per version."""

    def __init__(self, shape: dict, base_name: str, rank: int = 1):
        from peft import LoraConfig, get_peft_model, get_peft_model_state_dict

        peft_model = get_peft_model(
            meta_model(shape), LoraConfig(r=rank, lora_alpha=2 * rank, target_modules="all-linear")
        )
        self.shapes = {k: tuple(v.shape) for k, v in get_peft_model_state_dict(peft_model).items()}
        self.config = peft_model.peft_config["default"]
        self.config.base_model_name_or_path = base_name

    @property
    def num_params(self) -> int:
        return sum(torch.Size(s).numel() for s in self.shapes.values())

    def write(self, folder: Path, seed: int) -> Path:
        from safetensors.torch import save_file

        gen = torch.Generator().manual_seed(seed)
        # float32, as PEFT keeps adapter weights (autocast_adapter_dtype) and the learner saves them.
        tensors = {k: torch.randn(s, generator=gen) * 0.01 for k, s in self.shapes.items()}
        folder.mkdir(parents=True, exist_ok=True)
        save_file(tensors, folder / "adapter_model.safetensors", metadata={"format": "pt"})
        self.config.save_pretrained(str(folder))
        return folder


def write_full_weights(shape: dict, folder: Path, seed: int = 0) -> tuple[Path, int]:
    """The model's full weights in bf16 safetensors shards with an index, as save_pretrained lays them out."""
    from safetensors.torch import save_file

    model = meta_model(shape)
    params = [(name, tuple(p.shape)) for name, p in model.named_parameters()]  # tied weights counted once
    shards: list[list[tuple[str, tuple]]] = [[]]
    size = 0
    for name, s in params:
        nbytes = torch.Size(s).numel() * 2
        if shards[-1] and size + nbytes > SHARD_BYTES:
            shards.append([])
            size = 0
        shards[-1].append((name, s))
        size += nbytes
    folder.mkdir(parents=True, exist_ok=True)
    gen = torch.Generator().manual_seed(seed)
    weight_map, total = {}, 0
    for i, shard in enumerate(shards):
        file = f"model-{i + 1:05d}-of-{len(shards):05d}.safetensors"
        tensors = {name: (torch.randn(s, generator=gen) * 0.02).to(torch.bfloat16) for name, s in shard}
        save_file(tensors, folder / file, metadata={"format": "pt"})
        total += sum(t.numel() * 2 for t in tensors.values())
        weight_map.update(dict.fromkeys(tensors, file))
        del tensors
    index = {"metadata": {"total_size": total}, "weight_map": weight_map}
    (folder / "model.safetensors.index.json").write_text(json.dumps(index, indent=2))
    model.config.to_json_file(str(folder / "config.json"))
    return folder, total


def payload_bytes(manifest: dict) -> int:
    """What one transfer carries: every file plus the manifest (HTTP overhead not counted)."""
    return sum(f["size"] for f in manifest["files"].values()) + len(json.dumps(manifest, indent=2, sort_keys=True))


def measure(publish, fetch, prepare, count: int, cleanup) -> dict:
    """publish(i) then fetch(i) for i in 1..count, timed; prepare(i) (untimed) makes what is published."""
    publish_s, fetch_s, latency_s, moved = [], [], [], 0
    for i in range(1, count + 1):
        prepare(i)
        t0 = time.perf_counter()
        manifest = publish(i)
        t1 = time.perf_counter()
        fetch(i)
        t2 = time.perf_counter()
        publish_s.append(t1 - t0)
        fetch_s.append(t2 - t1)
        latency_s.append(t2 - t0)
        moved += 2 * payload_bytes(manifest)  # up by the publisher, down by the replica
        cleanup(i)
    return {
        "count": count,
        "payload_bytes": payload_bytes(manifest),
        "bytes_moved_total": moved,
        "latency_s": summarize(latency_s),
        "publish_s": summarize(publish_s),
        "fetch_s": summarize(fetch_s),
    }


def adapter_case(url: str, work: Path, label: str, maker: AdapterMaker, versions: int) -> dict:
    learner = AdapterStore(url, cache_dir=work / f"{label}-learner-cache")
    replica = AdapterStore(url, cache_dir=work / f"{label}-replica-cache")
    folder = work / f"{label}-adapter"
    # Version 0 opens both clients (an S3 session costs ~0.5 s once) and is not timed.
    learner.publish(maker.write(folder, seed=0), 0)
    replica.fetch(0)

    def cleanup(v: int) -> None:
        learner.gc(KEEP_VERSIONS)
        replica.prune_cache(KEEP_VERSIONS)

    result = measure(
        publish=lambda v: learner.publish(folder, v),
        fetch=replica.fetch,
        prepare=lambda v: maker.write(folder, seed=v),  # the learner's save_pretrained: not part of the sync
        count=versions,
        cleanup=cleanup,
    )
    result["params"] = maker.num_params
    return result


def full_weights_case(url: str, work: Path, shape: dict, reps: int) -> dict:
    folder, total = write_full_weights(shape, work / "full-weights")
    learner = CheckpointStore(url, cache_dir=work / "full-learner-cache")
    replica = CheckpointStore(url, cache_dir=work / "full-replica-cache")
    learner.steps(), replica.steps()  # open both clients, untimed

    def cleanup(r: int) -> None:
        shutil.rmtree(work / "full-replica-cache", ignore_errors=True)
        learner.gc(1)

    result = measure(
        publish=lambda r: learner.save(r, folder),
        fetch=replica.load,
        prepare=lambda r: None,
        count=reps,
        cleanup=cleanup,
    )
    result["params"] = total // 2
    return result


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--versions", type=int, default=30, help="adapter versions per model (>= 30 for the issue)")
    parser.add_argument("--full-reps", type=int, default=3, help="full-weight publish+fetch repetitions")
    parser.add_argument("--no-full", action="store_true", help="skip the full-weight case (quick run)")
    parser.add_argument("--workdir", default=None, help="scratch folder (default: a temporary one, removed after)")
    args = parser.parse_args(argv)

    from tests.support.s3_server import start_seaweedfs

    work = Path(args.workdir or tempfile.mkdtemp(prefix="spotrl-bench-adapter-sync-"))
    # 1 GiB volumes: the default 128 MiB would need ~25 volumes per full-weight copy; and room for Go's
    # heap, without which SeaweedFS spends a third of its CPU on garbage collection while taking 3 GB.
    server = start_seaweedfs(work / "seaweedfs", extra_args=("-master.volumeSizeLimitMB=1024",), gomemlimit="1GiB")
    os.environ.update(server.env())
    cases: dict[str, dict] = {}
    try:
        url = server.make_bucket("adapter-sync")
        print(f"SeaweedFS at {server.endpoint_url}, scratch {work}")
        for label, shape, base in (
            ("tiny_adapter", tiny_shape(), "tiny (random)"),
            ("qwen2.5-1.5b_adapter", QWEN25_1_5B, "Qwen2.5-1.5B shapes (random)"),
        ):
            print(f"{label}: {args.versions} versions ...", flush=True)
            cases[label] = adapter_case(f"{url}/{label}", work, label, AdapterMaker(shape, base), args.versions)
        if not args.no_full:
            print(f"qwen2.5-1.5b_full_weights: {args.full_reps} repetitions (~3 GB each way) ...", flush=True)
            cases["qwen2.5-1.5b_full_weights"] = full_weights_case(f"{url}/full", work, QWEN25_1_5B, args.full_reps)
    finally:
        server.stop()
        if not args.workdir:
            shutil.rmtree(work, ignore_errors=True)

    ratios = {}
    full, adapter = cases.get("qwen2.5-1.5b_full_weights"), cases["qwen2.5-1.5b_adapter"]
    if full:
        ratios = {
            "full_over_adapter_latency_median": full["latency_s"]["median"] / adapter["latency_s"]["median"],
            "full_over_adapter_payload_bytes": full["payload_bytes"] / adapter["payload_bytes"],
            "full_over_tiny_adapter_latency_median": full["latency_s"]["median"] / cases["tiny_adapter"]["latency_s"]["median"],
        }  # fmt: skip
    rows = [
        [
            label, c["count"], f"{c['params']:,}", fmt_bytes(c["payload_bytes"]), fmt_seconds(c["publish_s"]["median"]),
            fmt_seconds(c["fetch_s"]["median"]), fmt_seconds(c["latency_s"]["median"]),
            fmt_seconds(c["latency_s"]["p99"]), fmt_bytes(c["bytes_moved_total"]),
        ]
        for label, c in cases.items()
    ]  # fmt: skip
    headers = ["case", "n", "params", "payload", "publish med", "fetch med", "latency med", "latency p99", "moved"]
    print_table(headers, rows, title="Adapter sync through the bucket (SeaweedFS S3 on 127.0.0.1, verified fetch)")
    for name, value in ratios.items():
        print(f"{name}: {value:,.1f}x")
    notes = [
        "latency = publish by one store + verified fetch (size, sha256) by another store with its own cache",
        "moved = payload up + down over all repetitions; payload = files + MANIFEST.json, HTTP overhead excluded",
        f"adapters: rank 1, alpha 2, all linear layers, float32; gc keeps {KEEP_VERSIONS} versions as a run does",
        f"full weights: bf16 safetensors shards, {args.full_reps} repetitions only (~3 GB each way on a 2-core box)",
        "version 0 of each adapter case (client start-up) is not timed; all weights are random, made locally",
    ]
    path = write_result("adapter_sync", {"cases": cases, "ratios": ratios, "notes": notes})
    print(f"wrote {path}")
    return {"cases": cases, "ratios": ratios}


if __name__ == "__main__":
    main()
