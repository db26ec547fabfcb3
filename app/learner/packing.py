"""Turning scored groups into the micro-batches the learner forwards: padding-free packing or padding.

GRPO completions vary a lot in length (a few tokens to the whole `max_completion_length`), so a
padded batch spends much of its forward on pad tokens. Packing lays whole samples end to end in one
row of at most `token_budget` tokens, with `position_ids` restarting at every sample, and attention
never crosses samples. How attention stays inside a sample matters for speed: a block-diagonal mask
(what transformers builds from restarting `position_ids` for sdpa) is exact but still computes every
masked-out block, which on the CPU made a packed row *slower* than padding; flash-attention's varlen
kernel is not available on the CPU. So the learner's model runs `PACKED_ATTENTION`: sdpa called once
per sample segment (`cu_seqlens`), causal, no mask at all, costing the sum of the samples' squared
lengths instead of the row's. Padded batches go through the same function as plain causal attention
without a mask, which is exact because they are right-padded: a real token only attends to earlier
positions, never to the pads after it. Fixed-count padded batches stay as the baseline the benchmark
compares against.

Rows are filled first-fit-decreasing, which keeps them nearly full; a sample longer than the budget
gets a row of its own rather than being cut (cutting would change its log-probs). Only the logits of
positions that predict a completion token are computed (`logits_to_keep`), since the vocabulary
projection dominates memory for real vocabularies.

Packing knows no algorithm: every per-token stream a sample carries (the sampler's log-probs, and
whatever the run's objectives annotated, `app.objectives`) is laid out at the trained tokens, by name,
for the objectives' losses to read.

With several ranks, every rank computes the same plan from the same groups and takes its share of
micro-batches (longest-processing-time first, by tokens); ranks with fewer micro-batches get filler
ones (one token, zero streams, zero weight), because FSDP needs every rank to run the same number of
forward and backward passes.
"""

from __future__ import annotations

import contextlib
import itertools
from collections.abc import Iterable, Sequence
from dataclasses import dataclass

import torch

from app.objectives.base import SAMPLE_INDEX
from contracts.rollouts import Group, Sample

PACKED_ATTENTION = "spotrl_packed_sdpa"


def packed_sdpa_attention(module, query, key, value, attention_mask, *, packed_cu_seqlens=None, **kwargs):
    """transformers attention function: causal sdpa within each packed sample, or over the whole row.

    `query` is (B, heads, T, head_dim); `packed_cu_seqlens` (S + 1,) are the sample boundaries of a
    one-row packed batch. Returns (B, T, heads, head_dim) like every transformers attention function.
    """
    from transformers.integrations.sdpa_attention import sdpa_attention_forward

    if attention_mask is not None:
        raise ValueError(f"{PACKED_ATTENTION} takes no attention mask (rows are packed or right-padded)")
    kwargs.pop("is_causal", None)  # always causal
    with _segment_backends(query.device):
        if packed_cu_seqlens is None:
            return sdpa_attention_forward(module, query, key, value, None, is_causal=True, **kwargs)
        bounds = packed_cu_seqlens.tolist()
        parts = [
            sdpa_attention_forward(
                module, query[:, :, a:b], key[:, :, a:b], value[:, :, a:b], None, is_causal=True, **kwargs
            )[0]
            for a, b in zip(bounds[:-1], bounds[1:], strict=True)
        ]
    return torch.cat(parts, dim=1), None


def _segment_backends(device: torch.device):
    """sdpa's backends for the learner's segments: on CUDA every one but cuDNN's, elsewhere sdpa's own choice.

    cuDNN's attention (torch's first choice on Hopper) builds an execution plan for every new sequence length, and
    packed samples all differ in length: on an H200 that cost ~1.5 ms of host time per call, forward and backward,
    3,584 calls of each per seed-shaped step, which left the GPU idle for three quarters of the step
    (bench.learner_gpu_profile). Flash attention, next in torch's order, needs no plan and takes grouped KV heads.
    """
    if device.type != "cuda":
        return contextlib.nullcontext()
    from torch.nn.attention import SDPBackend, sdpa_kernel

    return sdpa_kernel([SDPBackend.FLASH_ATTENTION, SDPBackend.EFFICIENT_ATTENTION, SDPBackend.MATH])


