"""Packing: layout, budget, rank sharding, and the two properties training relies on —
a packed row scores each sample exactly as a forward of that sample alone, and packed and padded
batches of the same samples give the same gradient.

`random_model` and `random_groups` are shared with the learner's integration tests.
"""

import random

import pytest
import torch

from app.learner.packing import batch_metrics, filler, pack, pad, register_packed_attention, samples_from_groups, shard
from app.objectives import Objectives
from app.objectives.base import SAMPLE_INDEX
from contracts.rollouts import SAMPLING_LOGPROBS, Group, Sample
from core.config import RunConfig
from tests.support.learner_parts import VOCAB, learner_config, random_groups, random_model


def test_layout_aligns_targets_and_restarts_positions():
    samples = samples_from_groups(random_groups(3))
    for mb in pack(samples, token_budget=40, pad_id=0):
        assert mb.input_ids.shape[0] == 1 and mb.attention_mask is None
        pos = mb.logits_to_keep[mb.target_cols]
        # the logits at position p predict token p + 1
        assert torch.equal(mb.input_ids[mb.target_rows, pos + 1], mb.targets)
        starts = (mb.position_ids[0] == 0).nonzero().flatten().tolist()
        assert len(starts) == mb.num_samples
    by_index = {}
    for mb in pad(samples, batch_size=5, pad_id=0):
        pos = mb.logits_to_keep[mb.target_cols]
        assert torch.equal(mb.input_ids[mb.target_rows, pos + 1], mb.targets)
        for i, t in zip(mb.target_sample.tolist(), mb.targets.tolist(), strict=True):
            by_index.setdefault(i, []).append(t)
    assert [by_index[i] for i in range(len(samples))] == [s.completion_ids for s in samples]


def test_pack_respects_budget_keeps_every_sample_and_isolates_oversized_ones():
    samples = samples_from_groups(random_groups(6))
    budget = 30
    batches = pack(samples, budget, pad_id=0)
    assert sum(mb.num_samples for mb in batches) == len(samples)
    assert all(mb.num_tokens <= budget for mb in batches)
    assert sum(mb.num_targets for mb in batches) == sum(len(s.completion_ids) for s in samples)
    metrics = batch_metrics(batches, budget)
    assert metrics["batch/pad_frac"] == 0.0
    assert metrics["batch/row_fill_frac"] > 0.8  # first-fit decreasing leaves little room
    assert metrics["batch/samples_per_row"] > 1
    big = samples_from_groups(random_groups(1, group_size=1, max_completion=40, seed=3))
    assert len(pack(big + samples[:2], token_budget=len(big[0]) - 1, pad_id=0)) >= 2  # its own row, uncut
    padded = batch_metrics(pad(samples, 8, pad_id=0), None)
    assert 0 < padded["batch/pad_frac"] < 1 and padded["batch/samples_per_row"] == 1


def test_shard_balances_ranks_and_evens_out_counts_with_fillers():
    batches = pack(samples_from_groups(random_groups(5)), token_budget=25, pad_id=0)
    shares = [shard(batches, r, 3, pad_id=0) for r in range(3)]
    assert len({len(s) for s in shares}) == 1
    real = [mb for s in shares for mb in s if not mb.is_filler]
    assert sorted(id(mb) for mb in real) == sorted(id(mb) for mb in batches)
    assert filler(0).num_targets == 1 and filler(0).is_filler
    fillers = [mb for share in shares for mb in share if mb.is_filler]
    assert fillers and all(mb.streams.keys() == batches[0].streams.keys() for mb in fillers)  # what losses read
    assert all(v.tolist() == [0.0] for mb in fillers for v in mb.streams.values())


def test_packed_row_scores_like_separate_forwards(tmp_path):
    from transformers import AutoModelForCausalLM

    path = random_model(tmp_path / "m")
    reference = AutoModelForCausalLM.from_pretrained(path, attn_implementation="sdpa").eval()
    packed_model = AutoModelForCausalLM.from_pretrained(path, attn_implementation=register_packed_attention()).eval()
    samples = samples_from_groups(random_groups(2))
    (mb,) = pack(samples, token_budget=1000, pad_id=0)
    assert mb.num_samples == len(samples) and mb.cu_seqlens.tolist()[-1] == mb.num_tokens
    with torch.no_grad():
        packed = packed_model(
            input_ids=mb.input_ids, position_ids=mb.position_ids, packed_cu_seqlens=mb.cu_seqlens, use_cache=False
        ).logits[0]
        p = mb.logits_to_keep[mb.target_cols]
        for i, s in enumerate(samples):
            alone = reference(input_ids=torch.tensor([s.input_ids]), use_cache=False).logits[0]
            mine = mb.target_sample == i
            first = len(s.prompt_ids) - 1
            expected = alone[first : first + len(s.completion_ids)]
            torch.testing.assert_close(packed[p[mine]], expected, atol=2e-5, rtol=1e-5)
        # Without the boundaries the samples would see each other: the check above can fail.
        leaky = packed_model(input_ids=mb.input_ids, position_ids=mb.position_ids, use_cache=False).logits[0]
        assert (leaky[p] - packed[p]).abs().max() > 1e-2


