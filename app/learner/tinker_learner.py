"""The learner behind the Tinker API: one base model, one LoRA adapter per training client, fed clients' Datums.

A Tinker training client is an adapter that a script trains step by step (`forward_backward`, `optim_step`), not a
run with a rollout: so this learner holds no loop of its own. It is a Ray actor (`launch/tinker.py` starts it,
named `contracts.tinker.LEARNER_ACTOR`) that keeps the base model once and one PEFT adapter per client
(`add_adapter`), each with its own AdamW; a call names its adapter, which is made the active one, so clients never
share a weight, a gradient or an optimizer moment. Ray runs one call at a time, and the HTTP side orders a client's
calls by their `seq_id`.

Precision and device follow the run learner's (`app.learner.model`): on the CPU float32; on a GPU (`device: cuda`,
the one Ray gives the actor) the frozen base may be bfloat16 while every adapter keeps fp32 masters and fp32 AdamW
moments (PEFT casts adapter weights up), the forward running under bfloat16 autocast.

On several devices this class is one rank of `app.learner.tinker_group.TinkerLearnerGroup`: the frozen base is
sharded over the ranks with FSDP2 as the run learner's is (`join`), so a base too large for one device is served,
while every adapter stays whole on every rank, outside FSDP (`ignored_params`; PEFT adds a client's adapter to the
sharded model, under wrappers a rank-1 placeholder adapter put on every adapted layer before sharding). A call's
datums are split over the ranks (`app.learner.packing.shard_samples`), each rank's gradient is summed over the ranks
once per call (the losses are sums over datums), and the optimizer steps the same on every rank, which keeps the
replicas equal; log-probs are gathered to every rank. Writing to the bucket is rank 0's alone.

A call's datums go through the model as the run learner's groups do (`app.learner.packing`): packed end to end in rows
of up to `BATCH_TOKENS` tokens, attention kept inside each datum without a mask, and log-probs taken chunk by chunk in
the output layer (`app.learner.logprobs.LogProbHead`: float32 softmax, never the `[tokens x vocab]` logits; temperature
1, since the sampler's log-probs that the fleet returns are at the sampling temperature, which a Tinker client sets to
1 for RL). A datum's targets are its own (`target_tokens`, not necessarily the next inputs). The losses are
`app.objectives.tinker_losses`'. A sampler version is a PEFT folder committed to the tenant's prefix of the fleet's
bucket (`core.bucket.AdapterStore`, signed with the lineage's key), exactly what `app.weight_sync` publishes for a
run; a saved state is the adapter and its optimizer through `core.bucket.CheckpointStore`, and an export
(`save_weights_external`) the adapter alone in PEFT's format, for the user to download. The tinker path a user was
given for any of them is recorded beside them (`tinker/paths/` of the tenant's prefix, `record`), so that a service
that restarted, knowing no path any more, finds them again; a record may carry an expiry (the SDK's `ttl_seconds`),
past which the path is gone: not listed, not found by `record`, and deleted from the bucket at the next listing.

A spot notice for the learner's node (`contracts.notices`: the cloud's metadata, a scheduler's file or SIGTERM, Ray
draining the node) is heard by a watcher of its own (`notice`); the service then saves every client's state after
each of its optimizer steps (`deployments.tinker.service`), so the learner that Ray starts again elsewhere restores
each client where it stopped.
"""

from __future__ import annotations

import json
import tempfile
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.distributed as dist

from app.learner.logprobs import LogProbHead, forward_scores
from app.learner.model import DTYPES, fully_shard_model, init_distributed, rendezvous_address
from app.learner.packing import TrainSample, register_packed_attention, shard_samples
from app.objectives.tinker_losses import LossInputError, check_inputs, check_loss, datum_loss
from contracts.auth import Secret
from contracts.tinker import (
    AdamStep,
    AdapterSpec,
    Export,
    Lineage,
    LossCall,
    LossReply,
    Publication,
)
from core.bucket import tinker_paths
from core.bucket.tinker_paths import own_record, record_kind