def register_packed_attention() -> str:
    """Make `PACKED_ATTENTION` a valid `attn_implementation` (idempotent); returns its name."""
    from transformers import AttentionInterface
    from transformers.masking_utils import AttentionMaskInterface

    AttentionInterface.register(PACKED_ATTENTION, packed_sdpa_attention)
    # No mask is ever materialised: segments are causal on their own, padded rows are right-padded.
    AttentionMaskInterface.register(PACKED_ATTENTION, lambda *args, **kwargs: None)
    return PACKED_ATTENTION


@dataclass(frozen=True)
class TrainSample:
    """One completion with its prompt, ready to score: its tokens, which of them are trained, its streams.

    A multi-turn episode's completion interleaves model turns and observations: only the positions
    `completion_mask` marks are targets (scored, trained, counted in the normaliser); observations are
    context, forwarded like the prompt. A completion token's target is the token itself (what the sampler drew),
    unless `target_ids` names others: the Tinker API's datums say what each position predicts."""

    prompt_ids: list[int]
    completion_ids: list[int]
    streams: dict[str, list[float]]  # per completion token, by name (observation tokens' are never read)
    origin: tuple[int, int]  # (its group's index among the groups packed, its index in the group)
    completion_mask: list[int] | None = None  # 1: a model token, trained; None: every completion token
    target_ids: list[int] | None = None  # what completion position j is scored on; None: completion_ids[j]

    def __len__(self) -> int:
        return len(self.prompt_ids) + len(self.completion_ids)

    @property
    def input_ids(self) -> list[int]:
        return self.prompt_ids + self.completion_ids

    def target_offsets(self) -> list[int]:
        """Indices into `completion_ids` of the tokens that are trained."""
        if self.completion_mask is None:
            return list(range(len(self.completion_ids)))
        return [j for j, m in enumerate(self.completion_mask) if m]

    @property
    def num_targets(self) -> int:
        return len(self.completion_ids) if self.completion_mask is None else sum(self.completion_mask)


def _checked_streams(group: Group, sample: Sample, names: Iterable[str] | None) -> dict[str, list[float]]:
    """The sample's streams, each one value per completion token, named as the other samples' (`names`) are."""
    streams = sample.token_streams()
    n = len(sample.completion_ids)
    for name, values in streams.items():
        if len(values) != n:
            raise ValueError(f"group {group.group_id}: {n} completion tokens but {len(values)} values of {name}")
    if names is not None and set(streams) != set(names):
        raise ValueError(f"group {group.group_id}: streams {sorted(streams)}, other samples carry {sorted(names)}")
    mask = sample.completion_mask
    if mask is not None and len(mask) != n:
        raise ValueError(f"group {group.group_id}: {n} completion tokens but a mask of {len(mask)}")
    return streams


def samples_from_groups(groups: Sequence[Group]) -> list[TrainSample]:
    """Flatten groups into samples with their streams; samples with no model token train nothing."""
    out, names = [], None
    for gi, group in enumerate(groups):
        if not group.prompt_ids:
            raise ValueError(f"group {group.group_id}: empty prompt")
        for si, sample in enumerate(group.samples):
            streams = _checked_streams(group, sample, names)
            names = streams.keys()
            mask = sample.completion_mask
            if any(mask) if mask is not None else sample.completion_ids:
                out.append(
                    TrainSample(
                        list(group.prompt_ids),
                        list(sample.completion_ids),
                        {name: list(values) for name, values in streams.items()},
                        (gi, si),
                        None if mask is None else list(mask),
                    )
                )
    return out


