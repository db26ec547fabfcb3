"""The learner's GPU paths, checked on the CPU: chunked log-probs, and FSDP2 mixed precision on one rank.

Log-probs and gradients through the learner's `LogProbHead` equal the plain path through the logits.
The plain path is what the learner did before the head was wrapped: the model's whole logits at the
kept positions, then `logprobs.token_logprobs`. Both run through the learner's own batching and loss
(`forward_backward`, `score`), in float32 on a small random Qwen2 with tied embeddings, at a sampling
temperature other than 1 and with chunks smaller than a micro-batch: on one rank in-process, and
with FSDP2 across two CPU ranks (gloo), where the output layer's weight is the one FSDP gathered. Top-k
distillation's log-probs at the teacher's ids (`LogProbHead` with ids) too: its loss and gradients equal those
through the whole logits.

Mixed precision: what a CUDA learner runs (FSDP2 on a process group of one, bfloat16 compute, fp32
LoRA masters, fp32 gradient reduction and AdamW state), on the CPU with gloo and the tiny model
(bfloat16 matmuls are only pathologically slow on this CPU at real sizes).
"""

import functools

import torch
import torch.multiprocessing as mp

from app.learner.logprobs import token_logprobs
from app.learner.rank import LearnerRank
from app.objectives import Objectives
from app.objectives.distill import TEACHER_LOGPROBS, Distill, topk_stream_names
from tests.support.fleet_helpers import free_port
from tests.support.learner_parts import VOCAB, learner_config, random_groups, random_model

GROUPS = random_groups(4, seed=7, max_completion=20)


def _config():
    cfg = learner_config(token_budget=48, logprob_chunk_tokens=5)
    cfg.sampling.temperature = 0.7
    return cfg


def plain_forward(learner: LearnerRank, mb):
    """The learner's forward as it was: full logits at the kept positions (outside `scoring` the head is plain)."""
    extra = {"packed_cu_seqlens": mb.cu_seqlens} if mb.cu_seqlens is not None else {}
    out = learner.model(
        input_ids=mb.input_ids,
        position_ids=mb.position_ids,
        logits_to_keep=mb.logits_to_keep,
        use_cache=False,
        **extra,
    )
    return token_logprobs(out.logits[mb.target_rows, mb.target_cols], mb.targets, learner.cfg.sampling.temperature)


TOP_K = 4


def _topk_groups() -> list:
    """GROUPS with a random teacher's top k at every token, as the rollout's teacher leaves them (top-k distillation)."""
    g = torch.Generator().manual_seed(11)
    ids_names, logprob_names = topk_stream_names(TOP_K)
    groups = random_groups(4, seed=7, max_completion=20)
    for group in groups:
        for sample in group.samples:
            n = len(sample.completion_ids)
            ids = torch.stack([torch.randperm(VOCAB, generator=g)[:TOP_K] for _ in range(n)])
            logprobs = torch.log_softmax(torch.randn(n, TOP_K + 1, generator=g), -1)[:, :TOP_K]
            sample.streams[TEACHER_LOGPROBS] = torch.log_softmax(torch.randn(n, 8, generator=g), -1)[:, 0].tolist()
            sample.streams.update({name: ids[:, j].double().tolist() for j, name in enumerate(ids_names)})
            sample.streams.update({name: logprobs[:, j].tolist() for j, name in enumerate(logprob_names)})
    return groups


def plain_forward_at(learner: LearnerRank, mb, ids):
    """`_forward_at` through the model's whole logits at the kept positions: the log-softmax gathered at the ids."""
    extra = {"packed_cu_seqlens": mb.cu_seqlens} if mb.cu_seqlens is not None else {}
    out = learner.model(
        input_ids=mb.input_ids,
        position_ids=mb.position_ids,
        logits_to_keep=mb.logits_to_keep,
        use_cache=False,
        **extra,
    )
    logits = out.logits[mb.target_rows, mb.target_cols]
    logp, entropy = token_logprobs(logits, mb.targets, learner.cfg.sampling.temperature)
    full = torch.log_softmax(logits.float() / learner.cfg.sampling.temperature, -1)
    return logp, entropy.detach(), full.gather(-1, ids)