ATTENTION = ["q_proj", "k_proj", "v_proj", "o_proj"]
MLP = ["gate_proj", "up_proj", "down_proj"]
OPTIMIZER_FILE = "optimizer.pt"
GRADIENT_FILE = "gradient.pt"  # a state the service kept mid-step: the adapter's gradient, in its optimizer's order
SPEC_FILE = "tinker_spec.json"
PLACEHOLDER = "placeholder"  # the rank-1 adapter on every adaptable layer that is never trained (see the docstring)
# Tokens of one forward: a call's datums are packed in rows of up to this many (a longer datum gets a row of its own),
# so an RL step's 128 short datums cost one forward, and a GPU's long ones bound the activations.
BATCH_TOKENS = 8192


@dataclass
class _Client:
    """One training client's adapter: its PEFT name, what it was created with, its optimizer."""

    adapter: str
    spec: AdapterSpec
    optimizer: torch.optim.AdamW
    steps: int = 0


def target_modules(spec: AdapterSpec) -> list[str]:
    """The linear layers a client's adapter covers (the output layer never: vLLM serves no LoRA on it)."""
    modules = (ATTENTION if spec.train_attn else []) + (MLP if spec.train_mlp else [])
    if not modules:
        raise LossInputError("an adapter needs train_attn or train_mlp (train_unembed alone is not served)")
    return modules


