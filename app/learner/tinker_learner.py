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
`app.objectives.tinker_losses`'. Sampler versions, saved states and exports are committed to the tenant's prefix of the
fleet's bucket (`app.learner.tinker_states`); the learner answers their numbers, and the service records the tinker
paths it hands out for them (`core.bucket.tinker_registry`).

A spot notice for the learner's node (`contracts.notices`: the cloud's metadata, a scheduler's file or SIGTERM, Ray
draining the node) is heard by a watcher of its own (`notice`); the service then saves every client's state after
each of its optimizer steps (`deployments.tinker.service`), so the learner that Ray starts again elsewhere restores
each client where it stopped.
"""

from __future__ import annotations

import tempfile
from pathlib import Path

import torch
import torch.distributed as dist

from app.learner import tinker_states
from app.learner.logprobs import LogProbHead, forward_scores
from app.learner.model import DTYPES, fully_shard_model, init_distributed, rendezvous_address
from app.learner.packing import TrainSample, register_packed_attention, shard_samples
from app.learner.tinker_states import Client, params
from app.objectives.tinker_losses import LossInputError, check_inputs, check_loss, datum_loss
from contracts.tinker import (
    AdamStep,
    AdapterSpec,
    Export,
    Lineage,
    LossCall,
    LossReply,
    Publication,
    StepReply,
)

ATTENTION = ["q_proj", "k_proj", "v_proj", "o_proj"]
MLP = ["gate_proj", "up_proj", "down_proj"]
PLACEHOLDER = "placeholder"  # the rank-1 adapter on every adaptable layer that is never trained (see the docstring)
# Tokens of one forward: a call's datums are packed in rows of up to this many (a longer datum gets a row of its own),
# so an RL step's 128 short datums cost one forward, and a GPU's long ones bound the activations.
BATCH_TOKENS = 8192


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
        self.clients: dict[str, Client] = {}
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
        weights = [p for n, p in self.peft.named_parameters() if f".{name}." in n]
        for p in weights:
            p.requires_grad_(True)
        self.clients[model] = Client(name, spec, torch.optim.AdamW(weights, lr=1e-4))

    def drop(self, model: str) -> bool:
        """Forget training client `model`'s adapter and optimizer (an idle session's, a finished one's)."""
        client = self.clients.pop(model, None)
        if client is None:
            return False
        self.peft.delete_adapter(client.adapter)
        return True

    def models(self) -> list[str]:
        return sorted(self.clients)

    def _activate(self, model: str) -> Client:
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
        return LossReply([logprobs[i] for i in range(len(call.data))], float(total))

    @staticmethod
    def _set_aside_gradient(client: Client) -> list[torch.Tensor | None]:
        """The client's gradient so far (summed over the ranks already), cleared: a call's own is reduced alone."""
        earlier = [p.grad for p in params(client)]
        for p in params(client):
            p.grad = None
        return earlier

    @staticmethod
    def _sum_gradient_over_ranks(client: Client, earlier: list[torch.Tensor | None]) -> None:
        """This call's gradient, summed over the ranks (one all-reduce), added to what the client had before it."""
        weights = params(client)
        flat = torch.cat([(p.grad if p.grad is not None else torch.zeros_like(p)).flatten() for p in weights])
        dist.all_reduce(flat)
        for p, before, summed in zip(weights, earlier, flat.split([p.numel() for p in weights]), strict=True):
            summed = summed.view_as(p)
            p.grad = summed if before is None else before + summed

    def optim_step(self, step: AdamStep) -> StepReply:
        """One AdamW step of the client's adapter with the step's hyperparameters; its gradients are cleared."""
        client = self._activate(step.model)
        grad_norm = torch.nn.utils.clip_grad_norm_(
            params(client), step.grad_clip_norm if step.grad_clip_norm > 0 else float("inf")
        )
        for group in client.optimizer.param_groups:
            group.update(
                lr=step.learning_rate, betas=(step.beta1, step.beta2), eps=step.eps, weight_decay=step.weight_decay
            )
        client.optimizer.step()
        client.optimizer.zero_grad(set_to_none=True)
        client.steps += 1
        return StepReply(float(grad_norm), client.steps)

    # ---- versions and states (`app.learner.tinker_states`) --------------------------------------------

    def publish(self, model: str, lineage: Lineage) -> Publication:
        """Commit the client's adapter as the tenant's next `policy-vN`, signed with its lineage's key."""
        return tinker_states.publish(self.peft, self._activate(model), self.model_path, lineage)

    def adopt(self, lineage: Lineage, source: str, version: int, source_key: str) -> Publication:
        """Copy sampler version `version` of the prefix `source` (another tenant's, which published its path) into
        this tenant's lineage as its next version, signed with its key: the fleet serves a tenant its own lineage
        only, so another tenant's published weights are sampled from a copy of them. The copy is signed anew, so the
        original must verify under its owner's key (`source_key`) first: one planted in the owner's prefix by another
        writer of the bucket is refused (`NotSigned`), never laundered into this tenant's lineage."""
        return tinker_states.adopt(lineage, source, version, source_key)

    def save_state(self, model: str, lineage: Lineage, gradient: bool = False) -> int:
        """Commit the client's adapter, optimizer and spec as the tenant's next state; its number. With `gradient`
        (the service's own saves on a spot notice) what `forward_backward` accumulated and no `optim_step` applied
        yet is kept too."""
        return tinker_states.save_state(self.peft, self._activate(model), model, self.model_path, lineage, gradient)

    def export(self, model: str, lineage: Lineage) -> Export:
        """Commit the client's adapter as a PEFT folder (`adapter_model.safetensors`, `adapter_config.json`: what
        `PeftModel.from_pretrained` and vLLM load) to the tenant's exports, for download."""
        return tinker_states.export(self.peft, self._activate(model), model, self.model_path, lineage)

    def load_state(
        self, model: str, lineage: Lineage, number: int, optimizer: bool, source: str | None = None
    ) -> AdapterSpec:
        """A new client `model` from the tenant's state `number` (its optimizer's moments too with `optimizer`), or
        from state `number` under the prefix `source`, another tenant's that published it."""
        with tempfile.TemporaryDirectory(prefix="tinker-load-") as tmp:
            spec, steps, folder = tinker_states.fetch_state(lineage, number, source, Path(tmp) / "state")
            self.drop(model)
            self.create(model, spec)
            tinker_states.restore(self.peft, self.clients[model], folder, optimizer, steps, self.device)
        return spec


def train_sample(index: int, datum) -> TrainSample:
    """Datum `index` as the packer lays samples out: position j of its inputs is scored on `target_tokens[j]`.

    A sample's position j + 1 - len(prompt) predicts its completion token j; a datum's first input is the prompt,
    the rest its completion, and one more token (the last target; never attended by a scored position) gives its
    last position a completion slot."""
    inputs, targets = list(datum.input_tokens), list(datum.target_tokens)
    return TrainSample(inputs[:1], inputs[1:] + targets[-1:], {}, (index, 0), target_ids=targets)


def _watch(spot):
    """A started watcher of this process's node (`core.config.SpotConfig`): the clouds' metadata, the scheduler's file,
    SIGTERM, Ray's drain; an interruption drains the node in Ray, so that Ray starts the learner again elsewhere."""
    from app.learner.notices import drain_if_asked, node_watcher

    def heard(notice) -> None:
        if notice.binding:
            drain_if_asked(spot, notice)

    return node_watcher(spot, [heard]).start()