def _nonzero_lora_b(learner: LearnerRank) -> None:
    """LoRA B starts at zero, which makes A's gradient zero: give B a value (the same on every rank)."""
    torch.manual_seed(1)
    for name, p in learner.model.named_parameters():
        if "lora_B" in name:
            torch.nn.init.normal_(p, std=0.1)


def scores_and_grads(learner: LearnerRank) -> dict:
    """Per path ("chunked": the learner's own, "plain"): the scored log-probs, loss and LoRA gradients."""
    out = {}
    for name, forward in (("chunked", None), ("plain", functools.partial(plain_forward, learner))):
        if forward is not None:
            learner._forward = forward  # an instance attribute: shadows the method for this pass only
        try:
            metrics = learner.forward_backward(GROUPS)
            grads = {}
            for n, p in learner.model.named_parameters():
                if p.requires_grad:
                    grads[n] = (p.grad.full_tensor() if hasattr(p.grad, "full_tensor") else p.grad).clone()
                    p.grad = None
            out[name] = {"scores": learner.score(GROUPS), "loss": metrics["loss"], "grads": grads}
        finally:
            learner.__dict__.pop("_forward", None)
    return out


def topk_loss_and_grads(learner: LearnerRank) -> dict:
    """Per path, the loss and LoRA gradients of top-k distillation (with its tail bucket, between forward and reverse
    KL) through the learner's `forward_backward`: "chunked" its own log-probs at the teacher's ids, "plain" through
    the whole logits."""
    out, objectives = {}, learner.objectives
    learner.objectives = Objectives([Distill(top_k=TOP_K, alpha=0.5, tail=True, is_clip=2.0)])
    groups = _topk_groups()
    for name, forward_at in (("chunked", None), ("plain", functools.partial(plain_forward_at, learner))):
        if forward_at is not None:
            learner._forward_at = forward_at
        try:
            metrics = learner.forward_backward(groups)
            grads = {}
            for n, p in learner.model.named_parameters():
                if p.requires_grad:
                    grads[n] = (p.grad.full_tensor() if hasattr(p.grad, "full_tensor") else p.grad).clone()
                    p.grad = None
            out[name] = {"loss": metrics["loss"], "grads": grads, "divergence": metrics["distill/divergence"]}
        finally:
            learner.__dict__.pop("_forward_at", None)
    learner.objectives = objectives
    return out


def assert_same(results: dict) -> None:
    chunked, plain = results["chunked"], results["plain"]
    flat = [torch.tensor(s) for g in chunked["scores"] for s in g]
    ref = [torch.tensor(s) for g in plain["scores"] for s in g]
    assert sum(len(s) for s in flat) > 40
    torch.testing.assert_close(torch.cat(flat), torch.cat(ref), atol=1e-5, rtol=1e-5)
    assert abs(chunked["loss"] - plain["loss"]) < 1e-5
    assert chunked["grads"].keys() == plain["grads"].keys()
    assert max(g.abs().max().item() for g in plain["grads"].values()) > 1e-4  # not trivially zero
    for name, g in chunked["grads"].items():
        torch.testing.assert_close(g, plain["grads"][name], atol=1e-5, rtol=1e-5, msg=name)
    if "topk" in results:
        chunked, plain = results["topk"]["chunked"], results["topk"]["plain"]
        assert abs(chunked["loss"] - plain["loss"]) < 1e-5 and chunked["divergence"] > 0.01
        assert max(g.abs().max().item() for g in plain["grads"].values()) > 1e-4
        for name, g in chunked["grads"].items():
            torch.testing.assert_close(g, plain["grads"][name], atol=1e-5, rtol=1e-5, msg=f"topk {name}")