class TinkerLearner:
    """The base model at `model_path` with an adapter per training client (`create`, `drop`), trained by `LossCall`s
    and `AdamStep`s, published as versions (`publish`) and saved and restored (`save_state`, `load_state`)."""

    def __init__(
        self,
        model_path: str,
        max_models: int = 8,
        spot=None,
        device: str = "cpu",
        dtype: str = "float32",
        rank: int = 0,
        world_size: int = 1,
    ):
        """`rank` of `world_size` ranks (`TinkerLearnerGroup`): the ranks must `join` before any other call."""
        from peft import LoraConfig, get_peft_model
        from transformers import AutoModelForCausalLM

        if dtype not in DTYPES:
            raise ValueError(f"dtype {dtype!r}: expected one of {', '.join(DTYPES)}")
        if device == "cuda" and not torch.cuda.is_available():
            raise RuntimeError("the Tinker learner was asked for device cuda and this process sees no GPU")
        torch.set_num_threads(max(1, torch.get_num_threads()))
        self.model_path, self.max_models = model_path, max_models
        self.rank, self.world_size = rank, world_size
        self.device = torch.device("cuda" if device == "cuda" else "cpu")  # Ray shows the actor its own GPU only
        self.dtype = DTYPES[dtype]
        self.base = AutoModelForCausalLM.from_pretrained(
            model_path, dtype=self.dtype, attn_implementation=register_packed_attention()
        ).to(self.device)
        self.base.config.use_cache = False
        # The adapters cover named attention and MLP layers only, never this wrapped output layer.
        self.head = LogProbHead(self.base.get_output_embeddings())
        self.base.set_output_embeddings(self.head)
        self.pad_id = self.base.config.pad_token_id if self.base.config.pad_token_id is not None else 0
        # PEFT wraps the adaptable layers once, here: clients' adapters are added under these wrappers (also on a
        # sharded base, where replacing a layer would escape FSDP), and the last client's can be deleted.
        placeholder = LoraConfig(r=1, lora_alpha=1, target_modules=ATTENTION + MLP, task_type="CAUSAL_LM")
        self.peft = get_peft_model(self.base, placeholder, adapter_name=PLACEHOLDER)
        for p in self.peft.parameters():
            p.requires_grad_(False)
        self.clients: dict[str, _Client] = {}
        self._counter = 0
        self._notices = _watch(spot) if spot is not None and spot.watch else None

    def join(self, master_addr: str, master_port: int) -> None:
        """Join the ranks' process group and shard the frozen base over them (FSDP2); every adapter stays outside."""
        init_distributed(self.rank, self.world_size, master_addr, master_port, self.device.type)
        adapters = [p for name, p in self.peft.named_parameters() if "lora_" in name]
        fully_shard_model(self.peft, self.world_size, self.device.type, ignored_params=adapters)

    def rendezvous_address(self) -> tuple[str, int]:
        return rendezvous_address()

    def notice(self) -> str | None:
        """The interruption notice heard for this learner's node, in words; None while there is none."""
        binding = self._notices.binding if self._notices is not None else None
        return binding.describe() if binding is not None else None

    # ---- adapters -----------------------------------------------------------------------------------

    def create(self, model: str, spec: AdapterSpec, init_seed: int | None = None) -> None:
        """A fresh adapter for training client `model` (a no-op when it exists with the same spec), drawn from
        `init_seed`, else the spec's seed, else a fresh one (ranks are given one seed: their replicas must agree)."""
        from peft import LoraConfig

        if model in self.clients:
            if self.clients[model].spec != spec:
                raise LossInputError(f"model {model} exists with another adapter spec")
            return
        if len(self.clients) >= self.max_models:
            raise LossInputError(f"the learner holds {self.max_models} adapters, its capacity")
        config = LoraConfig(
            r=spec.rank, lora_alpha=2 * spec.rank, target_modules=target_modules(spec), task_type="CAUSAL_LM"
        )
        name = f"m{self._counter}"
        self._counter += 1
        # A seeded client draws the same init every time; an unseeded one a fresh one.
        seed = next((s for s in (init_seed, spec.seed) if s is not None), None)
        torch.manual_seed(seed if seed is not None else torch.seed())
        self.peft.add_adapter(name, config)
        params = [p for n, p in self.peft.named_parameters() if f".{name}." in n]
        for p in params:
            p.requires_grad_(True)
        self.clients[model] = _Client(name, spec, torch.optim.AdamW(params, lr=1e-4))

    def drop(self, model: str) -> bool:
        """Forget training client `model`'s adapter and optimizer (an idle session's, a finished one's)."""
        client = self.clients.pop(model, None)
        if client is None:
            return False
        self.peft.delete_adapter(client.adapter)
        return True

    def models(self) -> list[str]:
        return sorted(self.clients)

    def _activate(self, model: str) -> _Client:
        client = self.clients.get(model)
        if client is None:
            raise KeyError(f"model {model} is not on this learner (released, or the learner restarted)")
        self.peft.set_adapter(client.adapter)
        return client

    # ---- training -----------------------------------------------------------------------------------

    def forward_backward(self, call: LossCall) -> LossReply:
        """Log-probs of every datum's targets and the batch's loss; with `call.backward`, its gradient accumulates
        into the client's adapter until the next `optim_step`."""
        config = check_loss(call.loss_fn, call.config)
        for datum in call.data:
            if len(datum.input_tokens) != len(datum.target_tokens) or not datum.input_tokens:
                raise LossInputError(
                    f"a datum has {len(datum.input_tokens)} input and {len(datum.target_tokens)} target tokens; "
                    "expected as many of each, at least one"
                )
            check_inputs(call.loss_fn, len(datum.target_tokens), datum.inputs)
        client = self._activate(call.model)
        self.peft.train()
        total = torch.zeros((), device=self.device)
        logprobs: dict[int, list[float]] = {}
        # Half-precision bases compute in their dtype; the adapters' fp32 masters are cast on the fly (as FSDP2's
        # mixed precision does for the run learner), and log-probs are taken in float32 (`LogProbHead`).
        autocast = torch.autocast(self.device.type, dtype=self.dtype, enabled=self.dtype != torch.float32)
        samples = [train_sample(i, d) for i, d in enumerate(call.data)]
        mine, batches = shard_samples(samples, self.rank, self.world_size, BATCH_TOKENS, self.pad_id)
        earlier = self._set_aside_gradient(client) if call.backward and self.world_size > 1 else None
        with torch.set_grad_enabled(call.backward):
            for mb in batches:
                mb = mb.to(self.device)
                with autocast:
                    logp = forward_scores(self.peft, self.head, mb, 1.0)[0]
                if mb.is_filler:  # a pass that only keeps the ranks' FSDP collectives in step
                    loss = logp.sum() * 0.0
                else:
                    # A row's datums, each one's targets together, in the order they were laid out.
                    order, counts = torch.unique_consecutive(mb.target_sample, return_counts=True)
                    losses = []
                    for position, datum_logp in zip(order.tolist(), logp.split(counts.tolist()), strict=True):
                        index = mine[position]
                        inputs = call.data[index].inputs
                        inputs = {
                            k: torch.tensor(v, dtype=torch.float32, device=self.device) for k, v in inputs.items()
                        }
                        losses.append(datum_loss(call.loss_fn, datum_logp, inputs, config))
                        logprobs[index] = datum_logp.detach().tolist()
                    loss = torch.stack(losses).sum()
                if call.backward:
                    loss.backward()  # gradients of every row summed into the adapter until optim_step
                total = total + loss.detach()
        if self.world_size > 1:
            if earlier is not None:
                self._sum_gradient_over_ranks(client, earlier)
            dist.all_reduce(total)
            gathered: list[dict[int, list[float]]] = [{} for _ in range(self.world_size)]
            dist.all_gather_object(gathered, logprobs)
            logprobs = {i: lp for part in gathered for i, lp in part.items()}
        return LossReply([logprobs[i] for i in range(len(call.data))], {"loss:sum": float(total)})

    @staticmethod
    def _set_aside_gradient(client: _Client) -> list[torch.Tensor | None]:
        """The client's gradient so far (summed over the ranks already), cleared: a call's own is reduced alone."""
        earlier = [p.grad for p in _params(client)]
        for p in _params(client):
            p.grad = None
        return earlier

    @staticmethod
    def _sum_gradient_over_ranks(client: _Client, earlier: list[torch.Tensor | None]) -> None:
        """This call's gradient, summed over the ranks (one all-reduce), added to what the client had before it."""
        params = _params(client)
        flat = torch.cat([(p.grad if p.grad is not None else torch.zeros_like(p)).flatten() for p in params])
        dist.all_reduce(flat)
        for p, before, summed in zip(params, earlier, flat.split([p.numel() for p in params]), strict=True):
            summed = summed.view_as(p)
            p.grad = summed if before is None else before + summed

    def optim_step(self, step: AdamStep) -> dict[str, float]:
        """One AdamW step of the client's adapter with the step's hyperparameters; its gradients are cleared."""
        client = self._activate(step.model)
        params = _params(client)
        grad_norm = torch.nn.utils.clip_grad_norm_(
            params, step.grad_clip_norm if step.grad_clip_norm > 0 else float("inf")
        )
        for group in client.optimizer.param_groups:
            group.update(
                lr=step.learning_rate, betas=(step.beta1, step.beta2), eps=step.eps, weight_decay=step.weight_decay
            )
        client.optimizer.step()
        client.optimizer.zero_grad(set_to_none=True)
        client.steps += 1
        return {"grad_norm:mean": float(grad_norm), "step:max": float(client.steps)}

    # ---- versions and states --------------------------------------------------------------------------

    def _write_adapter(self, client: _Client, dest: Path) -> Path:
        from peft import get_peft_model_state_dict
        from safetensors.torch import save_file

        dest.mkdir(parents=True, exist_ok=True)
        weights = get_peft_model_state_dict(self.peft, adapter_name=client.adapter, save_embedding_layers=False)
        save_file({k: v.detach().cpu().contiguous() for k, v in weights.items()}, dest / "adapter_model.safetensors")
        config = self.peft.peft_config[client.adapter]
        config.base_model_name_or_path = self.model_path
        config.save_pretrained(str(dest))
        return dest

    def publish(
        self,
        model: str,
        lineage: Lineage,
        path: str | None = None,
        expires: float | None = None,
        user_metadata: dict[str, str] | None = None,
    ) -> Publication:
        """Commit the client's adapter as the tenant's next `policy-vN` (signed with its lineage's key); `path`, the
        tinker path the user is given for it, is recorded (`record`), to expire at `expires` (epoch seconds)."""
        client = self._activate(model)
        with tempfile.TemporaryDirectory(prefix="tinker-adapter-") as tmp:
            publication = _commit_version(lineage, self._write_adapter(client, Path(tmp) / "adapter"))
        if path is not None:
            _remember(lineage, path, "sampler", publication.version, model, client.spec, expires, user_metadata)
        return publication

    def adopt(self, lineage: Lineage, source: str, version: int, source_key: str) -> Publication:
        """Copy sampler version `version` of the prefix `source` (another tenant's, which published its path) into
        this tenant's lineage as its next version, signed with its key: the fleet serves a tenant its own lineage
        only, so another tenant's published weights are sampled from a copy of them. The copy is signed anew, so the
        original must verify under its owner's key (`source_key`) first: one planted in the owner's prefix by another
        writer of the bucket is refused (`NotSigned`), never laundered into this tenant's lineage."""
        owners = tinker_paths.store(source, "sampler", lineage.cache_dir, Secret(source_key))
        with tempfile.TemporaryDirectory(prefix="tinker-adopt-") as tmp:
            folder = owners.fetch(version, Path(tmp) / "adapter")
            return _commit_version(lineage, folder)

    def save_state(
        self,
        model: str,
        lineage: Lineage,
        path: str | None = None,
        gradient: bool = False,
        expires: float | None = None,
        overwrite: bool = True,
        user_metadata: dict[str, str] | None = None,
    ) -> int:
        """Commit the client's adapter, optimizer and spec as the tenant's next state; returns its number. `path`, the
        tinker path the user is given for it, is recorded (`record`, to expire at `expires`), replacing the state of
        that name only with `overwrite`; the service's own saves after a notice have none (each supersedes the client's
        earlier ones), and keep with `gradient` what `forward_backward` accumulated and no `optim_step` applied yet."""
        client = self._activate(model)
        if path is not None and not overwrite and own_record(lineage.bucket_url, path) is not None:
            raise LossInputError(f"{path} exists: save with overwrite=True to replace it")
        states = _store(lineage, "training")
        with tempfile.TemporaryDirectory(prefix="tinker-state-") as tmp:
            folder = self._write_adapter(client, Path(tmp) / "state")
            torch.save(client.optimizer.state_dict(), folder / OPTIMIZER_FILE)
            grads = [p.grad for p in _params(client)]
            if gradient and any(g is not None for g in grads):
                torch.save(grads, folder / GRADIENT_FILE)
            (folder / SPEC_FILE).write_text(json.dumps({**_adapter_fields(client.spec), "steps": client.steps}))
            meta = {"model": model, "steps": client.steps}
            number = tinker_paths.commit_new(
                lineage.bucket_url, "training", states.latest, lambda n: states.save(n, folder, meta=meta)
            )
        if path is not None:
            _remember(lineage, path, "training", number, model, client.spec, expires, user_metadata)
        else:  # the service's own save: a client is restored from its newest, so older ones go
            for earlier in tinker_paths.keep(lineage.bucket_url, model, number):
                tinker_paths.retire(lineage.bucket_url, "training", earlier)
                states.delete(earlier)
        return number

    def export(self, model: str, lineage: Lineage, path: str, expires: float | None = None) -> Export:
        """Commit the client's adapter as a PEFT folder (`adapter_model.safetensors`, `adapter_config.json`: what
        `PeftModel.from_pretrained` and vLLM load) to the tenant's exports, for download; `path` is recorded."""
        client = self._activate(model)
        exports = _store(lineage, "external")
        with tempfile.TemporaryDirectory(prefix="tinker-export-") as tmp:
            folder = self._write_adapter(client, Path(tmp) / "export")
            files = {f.name: f.stat().st_size for f in folder.iterdir()}
            number = tinker_paths.commit_new(
                lineage.bucket_url, "external", exports.latest, lambda n: exports.save(n, folder, meta={"model": model})
            )
        _remember(lineage, path, "external", number, model, client.spec, expires, size_bytes=sum(files.values()))
        return Export(number, files)

    def record(self, lineage: Lineage, path: str) -> dict | None:
        """The tenant's tinker `path` as recorded when it was saved (the fields `checkpoints` lists), or, for a path
        another tenant published to every key (`share`), its owner's record with `prefix`, the owner's prefix of the
        bucket, where what it names lies; None for a path the tenant cannot reach, or one past its expiry."""
        own = own_record(lineage.bucket_url, path)
        if own is not None:
            return {**own, "kind": record_kind(own)}
        pointer = _public(lineage).get(tinker_paths.record_name(path))
        if pointer is None or pointer.get("path") != path:
            return None
        owners = own_record(pointer["prefix"], path)  # the owner's record decides: deleted, expired, unpublished
        if owners is None or not owners.get("public"):
            return None
        return {**owners, "kind": record_kind(owners), "prefix": pointer["prefix"]}

    def expire(self, lineage: Lineage, path: str, expires: float | None) -> bool:
        """Set (or with None remove) the expiry of the tenant's own `path`; False for a path it does not own."""
        return self._update(lineage, path, expires=expires)

    def share(self, lineage: Lineage, path: str, public: bool) -> bool:
        """Publish the tenant's own `path` to every key of the fleet (`public`), or take it back; False for a path it
        does not own. A published state starts other keys' training clients, published sampler weights sample under
        their own lineage (`adopt`), a published export downloads; only the owner deletes, expires or unpublishes."""
        if not self._update(lineage, path, public=public):
            return False
        if public:
            _public(lineage).put(tinker_paths.record_name(path), {"path": path, "prefix": lineage.bucket_url})
        else:
            _public(lineage).delete(tinker_paths.record_name(path))
        return True

    def _update(self, lineage: Lineage, path: str, **fields) -> bool:
        saved = own_record(lineage.bucket_url, path)
        if saved is None:
            return False
        _paths(lineage.bucket_url).put(tinker_paths.record_name(path), {**saved, **fields})
        return True

    def checkpoints(self, lineage: Lineage) -> list[dict]:
        """Every tinker path the tenant was given and not expired, as recorded (`path`, `number`, `time`, `model`,
        `expires`, the adapter's `rank`, `train_attn`, `train_mlp`, an export's `size_bytes`; records written before
        carry no model or adapter), newest first: what the SDK's checkpoint and training-run listings show. Expired
        ones are deleted from the bucket on the way."""
        live = []
        for saved in _paths(lineage.bucket_url).all():
            if not tinker_paths.expired(saved):
                live.append(saved)
                continue
            try:
                self._delete(lineage, saved)
            except ValueError:  # the newest sampler weights: out of sight now, deleted once newer ones exist
                pass
        return sorted(live, key=lambda r: r.get("time", 0.0), reverse=True)

    def forget(self, lineage: Lineage, path: str) -> bool:
        """Delete what the tenant's tinker `path` names (a saved state, sampler version or export) from the bucket,
        then its record; whether there was one. A fleet that loaded the version keeps serving it until it unloads it;
        no new sampling client can name the path.

        The tenant's newest sampler version stays (ValueError): the next one takes the number after the newest
        committed, and the fleet names what it serves by that number, so deleting the newest would hand its number,
        and its name on the fleet, to other weights."""
        saved = own_record(lineage.bucket_url, path)
        if saved is None:
            return False
        self._delete(lineage, saved)
        return True

    @staticmethod
    def _delete(lineage: Lineage, saved: dict, record: bool = True) -> None:
        """Delete what `saved` names (its number retired for good first), its public pointer and, with `record`, the
        record itself (a record replaced by a new save of its path stays: it is the new one's now)."""
        path, number, kind = saved["path"], int(saved["number"]), record_kind(saved)
        store = _store(lineage, kind)
        if kind == "sampler" and store.latest() == number:
            raise ValueError(f"{path} is the newest sampler weights of this key: save newer ones before deleting it")
        tinker_paths.retire(lineage.bucket_url, kind, number)
        store.delete(number)
        if saved.get("public"):
            _public(lineage).delete(tinker_paths.record_name(path))
        if record:
            _paths(lineage.bucket_url).delete(tinker_paths.record_name(path))

    def load_state(
        self, model: str, lineage: Lineage, number: int, optimizer: bool, source: str | None = None
    ) -> AdapterSpec:
        """A new client `model` from the tenant's state `number` (its optimizer's moments too with `optimizer`), or
        from state `number` under the prefix `source`, another tenant's that published it (`record`'s `prefix`)."""
        from peft import set_peft_model_state_dict
        from safetensors.torch import load_file

        states = _store(lineage, "training", source)
        with tempfile.TemporaryDirectory(prefix="tinker-load-") as tmp:
            folder = states.load(number, Path(tmp) / "state")
            saved = json.loads((folder / SPEC_FILE).read_text())
            spec = AdapterSpec(saved["rank"], None, saved["train_attn"], saved["train_mlp"])
            self.drop(model)
            self.create(model, spec)
            client = self.clients[model]
            set_peft_model_state_dict(
                self.peft,
                load_file(folder / "adapter_model.safetensors", device=str(self.device)),
                adapter_name=client.adapter,
            )
            if optimizer:
                moments = torch.load(folder / OPTIMIZER_FILE, weights_only=True, map_location=self.device)
                client.optimizer.load_state_dict(moments)
                client.steps = int(saved.get("steps", 0))
            if (folder / GRADIENT_FILE).exists():  # a notice's save between forward_backward and optim_step
                grads = torch.load(folder / GRADIENT_FILE, weights_only=True, map_location=self.device)
                for p, grad in zip(_params(client), grads, strict=True):
                    p.grad = grad
        return spec


