"""One rank of the learner: a PEFT LoRA policy trained on the run's objectives, FSDP2-sharded (on CUDA always).

`LearnerRank` holds no Ray, so that tests can drive it in-process; `app.learner.group` runs one per
device as a Ray actor (`LearnerRankActor`) behind `LearnerGroup`, which joins them with
torch.distributed (gloo on the CPU; NCCL only between the GPUs of one learner node, never to the fleet).

A step takes a `RolloutBatch` of groups the rollout has annotated for the run's objectives and answers
a `StepResult`: drop groups already trained on (a restarted learner may be fed them again), pack their
samples and per-token streams into micro-batches (`app.learner.packing`), accumulate the gradient of
the objectives' summed loss (`app.objectives`: GRPO by default; the rank names no algorithm) over this
rank's micro-batches, clip, AdamW. The forward never materialises `[tokens x vocab]` logits: the
model's output layer is a `LogProbHead` (`app.learner.logprobs`), which returns the sampled tokens'
log-probs and entropies chunk by chunk (and the log-probs at the ids an objective asks for, `scored_ids`: the
teacher's top k of top-k distillation). Every `weight_sync_steps` the whole adapter is gathered from
the FSDP shards and handed to `app.weight_sync` as the next `policy-v{N}` (bucket, then fleet); every
`save_steps` the whole learner state goes to the bucket as a checkpoint (`app.learner.state`). A run with an `ema`
self teacher also has rank 0 keep an exponential average of the adapter (`app.learner.ema`), published with each
version under the same number as `ema-v{N}`, the run's second lineage, and kept in its checkpoints.

Versions are monotonic across restarts: a learner resumed from a checkpoint older than the newest
published adapter (it died after publishing) republishes its restored adapter as a new version
above everything in the bucket, so the fleet never serves weights from the lost future under a
number the learner will reuse.

Nothing here imports pydantic or Ray at run time (`RunConfig` is only a type hint), so that
`bench.learner_gpu` can drive a rank on a GPU box that has neither.
"""

from __future__ import annotations

import json
import logging
import shutil
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING

import torch
import torch.distributed as dist

from app.learner.ema import AdapterEma, EmaLineage
from app.learner.logprobs import forward_scores
from app.learner.model import (
    build_lora_model,
    build_optimizer,
    fully_shard_model,
    init_distributed,
    logprob_head,
    mixed_precision_policy,
    reduce_over_ranks,
    uses_fsdp,
)
from app.learner.notices import LearnerNotices, StepAbandoned
from app.learner.packing import MicroBatch, TrainSample, batch_metrics, pack, pad, samples_from_groups, shard
from app.learner.perf import Stopwatch, device_name, peak_flops, step_perf_metrics
from app.learner.state import (
    ADAPTER_DIR,
    LearnerState,
    full_adapter_state,
    full_optimizer_state,
    gather_rng_states,
    load_adapter_weights,
    read_state,
    restore_training_state,
    write_adapter,
    write_checkpoint,
)
from app.messages import ResumePoint, StepResult
from app.objectives import LossStats, Objectives
from app.weight_sync import AdapterPublisher
from contracts.adapters import EMA_STEM
from contracts.auth import Secret
from contracts.rollouts import ConsumedGroups, Group, RolloutBatch

if TYPE_CHECKING:
    from core.config import RunConfig

log = logging.getLogger(__name__)


class NotStarted(RuntimeError):
    """train_step before start(): in Ray, a worker that was restarted (its node died) and not yet resumed."""


