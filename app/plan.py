"""Do the math before choosing spot: what a run moves through the bucket, how long that takes, what it costs.

    python -m app.plan --config configs/qwen2.5-math-1.5b.yaml --bandwidth 200 --spot 2.5 --on-demand 6.0
    python -m app.plan --model Qwen/Qwen2.5-7B --rank 16 --gpus 9 --json
    spotrl plan --config configs/tiny-cpu.yaml --set lora.rank=4     (the same command)

From the model's shapes alone (a local folder's `config.json`, a `config.json` path, or a small table of
known models: nothing is downloaded) it prints the LoRA adapter's bytes per weight sync and a learner
checkpoint's bytes, the time to publish and to fetch them at the bucket bandwidth you give, the same for
full weights (what a full fine-tune would sync, and checkpoint), whether a checkpoint's upload fits the
AWS (2 min) and GCP (30 s) notice windows, and, with the prices you pass, the cluster's cost per hour on
spot and on demand. The PastAGI article among the seeds asks for exactly this before a run goes on spot.
"""

from __future__ import annotations

import argparse
import json
import sys
from dataclasses import asdict, dataclass
from pathlib import Path

# Seconds between a spot interruption notice and the machine going away.
NOTICE_WINDOWS_S = {"aws": 120.0, "gcp": 30.0}
LORA_BYTES_PER_PARAM = 4  # PEFT saves the fp32 master weights of the adapter
CHECKPOINT_COPIES = 3  # adapter + AdamW's two moments, fp32 each (scheduler, RNG, cursors: kilobytes)
FULL_CHECKPOINT_BYTES_PER_PARAM = 12  # a full fine-tune's fp32 weights and AdamW's two fp32 moments
DTYPE_BYTES = {"float32": 4, "bfloat16": 2, "float16": 2}
ALL_LINEAR = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")


@dataclass(frozen=True)
class Shape:
    """What the sizes depend on: a decoder of `layers` blocks of attention and a gated MLP."""

    hidden: int
    intermediate: int
    layers: int
    heads: int
    kv_heads: int
    vocab: int
    tied: bool
    head_dim: int | None = None  # None: hidden / heads
    qkv_bias: bool = True  # Qwen2 has biases on q, k, v; Llama and Qwen3 have none

    @property
    def dim(self) -> int:
        return self.head_dim or self.hidden // self.heads


# Public configs of the models users reach for first (hub names, lower case; the folder name also matches).
KNOWN = {
    "qwen/qwen2.5-0.5b": Shape(896, 4864, 24, 14, 2, 151936, True),
    "qwen/qwen2.5-1.5b": Shape(1536, 8960, 28, 12, 2, 151936, True),
    "qwen/qwen2.5-math-1.5b": Shape(1536, 8960, 28, 12, 2, 151936, True),
    "qwen/qwen2.5-3b": Shape(2048, 11008, 36, 16, 2, 151936, True),
    "qwen/qwen2.5-7b": Shape(3584, 18944, 28, 28, 4, 152064, False),
    "qwen/qwen2.5-math-7b": Shape(3584, 18944, 28, 28, 4, 152064, False),
    "qwen/qwen2.5-14b": Shape(5120, 13824, 48, 40, 8, 152064, False),
    "qwen/qwen2.5-32b": Shape(5120, 27648, 64, 40, 8, 152064, False),
    "qwen/qwen3-1.7b": Shape(2048, 6144, 28, 16, 8, 151936, True, head_dim=128, qkv_bias=False),
    "qwen/qwen3-8b": Shape(4096, 12288, 36, 32, 8, 151936, False, head_dim=128, qkv_bias=False),
    "meta-llama/llama-3.1-8b": Shape(4096, 14336, 32, 32, 8, 128256, False, qkv_bias=False),
    # The embedded default (tiny.build): its BPE vocabulary is at most 384 tokens.
    "tiny": Shape(128, 512, 2, 4, 2, 384, True),
}