def _params(client: _Client) -> list[torch.Tensor]:
    """The client's adapter weights in its optimizer's order: the same order for every adapter of one spec."""
    return [p for group in client.optimizer.param_groups for p in group["params"]]


def train_sample(index: int, datum) -> TrainSample:
    """Datum `index` as the packer lays samples out: position j of its inputs is scored on `target_tokens[j]`.

    A sample's position j + 1 - len(prompt) predicts its completion token j; a datum's first input is the prompt,
    the rest its completion, and one more token (the last target; never attended by a scored position) gives its
    last position a completion slot."""
    inputs, targets = list(datum.input_tokens), list(datum.target_tokens)
    return TrainSample(inputs[:1], inputs[1:] + targets[-1:], {}, (index, 0), target_ids=targets)


def _store(lineage: Lineage, kind: str, prefix: str | None = None):
    """The store of the tenant's saved states, sampler versions or exports (those under `prefix`, when another
    tenant's)."""
    return tinker_paths.store(prefix or lineage.bucket_url, kind, lineage.cache_dir)


def _commit_version(lineage: Lineage, folder: Path) -> Publication:
    """Commit a PEFT folder as the tenant's next `policy-vN`, signed with its lineage's key."""
    store = tinker_paths.store(lineage.bucket_url, "sampler", lineage.cache_dir, Secret(lineage.signing_key))
    version = tinker_paths.commit_new(lineage.bucket_url, "sampler", store.latest, lambda n: store.publish(folder, n))
    return Publication(version, store.key_of(version))