def test_padded_batch_needs_no_mask_when_right_padded(tmp_path):
    from transformers import AutoModelForCausalLM

    path = random_model(tmp_path / "m")
    reference = AutoModelForCausalLM.from_pretrained(path, attn_implementation="sdpa").eval()
    packed_model = AutoModelForCausalLM.from_pretrained(path, attn_implementation=register_packed_attention()).eval()
    (mb,) = pad(samples_from_groups(random_groups(2)), batch_size=100, pad_id=0)
    with torch.no_grad():
        masked = reference(input_ids=mb.input_ids, attention_mask=mb.attention_mask, use_cache=False).logits
        causal = packed_model(input_ids=mb.input_ids, position_ids=mb.position_ids, use_cache=False).logits
    real = mb.attention_mask.bool()
    torch.testing.assert_close(causal[real], masked[real], atol=2e-5, rtol=1e-5)


@pytest.mark.parametrize("checkpointing", [False, True])
def test_packed_and_padded_batches_give_the_same_gradient(tmp_path, checkpointing):
    from app.learner.rank import LearnerRank

    torch.set_num_threads(1)
    path = random_model(tmp_path / "m")
    groups = random_groups(4, seed=1)
    grads = {}
    for batching in ("packed", "padded"):
        cfg = learner_config(
            batching=batching, token_budget=48, per_device_train_batch_size=3, gradient_checkpointing=checkpointing
        )
        learner = LearnerRank(cfg, path)
        learner.setup()
        # LoRA B starts at zero, which makes A's gradient zero: give B a value so every gradient is exercised.
        torch.manual_seed(1)
        for name, p in learner.model.named_parameters():
            if "lora_B" in name:
                torch.nn.init.normal_(p, std=0.1)
        metrics = learner.forward_backward(groups)
        grads[batching] = {n: p.grad.clone() for n, p in learner.model.named_parameters() if p.requires_grad}
        assert metrics["batch/trained_tokens"] == sum(len(s.completion_ids) for g in groups for s in g.samples)
        if batching == "packed":
            assert metrics["batch/pad_frac"] == 0.0
        else:
            assert metrics["batch/pad_frac"] > 0.1
    assert grads["packed"].keys() == grads["padded"].keys()
    assert max(g.abs().max().item() for g in grads["packed"].values()) > 1e-4  # not trivially zero
    for name, g in grads["packed"].items():
        torch.testing.assert_close(g, grads["padded"][name], atol=1e-6, rtol=1e-4, msg=name)


def episode_group(group_id: int = 50, seed: int = 1) -> Group:
    """A group of two multi-turn episodes: model turns (mask 1) interleaved with observations (mask 0)."""
    rng = random.Random(seed)
    prompt = [rng.randrange(1, VOCAB) for _ in range(5)]
    samples = []
    for k in range(2):
        ids, mask, logps = [], [], []
        for turn in range(3):
            n_model, n_obs = rng.randint(1, 4), rng.randint(2, 5) if turn < 2 else 0
            ids += [rng.randrange(1, VOCAB) for _ in range(n_model + n_obs)]
            mask += [1] * n_model + [0] * n_obs
            logps += [-rng.uniform(3.5, 4.8) for _ in range(n_model)] + [float("nan")] * n_obs
        samples.append(Sample(ids, logps, float(k), completion_mask=mask, turn_rewards=[float(k)] * 3, num_turns=3))
    return Objectives.from_config(RunConfig()).annotate(Group(group_id, "episode", prompt, 0, samples))