def shape_of(model: str) -> Shape:
    """The shapes of `model`: a folder with a config.json, a config.json, or a known name; SystemExit otherwise."""
    path = Path(model).expanduser()
    config = path / "config.json" if path.is_dir() else path
    if config.is_file():
        c = json.loads(config.read_text())
        return Shape(
            hidden=c["hidden_size"],
            intermediate=c["intermediate_size"],
            layers=c["num_hidden_layers"],
            heads=c["num_attention_heads"],
            kv_heads=c.get("num_key_value_heads") or c["num_attention_heads"],
            vocab=c["vocab_size"],
            tied=bool(c.get("tie_word_embeddings", False)),
            head_dim=c.get("head_dim"),
            qkv_bias=bool(c.get("attention_bias", c.get("model_type") == "qwen2")),
        )
    for name in (model.lower(), model.lower().rstrip("/").rsplit("/", 1)[-1]):
        for known, shape in KNOWN.items():
            if name in (known, known.rsplit("/", 1)[-1]):
                return shape
    raise SystemExit(
        f"model {model!r}: no config.json there and not a known model ({', '.join(sorted(KNOWN))}); "
        "pass a folder or a config.json path"
    )


def linear_layers(shape: Shape) -> dict[str, tuple[int, int]]:
    """(in, out) features of each linear module of one block."""
    q, kv = shape.heads * shape.dim, shape.kv_heads * shape.dim
    h, i = shape.hidden, shape.intermediate
    return {
        "q_proj": (h, q),
        "k_proj": (h, kv),
        "v_proj": (h, kv),
        "o_proj": (q, h),
        "gate_proj": (h, i),
        "up_proj": (h, i),
        "down_proj": (i, h),
    }


def lora_params(shape: Shape, rank: int, targets: str | list[str] = "all-linear") -> int:
    """Parameters of a rank-`rank` LoRA on the target modules of every block: r x (in + out) each."""
    names = ALL_LINEAR if targets == "all-linear" else [t for t in targets if t in ALL_LINEAR]
    per_block = sum(rank * (n_in + n_out) for name, (n_in, n_out) in linear_layers(shape).items() if name in names)
    return per_block * shape.layers


def model_params(shape: Shape) -> int:
    """Parameters of the whole model: embeddings (and an untied head), blocks, norms."""
    linear = sum(n_in * n_out for n_in, n_out in linear_layers(shape).values())
    bias = (shape.heads + 2 * shape.kv_heads) * shape.dim if shape.qkv_bias else 0
    block = linear + bias + 2 * shape.hidden  # two RMSNorms
    embeddings = shape.vocab * shape.hidden * (1 if shape.tied else 2)
    return embeddings + shape.layers * block + shape.hidden


@dataclass(frozen=True)
class Plan:
    """The figures `python -m app.plan` prints."""

    model: str
    lora_rank: int
    model_params: int
    adapter_params: int
    adapter_bytes: int  # one weight sync
    checkpoint_bytes: int  # one learner checkpoint
    full_weights_bytes: int  # what a full fine-tune syncs (the serving dtype)
    full_checkpoint_bytes: int
    bandwidth_mb_s: float
    adapter_publish_s: float  # the learner's upload; every replica then fetches it in about as long, in parallel
    checkpoint_upload_s: float
    full_weights_sync_s: float
    full_checkpoint_upload_s: float
    replicas: int
    bytes_per_sync_all_replicas: int  # the bucket's egress per sync: every replica fetches the adapter
    checkpoint_fits: dict[str, bool]  # per cloud: the checkpoint's upload fits the notice window
    full_checkpoint_fits: dict[str, bool]
    gpus: float
    cost_per_hour_spot: float | None
    cost_per_hour_on_demand: float | None