@dataclass
class MicroBatch:
    """One forward/backward pass: B rows of T tokens and the completion tokens scored in them.

    The model returns logits only at `logits_to_keep` (sequence positions shared by all rows);
    target m is predicted by `logits[target_rows[m], target_cols[m]]`.
    """

    input_ids: torch.Tensor  # (B, T)
    position_ids: torch.Tensor  # (B, T)
    attention_mask: torch.Tensor | None  # (B, T) for padded batches; None for packed rows
    cu_seqlens: torch.Tensor | None  # (S + 1,) sample boundaries of a packed row; None for padded batches
    logits_to_keep: torch.Tensor  # (K,)
    target_rows: torch.Tensor  # (M,)
    target_cols: torch.Tensor  # (M,) indices into logits_to_keep
    targets: torch.Tensor  # (M,) the completion tokens
    streams: dict[str, torch.Tensor]  # name -> (M,) float32: each sample's streams at its targets
    target_sample: torch.Tensor  # (M,) index of each target's sample in the list that was packed
    num_samples: int
    num_tokens: int  # real (non-pad) tokens forwarded
    is_filler: bool = False  # a zero-weight pass that only keeps FSDP's collectives in step

    @property
    def num_slots(self) -> int:
        """Token slots forwarded, pad included."""
        return self.input_ids.numel()

    @property
    def num_targets(self) -> int:
        return self.targets.numel()

    def to(self, device: torch.device) -> MicroBatch:
        # cu_seqlens stays on the host: attention slices with its values, and reading them from a GPU would
        # synchronise once per layer.
        moved = {
            k: v.to(device) if isinstance(v, torch.Tensor) and k != "cu_seqlens" else v
            for k, v in self.__dict__.items()
        }
        moved["streams"] = {k: v.to(device) for k, v in self.streams.items()}
        return MicroBatch(**moved)


def _layout(rows: list[list[tuple[int, TrainSample]]], pad_id: int, packed: bool) -> MicroBatch:
    """Place (index, sample) pairs: `packed` puts each row's samples end to end; else one per row, padded."""
    width = max(sum(len(s) for _, s in row) for row in rows)
    ids = torch.full((len(rows), width), pad_id, dtype=torch.long)
    pos = torch.zeros((len(rows), width), dtype=torch.long)
    mask = torch.zeros((len(rows), width), dtype=torch.long)
    t_rows, t_pos, targets, t_sample = [], [], [], []
    streams: dict[str, list[float]] = {name: [] for name in rows[0][0][1].streams}
    for r, row in enumerate(rows):
        offset = 0
        for index, s in row:
            n = len(s)
            ids[r, offset : offset + n] = torch.tensor(s.input_ids)
            pos[r, offset : offset + n] = torch.arange(n)
            mask[r, offset : offset + n] = 1
            # The logits at position p predict token p + 1: completion token j is predicted at prompt_len - 1 + j.
            first = offset + len(s.prompt_ids) - 1
            trained = s.target_offsets()
            t_rows += [r] * len(trained)
            t_pos += (first + j for j in trained)
            targets += ((s.target_ids or s.completion_ids)[j] for j in trained)
            for name, values in s.streams.items():
                streams[name] += (values[j] for j in trained)
            t_sample += [index] * len(trained)
            offset += n
    t_pos_t = torch.tensor(t_pos, dtype=torch.long)
    keep, cols = torch.unique(t_pos_t, sorted=True, return_inverse=True)
    cu_seqlens = None
    if packed:
        if len(rows) != 1:
            raise ValueError("a packed micro-batch is one row")
        cu_seqlens = torch.tensor([0, *itertools.accumulate(len(s) for _, s in rows[0])], dtype=torch.int32)
    else:
        pos = torch.arange(width).expand(len(rows), width).clone()  # right padding: real tokens sit at 0..n-1
    return MicroBatch(
        input_ids=ids,
        position_ids=pos,
        attention_mask=None if packed else mask,
        cu_seqlens=cu_seqlens,
        logits_to_keep=keep,
        target_rows=torch.tensor(t_rows, dtype=torch.long),
        target_cols=cols,
        targets=torch.tensor(targets, dtype=torch.long),
        streams={
            **{name: torch.tensor(values, dtype=torch.float32) for name, values in streams.items()},
            SAMPLE_INDEX: torch.tensor(t_sample, dtype=torch.float32),  # a sample is never split over micro-batches
        },
        target_sample=torch.tensor(t_sample, dtype=torch.long),
        num_samples=sum(len(row) for row in rows),
        num_tokens=int(mask.sum()),
    )