def test_the_targets_of_an_episode_are_exactly_its_model_tokens_and_it_packs_with_single_turn_groups():
    groups = [*random_groups(2), episode_group()]
    samples = samples_from_groups(groups)
    (mb,) = pack(samples, token_budget=4096, pad_id=0)
    expected = [t for g in groups for s in g.samples for t in s.model_token_ids()]
    order = mb.target_sample.tolist()
    by_sample = {}
    for idx, tok in zip(order, mb.targets.tolist(), strict=True):
        by_sample.setdefault(idx, []).append(tok)
    assert sorted(t for toks in by_sample.values() for t in toks) == sorted(expected)
    for index, sample in enumerate(samples):
        assert by_sample[index] == [sample.completion_ids[j] for j in sample.target_offsets()]
    # Each target is predicted from the position just before it, observations included in the context.
    row = mb.input_ids[0]
    for c, tok in zip(mb.target_cols.tolist(), mb.targets.tolist(), strict=True):
        assert row[mb.logits_to_keep[c] + 1] == tok
    assert not torch.isnan(mb.streams[SAMPLING_LOGPROBS]).any()  # observation tokens' NaN never reach the loss
    assert torch.equal(mb.streams[SAMPLE_INDEX], mb.target_sample.float())  # the learner's own stream
    for name, values in mb.streams.items():  # every sample's stream sits at its trained tokens, in order
        if name == SAMPLE_INDEX:
            continue
        for index, sample in enumerate(samples):
            at = (mb.target_sample == index).nonzero().flatten()
            expected = torch.tensor([sample.streams[name][j] for j in sample.target_offsets()], dtype=torch.float32)
            assert torch.equal(values[at], expected), name
    episode = samples[-1]
    assert episode.num_targets == sum(episode.completion_mask) < len(episode.completion_ids)
    assert mb.num_targets == sum(s.num_targets for s in samples)


def test_a_packed_row_scores_an_episodes_model_tokens_like_a_forward_of_the_episode_alone(tmp_path):
    from transformers import AutoModelForCausalLM

    register_packed_attention()
    model = AutoModelForCausalLM.from_pretrained(random_model(tmp_path / "m"), attn_implementation="spotrl_packed_sdpa")
    samples = samples_from_groups([*random_groups(1), episode_group()])
    (mb,) = pack(samples, token_budget=4096, pad_id=0)
    with torch.no_grad():
        logits = model(input_ids=mb.input_ids, position_ids=mb.position_ids, packed_cu_seqlens=mb.cu_seqlens).logits[0]
        packed = torch.log_softmax(logits[mb.logits_to_keep[mb.target_cols]], -1).gather(-1, mb.targets[:, None])[:, 0]
        alone = []
        for s in samples:
            lp = torch.log_softmax(model(input_ids=torch.tensor([s.input_ids])).logits[0], -1)
            alone += [lp[len(s.prompt_ids) - 1 + j, s.completion_ids[j]] for j in s.target_offsets()]
    by_index = sorted(range(len(mb.targets)), key=lambda m: (mb.target_sample[m].item(), m))
    torch.testing.assert_close(packed[by_index], torch.stack(alone), atol=1e-5, rtol=0)


def test_a_mask_of_the_wrong_length_is_refused():
    group = episode_group()
    group.samples[0].completion_mask = group.samples[0].completion_mask[:-1]
    with pytest.raises(ValueError, match="mask"):
        samples_from_groups([group])


def test_packing_lays_out_whatever_streams_the_samples_carry_and_refuses_samples_that_disagree():
    groups = random_groups(2, seed=4)
    for group in groups:  # a stream no part of packing knows, as a later objective would attach one
        for sample in group.samples:
            sample.streams["teacher_logprobs"] = [-float(t) for t in sample.completion_ids]
    samples = samples_from_groups(groups)
    for mb in pack(samples, token_budget=30, pad_id=0):
        assert set(mb.streams) == {SAMPLING_LOGPROBS, "advantages", "teacher_logprobs", SAMPLE_INDEX}
        assert torch.equal(mb.streams["teacher_logprobs"], -mb.targets.float())
    del groups[1].samples[2].streams["teacher_logprobs"]
    with pytest.raises(ValueError, match="group 1: streams"):
        samples_from_groups(groups)
    groups[1].samples[2].streams["teacher_logprobs"] = [0.0]
    with pytest.raises(ValueError, match="values of teacher_logprobs"):
        samples_from_groups(groups)


def test_segments_on_cuda_never_take_cudnn_attention_which_replans_for_every_sample_length():
    from app.learner.packing import _segment_backends

    # sdpa's backend switches are process-wide flags, settable without a GPU: what a CUDA forward would see.
    before = torch.backends.cuda.cudnn_sdp_enabled()
    with _segment_backends(torch.device("cuda")):
        assert not torch.backends.cuda.cudnn_sdp_enabled()
        assert torch.backends.cuda.flash_sdp_enabled() and torch.backends.cuda.math_sdp_enabled()
    assert torch.backends.cuda.cudnn_sdp_enabled() == before
    with _segment_backends(torch.device("cpu")):  # the CPU keeps sdpa's own choice
        assert torch.backends.cuda.cudnn_sdp_enabled() == before