def make_plan(
    model: str,
    rank: int,
    *,
    targets: str | list[str] = "all-linear",
    dtype: str = "bfloat16",
    bandwidth_mb_s: float = 100.0,
    replicas: int = 1,
    gpus: float = 1.0,
    spot: float | None = None,
    on_demand: float | None = None,
    head: float = 0.0,
) -> Plan:
    shape = shape_of(model)
    adapter = lora_params(shape, rank, targets)
    params = model_params(shape)
    adapter_bytes = adapter * LORA_BYTES_PER_PARAM
    checkpoint_bytes = CHECKPOINT_COPIES * adapter_bytes
    full_bytes = params * DTYPE_BYTES[dtype]
    full_checkpoint = params * FULL_CHECKPOINT_BYTES_PER_PARAM

    def seconds(n: int) -> float:
        return n / (bandwidth_mb_s * 1e6)

    return Plan(
        model=model,
        lora_rank=rank,
        model_params=params,
        adapter_params=adapter,
        adapter_bytes=adapter_bytes,
        checkpoint_bytes=checkpoint_bytes,
        full_weights_bytes=full_bytes,
        full_checkpoint_bytes=full_checkpoint,
        bandwidth_mb_s=bandwidth_mb_s,
        adapter_publish_s=seconds(adapter_bytes),
        checkpoint_upload_s=seconds(checkpoint_bytes),
        full_weights_sync_s=seconds(full_bytes),
        full_checkpoint_upload_s=seconds(full_checkpoint),
        replicas=replicas,
        bytes_per_sync_all_replicas=adapter_bytes * replicas,
        checkpoint_fits={cloud: seconds(checkpoint_bytes) < w for cloud, w in NOTICE_WINDOWS_S.items()},
        full_checkpoint_fits={cloud: seconds(full_checkpoint) < w for cloud, w in NOTICE_WINDOWS_S.items()},
        gpus=gpus,
        cost_per_hour_spot=None if spot is None else gpus * spot + head,
        cost_per_hour_on_demand=None if on_demand is None else gpus * on_demand + head,
    )


def _size(n: float) -> str:
    for unit in ("B", "KB", "MB", "GB", "TB"):
        if n < 1000 or unit == "TB":
            return f"{n:.1f} {unit}" if unit != "B" else f"{n:.0f} B"
        n /= 1000
    raise AssertionError("unreachable")


def report(plan: Plan) -> str:
    """The plan as the lines `python -m app.plan` prints."""
    fits = "  ".join(
        f"{cloud.upper()} {NOTICE_WINDOWS_S[cloud]:.0f} s: {'fits' if ok else 'DOES NOT FIT'}"
        for cloud, ok in plan.checkpoint_fits.items()
    )
    full_fits = "  ".join(
        f"{cloud.upper()}: {'fits' if ok else 'does not fit'}" for cloud, ok in plan.full_checkpoint_fits.items()
    )
    lines = [
        f"model {plan.model}: {plan.model_params / 1e9:.3g}B parameters; LoRA rank {plan.lora_rank}: "
        f"{plan.adapter_params / 1e6:.3g}M parameters",
        f"bucket bandwidth {plan.bandwidth_mb_s:g} MB/s, {plan.replicas} replicas, {plan.gpus:g} GPUs",
        "",
        f"{'':24}{'bytes':>12}{'time':>12}",
        f"{'adapter per sync':24}{_size(plan.adapter_bytes):>12}{plan.adapter_publish_s:>11.2f}s"
        f"   (publish; each replica fetches it in as long, {_size(plan.bytes_per_sync_all_replicas)} in all)",
        f"{'learner checkpoint':24}{_size(plan.checkpoint_bytes):>12}{plan.checkpoint_upload_s:>11.2f}s   {fits}",
        f"{'full weights per sync':24}{_size(plan.full_weights_bytes):>12}{plan.full_weights_sync_s:>11.2f}s"
        f"   ({plan.full_weights_bytes / max(plan.adapter_bytes, 1):.0f}x the adapter)",
        f"{'full checkpoint':24}{_size(plan.full_checkpoint_bytes):>12}{plan.full_checkpoint_upload_s:>11.2f}s"
        f"   {full_fits}",
    ]
    if plan.cost_per_hour_spot is not None or plan.cost_per_hour_on_demand is not None:
        lines.append("")
        if plan.cost_per_hour_spot is not None:
            lines.append(f"cost per hour on spot:      {plan.cost_per_hour_spot:10.2f}")
        if plan.cost_per_hour_on_demand is not None:
            lines.append(f"cost per hour on demand:    {plan.cost_per_hour_on_demand:10.2f}")
        if plan.cost_per_hour_spot and plan.cost_per_hour_on_demand:
            lines.append(f"spot saves {1 - plan.cost_per_hour_spot / plan.cost_per_hour_on_demand:.0%}")
    lines.append("")
    lines.append(
        "A notice shorter than the checkpoint's upload costs the steps since the last committed checkpoint "
        "(learner.save_steps): the run resumes from there."
    )
    return "\n".join(lines)


