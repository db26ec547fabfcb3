"""The learner's log-probs under the sampler's truncation agree with vLLM's: the ratio of an unchanged policy is 1.

The sampler's side is vLLM 0.32's own code, as the fleet runs it (`logprobs_mode="processed_logprobs"`): temperature,
then its min-p processor (`MinPLogitsProcessor.apply`), then `TopKTopPSampler` (top-k, top-p), which draws the token
and returns the log-softmax over what survived. The learner's side is `token_logprobs` and the chunked path the
learner trains with, given the same logits.
"""

import math
from types import SimpleNamespace

import pytest
import torch
from vllm.v1.sample.logits_processor.builtin import MinPLogitsProcessor
from vllm.v1.sample.ops.topk_topp_sampler import TopKTopPSampler

from app.learner.logprobs import LogProbHead, chunked_token_logprobs, token_logprobs
from app.learner.truncation import Truncation, kept

TOKENS, HIDDEN, VOCAB = 64, 16, 50
TRUNCATIONS = {
    "top_p": Truncation(top_p=0.7),
    "top_k": Truncation(top_k=5),
    "top_k+top_p": Truncation(top_k=8, top_p=0.6),
    "min_p": Truncation(min_p=0.1),
    "all": Truncation(top_k=10, top_p=0.8, min_p=0.05),
}


def _toy(seed=0):
    g = torch.Generator().manual_seed(seed)
    h = torch.randn(TOKENS, HIDDEN, generator=g)
    w = torch.randn(VOCAB, HIDDEN, generator=g)  # peaked enough that truncation cuts real mass
    return h, w


def vllm_sample(logits: torch.Tensor, temperature: float, t: Truncation) -> tuple[torch.Tensor, torch.Tensor]:
    """vLLM's sampler on `logits` (`Sampler.sample` past the greedy branch): the tokens it draws and the log-probs
    it reports for them in processed_logprobs mode."""
    scaled = logits.to(torch.float32) / temperature
    if t.min_p > 0:
        min_p = MinPLogitsProcessor.__new__(MinPLogitsProcessor)  # its state, as update_state would leave it
        min_p.min_p_count, min_p.min_p = 1, torch.full((scaled.shape[0], 1), t.min_p)
        scaled = min_p.apply(scaled)
    n = scaled.shape[0]
    k = torch.full((n,), t.top_k, dtype=torch.int32) if t.top_k > 0 else None
    p = torch.full((n,), t.top_p) if t.top_p < 1 else None
    torch.manual_seed(0)
    # forward_native: the CPU's forward_cpu keeps and reports alike, then draws with a kernel of vLLM's C extension.
    sampled, logprobs = TopKTopPSampler("processed_logprobs").forward_native(scaled, {}, k, p)
    sampled = sampled.long().view(-1)
    return sampled, logprobs.gather(-1, sampled.unsqueeze(-1)).squeeze(-1)


@pytest.mark.parametrize("name", TRUNCATIONS)
@pytest.mark.parametrize("temperature", [1.0, 0.7, 1.3])
def test_an_unchanged_policy_has_ratio_one_under_each_truncation(name, temperature):
    truncation = TRUNCATIONS[name]
    h, w = _toy()
    logits = h @ w.T
    targets, sampler_logp = vllm_sample(logits, temperature, truncation)

    plain, _ = token_logprobs(logits, targets, temperature, truncation)
    chunked, entropy = chunked_token_logprobs(h, w, targets, temperature, chunk_tokens=7, truncation=truncation)
    for learner in (plain, chunked):
        ratio = torch.exp(learner - sampler_logp)
        torch.testing.assert_close(ratio, torch.ones_like(ratio), atol=1e-5, rtol=0)
    assert torch.isfinite(entropy).all()

    full, _ = token_logprobs(logits, targets, temperature)  # what the learner took before: the whole vocabulary
    assert torch.exp(full - sampler_logp).mean() < 0.99  # the bias the truncation removes: the kept mass


def test_the_truncated_distribution_is_the_one_vllm_samples_from():
    """Every token vLLM draws is in the learner's kept set, and the kept sets are vLLM's (the -inf of its log-probs)."""
    h, w = _toy(seed=3)
    logits = h @ w.T
    for truncation in TRUNCATIONS.values():
        scaled = logits / 0.8
        if truncation.min_p > 0:
            continue  # min-p masks before TopKTopPSampler sees the logits; its kept set is covered by the ratio test
        k = torch.full((TOKENS,), truncation.top_k, dtype=torch.int32) if truncation.top_k > 0 else None
        p = torch.full((TOKENS,), truncation.top_p) if truncation.top_p < 1 else None
        _, vllm_logprobs = TopKTopPSampler("processed_logprobs").forward_native(scaled.clone(), {}, k, p)
        argmax = scaled.argmax(-1)  # a target that is always kept, so the mask is the truncation's alone
        assert torch.equal(kept(scaled, truncation, argmax), torch.isfinite(vllm_logprobs))