def test_one_rank_log_probs_and_gradients_equal_the_plain_path(tmp_path):
    torch.set_num_threads(1)
    learner = LearnerRank(_config(), random_model(tmp_path / "m"))
    learner.setup()
    head = learner.head
    embed = learner.model.get_input_embeddings()
    assert head.weight is embed.weight and not head.weight.requires_grad  # tied, frozen, the same object
    _nonzero_lora_b(learner)
    assert_same({**scores_and_grads(learner), "topk": topk_loss_and_grads(learner)})


def _fsdp_rank(rank: int, model_path: str, port: int, out_file: str) -> None:
    torch.set_num_threads(1)
    learner = LearnerRank(_config(), model_path, rank=rank, world_size=2)
    try:
        learner.setup("127.0.0.1", port)
        _nonzero_lora_b(learner)  # before sharding: plain tensors, identical on both ranks
        learner.prepare_training()
        results = {**scores_and_grads(learner), "topk": topk_loss_and_grads(learner)}
        if rank == 0:
            torch.save(results, out_file)
    finally:
        learner.close()


def test_two_fsdp_ranks_log_probs_and_gradients_equal_the_plain_path(tmp_path):
    out_file = tmp_path / "results.pt"
    args = (random_model(tmp_path / "m"), free_port(), str(out_file))
    mp.start_processes(_fsdp_rank, args=args, nprocs=2, start_method="spawn")
    assert_same(torch.load(out_file))


def _mixed_precision_rank(rank: int, model_path: str, out_file: str) -> None:
    import app.learner.rank as rank_module
    from app.learner.model import mixed_precision_policy

    torch.set_num_threads(1)
    # What a CUDA learner decides, on the CPU: FSDP on a group of one, with the CUDA bfloat16 policy.
    rank_module.mixed_precision_policy = lambda dtype, device_type: mixed_precision_policy(dtype, "cuda")
    cfg = _config()
    cfg.model.dtype = "bfloat16"
    learner = LearnerRank(cfg, model_path)
    learner._fsdp = True
    try:
        learner.setup()
        _nonzero_lora_b(learner)
        learner.prepare_training()
        compute_dtypes = set()
        for module in learner.model.modules():
            if type(module).__name__ == "Linear" and hasattr(module, "lora_A"):
                module.register_forward_hook(lambda m, args, out: compute_dtypes.add(m.lora_A["default"].weight.dtype))
        metrics = learner.forward_backward(GROUPS)
        trainable = {n: p for n, p in learner.model.named_parameters() if p.requires_grad}
        results = {
            "compute": compute_dtypes,
            "masters": {p.dtype for p in trainable.values()},
            "grads": {p.grad.dtype for p in trainable.values()},
            "frozen": {p.dtype for p in learner.model.parameters() if not p.requires_grad},
            "loss": metrics["loss"],
            "before": {n: p.full_tensor().clone() for n, p in trainable.items()},
        }
        results["grad_norm"] = learner.optimizer_step()["grad_norm"]
        results["adam"] = {t.dtype for s in learner.optimizer.state.values() for t in s.values() if t.numel() > 1}
        results["after"] = {n: p.full_tensor().clone() for n, p in trainable.items()}
        torch.save(results, out_file)
    finally:
        learner.close()


def test_one_rank_fsdp_mixed_precision_computes_in_bf16_and_keeps_fp32_masters(tmp_path):
    out_file = tmp_path / "results.pt"
    mp.start_processes(_mixed_precision_rank, args=(random_model(tmp_path / "m"), str(out_file)), start_method="spawn")
    r = torch.load(out_file)
    assert r["compute"] == {torch.bfloat16}  # the LoRA layers ran on bfloat16 copies
    assert r["masters"] == r["grads"] == r["adam"] == {torch.float32}
    assert r["frozen"] == {torch.bfloat16}  # the base stays bfloat16: half the memory
    assert abs(r["loss"]) < 10 and 0 < r["grad_norm"] < float("inf")
    assert any((r["after"][n] - r["before"][n]).abs().max() > 0 for n in r["before"])  # AdamW stepped the masters