def run_gpus(cfg) -> float:
    """GPUs a run config places: the learner's and the fleet's."""
    learner = cfg.learner.num_workers * cfg.learner.num_gpus_per_worker if cfg.learner.device == "cuda" else 0.0
    return learner + cfg.fleet.num_replicas * cfg.fleet.num_gpus_per_replica


def build_parser() -> argparse.ArgumentParser:
    """The options of `main` (`spotrl plan --help` lists the run config's fields after them)."""
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--config", help="A run config: its model, LoRA rank and targets, dtype, GPUs, replicas.")
    parser.add_argument(
        "--set", dest="overrides", action="append", default=[], metavar="KEY=VALUE", help="Override a --config field."
    )
    parser.add_argument("--model", help="A folder, a config.json, or a known model name (instead of --config).")
    parser.add_argument("--rank", type=int, help="LoRA rank (with --model; default the config's).")
    parser.add_argument("--bandwidth", type=float, default=100.0, help="Bucket bandwidth in MB/s (default 100).")
    parser.add_argument("--gpus", type=float, help="GPUs of the cluster (default: the config's learner + replicas).")
    parser.add_argument("--replicas", type=int, help="vLLM replicas fetching each version (default the config's).")
    parser.add_argument("--spot", type=float, help="Price of one GPU-hour on spot.")
    parser.add_argument("--on-demand", type=float, help="Price of one GPU-hour on demand.")
    parser.add_argument("--head", type=float, default=0.0, help="Price per hour of the on-demand head node.")
    parser.add_argument("--json", action="store_true", help="Print the plan as JSON.")
    return parser


def main(argv: list[str] | None = None) -> None:
    parser = build_parser()
    args = parser.parse_args(argv)
    if not args.config and not args.model:
        parser.error("give --config FILE or --model NAME")
    if args.overrides and not args.config:
        parser.error("--set overrides a field of --config FILE: give one")
    settings = {"targets": "all-linear", "dtype": "bfloat16", "replicas": 1, "gpus": 1.0, "rank": 8}
    if args.config:
        from core.config import config_from_args

        cfg = config_from_args(args)  # an invalid file or override: one line naming the field, exit 2
        targets = cfg.lora.target_modules
        settings = {
            "targets": targets,
            "dtype": cfg.model.dtype,
            "replicas": cfg.fleet.num_replicas,
            "gpus": run_gpus(cfg),
            "rank": cfg.lora.rank,
        }
    model = args.model or cfg.model.name_or_path
    plan = make_plan(
        model,
        args.rank or settings["rank"],
        targets=settings["targets"],
        dtype=settings["dtype"],
        bandwidth_mb_s=args.bandwidth,
        replicas=args.replicas or settings["replicas"],
        gpus=args.gpus if args.gpus is not None else settings["gpus"],
        spot=args.spot,
        on_demand=args.on_demand,
        head=args.head,
    )
    print(json.dumps(asdict(plan), indent=1) if args.json else report(plan), file=sys.stdout)


if __name__ == "__main__":
    main()