@pytest.mark.parametrize("name", TRUNCATIONS)
def test_chunked_gradients_equal_autograd_of_the_truncated_log_softmax(name):
    truncation = TRUNCATIONS[name]
    h, w = _toy(seed=1)
    targets, _ = vllm_sample(h @ w.T, 0.9, truncation)
    upstream = torch.randn(TOKENS, generator=torch.Generator().manual_seed(2))

    ref_h = h.clone().requires_grad_()
    ref_logp, ref_entropy = token_logprobs(ref_h @ w.T, targets, 0.9, truncation)
    (ref_logp * upstream).sum().backward()
    ours_h = h.clone().requires_grad_()
    logp, entropy = chunked_token_logprobs(ours_h, w, targets, 0.9, chunk_tokens=5, truncation=truncation)
    (logp * upstream).sum().backward()

    torch.testing.assert_close(logp, ref_logp, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(entropy, ref_entropy, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(ours_h.grad, ref_h.grad, atol=1e-5, rtol=1e-5)
    assert torch.isfinite(ours_h.grad).all()


def test_a_sampled_token_outside_the_learners_kept_set_stays_finite():
    """A policy that moved (or numbers that differ at the nucleus' edge) can leave the drawn token out of the
    learner's set: it is kept, so its log-prob is finite and its ratio small, not 0 with a NaN gradient."""
    logits = torch.tensor([[4.0, 3.0, 0.0, -1.0]])
    least = torch.tensor([3])
    h = logits.clone().requires_grad_()
    logp, entropy = token_logprobs(h, least, 1.0, Truncation(top_k=1))
    logp.sum().backward()
    assert math.isfinite(logp.item()) and math.isfinite(entropy.item())
    assert torch.isfinite(h.grad).all()
    assert logp.item() == pytest.approx(-1.0 - math.log(math.exp(4.0) + math.exp(-1.0)), abs=1e-5)


def test_no_truncation_is_the_whole_vocabulary():
    assert Truncation().active is False
    h, w = _toy()
    logits = h @ w.T
    targets = logits.argmax(-1)
    torch.testing.assert_close(token_logprobs(logits, targets, 0.7, Truncation()), token_logprobs(logits, targets, 0.7))


def test_the_head_takes_the_runs_truncation_and_refuses_it_at_ids():
    h, w = _toy()
    linear = torch.nn.Linear(HIDDEN, VOCAB, bias=False)
    with torch.no_grad():
        linear.weight.copy_(w)
    linear.requires_grad_(False)
    truncation = Truncation(top_p=0.7)
    head = LogProbHead(linear, chunk_tokens=9, truncation=truncation)
    targets, sampler_logp = vllm_sample(h @ w.T, 1.0, truncation)
    hidden = h.view(1, TOKENS, HIDDEN)
    rows, cols = torch.zeros(TOKENS, dtype=torch.long), torch.arange(TOKENS)
    with head.scoring(rows, cols, targets, 1.0):
        out = head(hidden)
    torch.testing.assert_close(out[0], sampler_logp, atol=1e-5, rtol=0)
    with head.scoring(rows, cols, targets, 1.0, ids=targets.unsqueeze(-1)), pytest.raises(ValueError, match="top-k"):
        head(hidden)


def test_of_reads_a_runs_sampling_section():
    from core.config.training import SamplingConfig

    assert Truncation.of(SamplingConfig()) is None
    assert Truncation.of(SamplingConfig(top_p=0.7, top_k=20)) == Truncation(top_k=20, top_p=0.7)
    assert Truncation.of(SamplingConfig(min_p=0.05)) == Truncation(min_p=0.05)
    assert Truncation.of(SimpleNamespace(temperature=1.0)) is None  # the GPU bench's namespace


def test_a_truncated_sampler_with_topk_distillation_is_refused():
    from core.config.loading import load_config

    assert load_config("configs/tiny-cpu.yaml", ["objectives=[{kind: distill, teacher: base, mode: topk}]"])
    with pytest.raises(Exception, match="mode topk compares whole distributions"):
        load_config(
            "configs/tiny-cpu.yaml", ["objectives=[{kind: distill, teacher: base, mode: topk}]", "sampling.top_p=0.7"]
        )