def _paths(prefix: str):
    """The records of the tinker paths a tenant was given, in its prefix of the bucket (`tinker/paths/`)."""
    return tinker_paths.paths(prefix)


def _public(lineage: Lineage):
    """The pointers to the paths their owners published (`share`), in the fleet's bucket beside the tenants' prefixes,
    where only the learner writes."""
    return tinker_paths.public(lineage.bucket_url, lineage.run)


def _adapter_fields(spec: AdapterSpec) -> dict:
    """What a saved state's spec file and a path's record say of the adapter."""
    return {"rank": spec.rank, "train_attn": spec.train_attn, "train_mlp": spec.train_mlp}


def _remember(
    lineage: Lineage,
    path: str,
    kind: str,
    number: int,
    model: str,
    spec: AdapterSpec,
    expires: float | None,
    user_metadata: dict[str, str] | None = None,
    size_bytes: int | None = None,
) -> None:
    """Record the tinker `path` the user was given for `number` of the tenant's `kind` store, made by training client
    `model`, gone after `expires` (epoch seconds; None: kept until deleted). What an earlier save of the same path
    named is deleted: a name saved again is replaced, never left in the bucket where no path reaches it."""
    fields = {"model": model, "expires": expires, "size_bytes": size_bytes, "user_metadata": user_metadata}
    replaced = tinker_paths.remember(lineage.bucket_url, path, kind, number, **fields, **_adapter_fields(spec))
    if replaced is not None and (record_kind(replaced), int(replaced["number"])) != (kind, number):
        TinkerLearner._delete(lineage, replaced, record=False)


def _watch(spot):
    """A started watcher of this process's node (`core.config.SpotConfig`): the clouds' metadata, the scheduler's file,
    SIGTERM, Ray's drain; an interruption drains the node in Ray, so that Ray starts the learner again elsewhere."""
    from app.learner.notices import drain_if_asked, node_watcher

    def heard(notice) -> None:
        if notice.binding:
            drain_if_asked(spot, notice)

    return node_watcher(spot, [heard]).start()