class LearnerRank:
    """One rank of the learner. Call `setup` (joins the process group, loads the model), then `start`."""

    def __init__(
        self,
        cfg: RunConfig,
        model_path: str,
        rank: int = 0,
        world_size: int = 1,
        fleet_url: str | None = None,
        fleet_token: str | None = None,
        signing_key: Secret | None = None,
    ):
        self.cfg, self.model_path = cfg, model_path
        self.rank, self.world_size = rank, world_size
        self.fleet_url, self.fleet_token, self.signing_key = fleet_url, fleet_token, signing_key
        self.objectives = Objectives.from_config(cfg)
        self.state = LearnerState()
        self._consumed = ConsumedGroups()
        self.model = self.optimizer = self.scheduler = None
        self.publisher: AdapterPublisher | None = None
        # Of a RunConfig, whose validation gives them one update_rate and sync_steps (bench.learner_gpu's has none).
        ema_teachers = getattr(cfg, "ema_teachers", [])
        self.ema_spec = ema_teachers[0] if ema_teachers else None
        self.ema: EmaLineage | None = None  # rank 0's average (`ema_spec`), published beside each version
        self._started = False
        self._fsdp = uses_fsdp(world_size, cfg.learner.device)
        self._tmp = Path(tempfile.mkdtemp(prefix=f"spotrl-learner-r{rank}-"))
        self.notices = LearnerNotices(getattr(cfg, "spot", None))  # watching starts in Ray (`app.learner.group`)
        self._checkpointed_step: int | None = None

    # ---- set-up -----------------------------------------------------------------------------------

    def setup(self, master_addr: str = "127.0.0.1", master_port: int | None = None) -> None:
        """Join the process group (under FSDP) and load the base model with a fresh adapter (unsharded)."""
        if self.cfg.learner.device == "cuda":
            torch.cuda.set_device(0)  # Ray gives each worker one visible GPU
            self.device = torch.device("cuda", 0)
        else:
            self.device = torch.device("cpu")
        self.device_name = device_name(self.device)
        self.peak_flops = peak_flops(self.device_name, self.device.type, self.cfg.learner.peak_flops)
        if self.rank == 0:
            log.info(
                "learner on %s x%d, peak %.4g FLOP/s each for MFU", self.device_name, self.world_size, self.peak_flops
            )
        if self._fsdp:
            init_distributed(self.rank, self.world_size, master_addr, master_port, self.device.type)
        self.model, self.pad_id = build_lora_model(self.cfg, self.model_path, self.device)
        self.head = logprob_head(self.model)

    def _rank0_decides(self, value):
        """Rank 0's value on every rank: bucket listings are read once, so ranks never disagree."""
        if self.world_size == 1:
            return value
        box = [value if self.rank == 0 else None]
        dist.broadcast_object_list(box, src=0)
        return box[0]

    def start(self) -> ResumePoint:
        """Resume from the newest committed checkpoint, or start fresh; make sure the fleet has our weights."""
        from core.bucket.store import CheckpointStore

        if self._started:  # the model is sharded and the optimizer built: a second start has nothing to do
            return self.state.resume_point()
        self.publisher = AdapterPublisher(self.cfg, self.fleet_url, self.fleet_token, signing_key=self.signing_key)
        if self.ema_spec is not None and self.rank == 0:
            trainable = {name: p for name, p in self.model.named_parameters() if p.requires_grad}
            self.ema = EmaLineage(
                AdapterEma(self.ema_spec.update_rate, self.ema_spec.sync_steps, trainable),
                AdapterPublisher(
                    self.cfg, self.fleet_url, self.fleet_token, signing_key=self.signing_key, stem=EMA_STEM
                ),
            )
        self.checkpoints = CheckpointStore.from_config(self.cfg)
        step = self._rank0_decides(self.checkpoints.latest() if self.rank == 0 else None)
        folder = None
        if step is not None:
            folder = self.checkpoints.load(step, self._tmp / f"ckpt-{step}-{time.monotonic_ns()}")
            self.state = read_state(folder)
            self._consumed = self.state.consumed()
            self._checkpointed_step = step
            load_adapter_weights(self.model, folder / ADAPTER_DIR)
            if self.ema is not None:
                self.ema.restore(folder, step)
        self.prepare_training()
        if folder is not None:
            restore_training_state(
                folder, model=self.model, optimizer=self.optimizer, scheduler=self.scheduler, rank=self.rank
            )
            shutil.rmtree(folder, ignore_errors=True)
            log.info("learner rank %d resumed from checkpoint step %d", self.rank, step)
        latest = self._rank0_decides(self.publisher.latest() if self.rank == 0 else None)
        if self.state.policy_version is None or latest != self.state.policy_version:
            # Fresh start (publish the untrained adapter as v0), or the bucket holds versions from after our
            # checkpoint: publish what we hold above all of them, so versions only ever grow.
            candidates = [v for v in (latest, self.state.policy_version) if v is not None]
            self._publish(max(candidates) + 1 if candidates else 0)
        self._started = True
        return self.state.resume_point()

    def prepare_training(self) -> None:
        """Shard the model (FSDP2, with mixed precision on CUDA) and build the optimizer over the shards.

        `start` does this after loading a checkpoint's adapter; a benchmark that trains without a bucket
        calls it right after `setup`, then `forward_backward` and `optimizer_step`.
        """
        if self._fsdp:
            policy = mixed_precision_policy(self.cfg.model.dtype, self.device.type)
            fully_shard_model(self.model, self.world_size, self.device.type, policy)
        self.optimizer, self.scheduler = build_optimizer(self.cfg, self.model)

    # ---- training ---------------------------------------------------------------------------------

    def _batches(self, samples: list[TrainSample]) -> tuple[list[MicroBatch], int | None]:
        """Micro-batches of samples (the config's batching) and the row budget they were packed to."""
        lcfg = self.cfg.learner
        if lcfg.batching == "packed":
            return pack(samples, lcfg.token_budget, self.pad_id), lcfg.token_budget
        return pad(samples, lcfg.per_device_train_batch_size, self.pad_id), None

    def plan(self, groups: list[Group]) -> tuple[list[MicroBatch], dict]:
        """All ranks' micro-batches of these groups, and their batch metrics."""
        batches, budget = self._batches(samples_from_groups(groups))
        return batches, {**batch_metrics(batches, budget), "batch/groups": float(len(groups))}

    def _forward(self, mb: MicroBatch) -> tuple[torch.Tensor, torch.Tensor]:
        """Log-prob (with gradient) and entropy (without) of each of the micro-batch's targets, at the sampling
        temperature: the output layer computes them chunk by chunk inside the forward, where FSDP has gathered it.
        """
        logp, entropy, _ = self._forward_at(mb, None)
        return logp, entropy

    def _forward_at(
        self, mb: MicroBatch, ids: torch.Tensor | None
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
        """`_forward`, and the log-probs (with gradient) at `ids` (`[targets, k]`) at each target's position, at
        the same temperature, computed in the same chunks (`[targets, k]`; None without ids)."""
        scores = forward_scores(self.model, self.head, mb, self.cfg.sampling.temperature, ids)
        logp, entropy = scores[0], scores[1]
        return logp, entropy.detach(), None if ids is None else scores[2:].T

    def forward_backward(self, groups: list[Group], stop: Callable[[], bool] | None = None) -> dict:
        """Accumulate the gradient of the objectives' loss over these groups into `.grad` (no optimizer step).

        Returns the batch, loss and timing metrics of the pass, reduced over ranks (every rank must call).
        `stop`, asked before each micro-batch (every rank alike), abandons the pass (`StepAbandoned`).
        """
        batches, metrics = self.plan(groups)
        if not batches:
            return metrics
        # FSDP averages gradients over ranks; dividing by tokens/world_size makes that average the sum over all
        # ranks' tokens divided once by the step's token count (each objective's own).
        normalizers = [n / self.world_size for n in self.objectives.num_tokens(mb.streams for mb in batches)]
        watch = Stopwatch(torch.cuda.synchronize if self.device.type == "cuda" else None)
        stats, loss_sum = LossStats(), 0.0
        self.model.train()
        with watch("fwd_bwd"):
            for mb in shard(batches, self.rank, self.world_size, self.pad_id):
                if stop is not None and stop():
                    raise StepAbandoned
                mb = mb.to(self.device)
                ids = self.objectives.scored_ids(mb.streams)  # top-k distillation's: the teacher's top k
                if ids is None:
                    (logp, entropy), at_ids = self._forward(mb), None
                else:
                    logp, entropy, at_ids = self._forward_at(mb, ids)
                loss, mb_stats = self.objectives.loss(logp, entropy, mb.streams, normalizers, at_ids)
                if mb.is_filler:
                    loss = loss * 0.0  # runs forward and backward only to keep FSDP's collectives in step
                    stats.add(mb_stats.emptied())
                else:
                    stats.add(mb_stats)
                    loss_sum += loss.item() / self.world_size
                loss.backward()
        stats, loss_sum = reduce_over_ranks(stats, loss_sum, self.world_size, self.device)
        metrics.update(stats.metrics())
        metrics.update({"loss": loss_sum, "perf/fwd_bwd_s": watch.get("fwd_bwd")})
        return metrics

    def train_step(self, batch: RolloutBatch) -> StepResult:
        """One optimizer step on the batch's groups not yet trained on; publish and checkpoint on schedule (after
        every step once the node got a spot notice; a step the notice leaves no time for is abandoned)."""
        if not self._started:
            raise NotStarted("call start() before train_step()")
        t_step = time.perf_counter()
        lcfg = self.cfg.learner
        noticed, fits = self._rank0_decides((self.notices.noticed, self.notices.step_fits()))
        if noticed:
            self.save_checkpoint()  # at once, unless this step is committed already
            if not fits:
                return self._abandon(batch)
        fresh = [grp for grp in batch.groups if grp.group_id not in self._consumed]
        json.dumps(batch.data_cursor)  # it goes into the checkpoint's JSON: fail here, not at save time
        # Each micro-batch asks whether the step can still end in time (rank 0 knows the deadline); several ranks
        # ask only once noticed (it is a collective), so they act on a notice heard mid-step at the step's end.
        late = lambda: self._rank0_decides(not self.notices.step_fits(time.perf_counter() - t_step))  # noqa: E731
        try:
            metrics = self.forward_backward(fresh, stop=late if noticed or self.world_size == 1 else None)
        except StepAbandoned:
            return self._abandon(batch)
        metrics["batch/skipped_groups"] = float(len(batch.groups) - len(fresh))
        if metrics["batch/trained_tokens"] == 0:  # all trained on before (or no completion tokens): no step
            self._mark_consumed(fresh, batch)
            metrics.update({"learner/skipped_step": 1.0, "perf/step_s": time.perf_counter() - t_step})
            return self._result(batch, fresh, metrics)

        metrics.update(self.optimizer_step())
        self.state.step += 1
        self._update_ema()
        self._mark_consumed(fresh, batch)
        if self.state.step % lcfg.weight_sync_steps == 0:
            metrics["perf/weight_sync_s"] = self._publish(self.state.policy_version + 1)
            if self.fleet_url:
                metrics["weight_sync/fleet_load_failures"] = float(self.publisher.fleet_load_failures)
        if self.state.step % lcfg.save_steps == 0 or self._rank0_decides(self.notices.noticed):
            self.save_checkpoint()
        self.notices.step_s = time.perf_counter() - t_step
        metrics.update({**self.perf_metrics(metrics, self.notices.step_s), **self.notices.take_metrics()})
        return self._result(batch, fresh, metrics)

    def _abandon(self, batch: RolloutBatch) -> StepResult:
        """Drop the step under way (nothing of it trained), commit the state the last step left, and tell the group
        the node's deadline: it trains the batch again on the replacement."""
        self.optimizer.zero_grad(set_to_none=True)
        self.save_checkpoint()
        log.warning("spot: step %d abandoned: the node goes before it could end, committed", self.state.step + 1)
        result = self._result(batch, [], {"spot/abandoned_step": 1.0, **self.notices.take_metrics()})
        result.abandoned, result.node_deadline = True, self._rank0_decides(self.notices.deadline())
        return result

    def optimizer_step(self) -> dict:
        """Clip the accumulated gradient, step AdamW and the schedule, clear the gradient; its metrics."""
        watch = Stopwatch(torch.cuda.synchronize if self.device.type == "cuda" else None)
        with watch("optimizer"):
            params = [p for p in self.model.parameters() if p.requires_grad]
            grad_norm = torch.nn.utils.clip_grad_norm_(params, self.cfg.train.max_grad_norm)
            grad_norm = grad_norm.full_tensor() if hasattr(grad_norm, "full_tensor") else grad_norm
            lr = self.scheduler.get_last_lr()[0]
            self.optimizer.step()
            self.scheduler.step()
            self.optimizer.zero_grad(set_to_none=True)
        return {"grad_norm": float(grad_norm), "learning_rate": lr, "perf/optimizer_s": watch.get("optimizer")}

    def perf_metrics(self, metrics: dict, step_s: float) -> dict:
        """The step's `perf/*` throughput and MFU (against this device's peak), from its batch metrics."""
        config = self.model.base_model.model.config
        perf = step_perf_metrics(config, metrics, step_s, self.world_size, self.peak_flops)
        return {**perf, "perf/peak_flops": self.peak_flops}

    def _result(self, batch: RolloutBatch, trained: list[Group], metrics: dict) -> StepResult:
        return StepResult(
            step=self.state.step,
            policy_version=self.state.policy_version,
            trained_group_ids=[grp.group_id for grp in trained],
            metrics=metrics,
            batch=batch.stats(),
        )

    def _mark_consumed(self, groups: list[Group], batch: RolloutBatch) -> None:
        """The step of `batch` is done: its groups are trained, every id below its data cursor (the data frontier) is settled (kept as
        that frontier and the few ids above it, not as every id ever trained: `ConsumedGroups`), and its data cursor
        is the state's. Only here: a step abandoned half-way commits none of it, so that a learner resumed from its
        checkpoint is fed the same groups again."""
        for grp in groups:
            self._consumed.add(grp.group_id)
        self._consumed.advance(batch.data_cursor)
        self.state.set_consumed(self._consumed)
        if batch.data_cursor is not None:
            self.state.data_cursor = batch.data_cursor

    # ---- weights out: publish, checkpoint ---------------------------------------------------------

    def _publish(self, version: int) -> float:
        """Hand the whole adapter to weight sync as `policy-v{version}` (bucket, then fleet), and the average of an ema
        teacher as `ema-v{version}` with it; returns seconds taken."""
        t0 = time.perf_counter()
        state = full_adapter_state(self.model)  # a collective: every rank gathers, rank 0 uploads
        if self.rank == 0:
            with tempfile.TemporaryDirectory(dir=self._tmp) as d:
                write_adapter(self.model, state, Path(d))
                version = self.publisher.publish(Path(d), version)  # past a number planted in the run's prefix
            if self.ema is not None:
                self.ema.publish(self.model, next(iter(state.values())).dtype, version, self._tmp)
        self.state.policy_version = self._rank0_decides(version)
        return time.perf_counter() - t0

    def _update_ema(self) -> None:
        """Fold the adapter into the ema teacher's average when this step is one of its `sync_steps`."""
        if self.ema_spec is None or self.state.step % self.ema_spec.sync_steps != 0:
            return
        state = full_adapter_state(self.model)  # a collective: every rank gathers, rank 0 keeps the average
        if self.ema is not None:
            self.ema.average.step(self.state.step, state)

    def save_checkpoint(self) -> float:
        """Commit the whole learner state to the bucket as `step-{step}` (unless it is there already); seconds taken."""
        if self._checkpointed_step == self.state.step or self.state.step == 0:
            return 0.0
        seconds = self._write_checkpoint()
        self._checkpointed_step = self.state.step
        self.notices.checkpointed(seconds)
        return seconds

    def _write_checkpoint(self) -> float:
        t0 = time.perf_counter()
        adapter = full_adapter_state(self.model)
        optim = full_optimizer_state(self.model, self.optimizer)
        rng = gather_rng_states(self.world_size)
        if self.rank == 0:
            with tempfile.TemporaryDirectory(dir=self._tmp) as d:
                write_checkpoint(
                    Path(d),
                    peft_model=self.model,
                    adapter_state=adapter,
                    optimizer_state=optim,
                    scheduler=self.scheduler,
                    rng_states=rng,
                    state=self.state,
                    world_size=self.world_size,
                )
                if self.ema is not None:
                    self.ema.save(Path(d))
                meta = {"policy_version": self.state.policy_version, "data_cursor": self.state.data_cursor}
                self.checkpoints.save(self.state.step, d, meta=meta)
            self.checkpoints.gc(self.cfg.bucket.keep_checkpoints)
        return time.perf_counter() - t0

    # ---- inspection (tests, evaluation) ------------------------------------------------------------

    def score(self, groups: list[Group]) -> list[list[list[float]]]:
        """The learner's log-prob of every trained token, per group and sample (`app.learner.scoring`)."""
        from app.learner.scoring import score_groups

        return score_groups(self, groups)

    def adapter_state_dict(self) -> dict[str, torch.Tensor]:
        """The whole adapter (a collective under FSDP)."""
        return full_adapter_state(self.model)

    def optimizer_state_dict(self) -> dict:
        """The whole optimizer state, keyed by parameter name (a collective under FSDP)."""
        return full_optimizer_state(self.model, self.optimizer)

    def get_state(self) -> ResumePoint:
        return self.state.resume_point()

    def close(self) -> None:
        self.notices.stop()
        for closable in (self.publisher, self.ema):
            if closable is not None:
                closable.close()
        if self._fsdp and dist.is_initialized():
            dist.destroy_process_group()
        shutil.rmtree(self._tmp, ignore_errors=True)