def pack(samples: Sequence[TrainSample], token_budget: int, pad_id: int) -> list[MicroBatch]:
    """Padding-free rows of at most `token_budget` tokens (first-fit decreasing), one row per micro-batch."""
    order = sorted(range(len(samples)), key=lambda i: -len(samples[i]))  # stable: ties keep input order
    rows: list[list[tuple[int, TrainSample]]] = []
    loads: list[int] = []
    for i in order:
        n = len(samples[i])
        for r, load in enumerate(loads):
            if load + n <= token_budget:
                rows[r].append((i, samples[i]))
                loads[r] += n
                break
        else:
            rows.append([(i, samples[i])])
            loads.append(n)
    return [_layout([row], pad_id, packed=True) for row in rows]


def pad(samples: Sequence[TrainSample], batch_size: int, pad_id: int) -> list[MicroBatch]:
    """The baseline: `batch_size` samples per micro-batch in arrival order, right-padded to the longest."""
    return [
        _layout([[(j, samples[j])] for j in range(i, min(i + batch_size, len(samples)))], pad_id, packed=False)
        for i in range(0, len(samples), batch_size)
    ]


def filler(pad_id: int, streams: Iterable[str] = ()) -> MicroBatch:
    """A one-token micro-batch, zero in each of `streams`, whose loss the learner multiplies by zero."""
    sample = TrainSample([pad_id], [pad_id], dict.fromkeys(streams, [0.0]), (0, 0))
    mb = _layout([[(0, sample)]], pad_id, packed=True)
    mb.is_filler = True
    return mb


def balance(sizes: Sequence[int], world_size: int) -> list[list[int]]:
    """Indices of `sizes` per rank, the largest first to the least loaded: every rank computes the same split."""
    owned: list[list[int]] = [[] for _ in range(world_size)]
    loads = [0] * world_size
    for i in sorted(range(len(sizes)), key=lambda i: -sizes[i]):
        r = min(range(world_size), key=lambda k: (loads[k], k))
        owned[r].append(i)
        loads[r] += sizes[i]
    return [sorted(o) for o in owned]


def shard(batches: Sequence[MicroBatch], rank: int, world_size: int, pad_id: int) -> list[MicroBatch]:
    """This rank's micro-batches: balanced by tokens over ranks, padded with fillers to the same count."""
    if world_size == 1:
        return list(batches)
    owned = balance([b.num_slots for b in batches], world_size)
    count = max(len(o) for o in owned)
    mine = [batches[i] for i in owned[rank]]
    return mine + [filler(pad_id, batches[0].streams) for _ in range(count - len(mine))]


def shard_samples(
    samples: Sequence[TrainSample], rank: int, world_size: int, token_budget: int, pad_id: int
) -> tuple[list[int], list[MicroBatch]]:
    """This rank's share of `samples` (their indices), balanced by tokens over ranks, and its packed micro-batches,
    padded with fillers to as many as the rank with the most: when a call holds few samples, one row each would
    leave all but one rank idle, so samples are split over ranks before they are packed."""
    owned = balance([len(s) for s in samples], world_size)
    packed = [pack([samples[i] for i in o], token_budget, pad_id) for o in owned]
    count = max(len(p) for p in packed)
    mine = packed[rank]
    return owned[rank], mine + [filler(pad_id) for _ in range(count - len(mine))]


def batch_metrics(batches: Sequence[MicroBatch], token_budget: int | None) -> dict[str, float]:
    """How well the forward was used: pad share, row fill (against the budget when packed), samples per row."""
    slots = sum(b.num_slots for b in batches)
    tokens = sum(b.num_tokens for b in batches)
    rows = sum(b.input_ids.shape[0] for b in batches)
    samples = sum(b.num_samples for b in batches)
    capacity = rows * token_budget if token_budget else slots
    return {
        "batch/microbatches": float(len(batches)),
        "batch/rows": float(rows),
        "batch/samples": float(samples),
        "batch/samples_per_row": samples / max(rows, 1),
        "batch/forwarded_tokens": float(slots),
        "batch/real_tokens": float(tokens),
        "batch/trained_tokens": float(sum(b.num_targets for b in batches)),
        "batch/pad_frac": 1 - tokens / max(slots, 1),
        "batch/row_fill_frac": tokens / max(capacity, 1),
    }
