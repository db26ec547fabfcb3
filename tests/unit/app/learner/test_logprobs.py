"""Chunked log-probs equal the plain ones (values, entropy, gradients) and the head swap is transparent."""

import pytest
import torch

from app.learner.logprobs import LogProbHead, chunked_logprobs_at, chunked_token_logprobs, token_logprobs


def _case(tokens=37, hidden=16, vocab=101, seed=0, dtype=torch.float32):
    g = torch.Generator().manual_seed(seed)
    h = torch.randn(tokens, hidden, generator=g, dtype=dtype)
    w = torch.randn(vocab, hidden, generator=g, dtype=dtype) * 0.5
    b = torch.randn(vocab, generator=g, dtype=dtype) * 0.1
    t = torch.randint(0, vocab, (tokens,), generator=g)
    return h, w, b, t


@pytest.mark.parametrize("chunk", [1, 5, 37, 1000])
@pytest.mark.parametrize("temperature", [1.0, 0.7])
def test_chunked_values_and_gradients_equal_the_unchunked_ones(chunk, temperature):
    h, w, b, t = _case()
    upstream = torch.randn(h.shape[0], generator=torch.Generator().manual_seed(1))

    ref_h = h.clone().requires_grad_()
    ref_logp, ref_entropy = token_logprobs(torch.nn.functional.linear(ref_h, w, b), t, temperature)
    (ref_logp * upstream).sum().backward()

    ours_h = h.clone().requires_grad_()
    logp, entropy = chunked_token_logprobs(ours_h, w, t, temperature, bias=b, chunk_tokens=chunk)
    (logp * upstream).sum().backward()

    torch.testing.assert_close(logp, ref_logp, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(entropy, ref_entropy, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(ours_h.grad, ref_h.grad, atol=1e-5, rtol=1e-5)
    assert not entropy.requires_grad


def test_bfloat16_hidden_states_give_fp32_values_close_to_the_plain_path():
    h, w, _, t = _case(dtype=torch.bfloat16)
    ref_logp, _ = token_logprobs(torch.nn.functional.linear(h, w), t, 1.0)
    logp, _ = chunked_token_logprobs(h, w, t, 1.0, chunk_tokens=8)
    assert logp.dtype == torch.float32
    torch.testing.assert_close(logp, ref_logp, atol=1e-5, rtol=1e-5)  # same bf16 logits, same fp32 softmax


def test_no_grad_scoring_and_empty_input():
    h, w, _, t = _case()
    with torch.no_grad():
        logp, entropy = chunked_token_logprobs(h, w, t, 1.0, chunk_tokens=4)
    assert logp.shape == entropy.shape == (h.shape[0],)
    empty_logp, empty_entropy = chunked_token_logprobs(h[:0], w, t[:0], 1.0)
    assert empty_logp.numel() == empty_entropy.numel() == 0


def test_a_trainable_output_layer_is_refused():
    h, w, _, t = _case()
    with pytest.raises(ValueError, match="frozen"):
        chunked_token_logprobs(h, w.requires_grad_(), t, 1.0)


def test_log_prob_head_is_the_plain_head_outside_scoring_and_log_probs_inside():
    h, w, b, t = _case(tokens=12)
    linear = torch.nn.Linear(w.shape[1], w.shape[0])
    with torch.no_grad():
        linear.weight.copy_(w)
        linear.bias.copy_(b)
    linear.requires_grad_(False)
    head = LogProbHead(linear, chunk_tokens=5)
    hidden = h.view(3, 4, -1)  # rows x kept positions x hidden
    torch.testing.assert_close(head(hidden), linear(hidden))
    assert head.weight is linear.weight
    rows, cols = torch.tensor([0, 1, 2, 2]), torch.tensor([3, 0, 1, 2])
    targets = t[:4]
    with head.scoring(rows, cols, targets, 0.9):
        out = head(hidden)
    ref_logp, ref_entropy = token_logprobs(linear(hidden)[rows, cols], targets, 0.9)
    torch.testing.assert_close(out[0], ref_logp, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(out[1], ref_entropy, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(head(hidden), linear(hidden))  # the request ends with the block


def _ids(tokens: int, vocab: int, k: int, seed: int = 2) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return torch.stack([torch.randperm(vocab, generator=g)[:k] for _ in range(tokens)])


@pytest.mark.parametrize("chunk", [1, 5, 37, 1000])
@pytest.mark.parametrize("temperature", [1.0, 0.7])
def test_log_probs_at_more_ids_and_their_gradients_equal_the_full_log_softmax(chunk, temperature):
    """Top-k distillation's path: the targets' and k more ids' log-probs per token, gradients from both at once."""
    h, w, b, t = _case()
    ids = _ids(h.shape[0], w.shape[0], 6)
    g = torch.Generator().manual_seed(1)
    up_logp, up_ids = torch.randn(h.shape[0], generator=g), torch.randn(ids.shape, generator=g)

    ref_h = h.clone().requires_grad_()
    full = torch.log_softmax(torch.nn.functional.linear(ref_h, w, b) / temperature, -1)
    ((full.gather(-1, t[:, None])[:, 0] * up_logp).sum() + (full.gather(-1, ids) * up_ids).sum()).backward()

    ours_h = h.clone().requires_grad_()
    logp, entropy, at_ids = chunked_logprobs_at(ours_h, w, t, ids, temperature, bias=b, chunk_tokens=chunk)
    ((logp * up_logp).sum() + (at_ids * up_ids).sum()).backward()

    _, ref_entropy = token_logprobs(torch.nn.functional.linear(h, w, b), t, temperature)
    torch.testing.assert_close(logp, full.gather(-1, t[:, None])[:, 0], atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(at_ids, full.gather(-1, ids), atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(entropy, ref_entropy, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(ours_h.grad, ref_h.grad, atol=1e-5, rtol=1e-5)
    assert not entropy.requires_grad


def test_log_probs_at_ids_without_grad_empty_and_refused():
    h, w, _, t = _case()
    ids = _ids(h.shape[0], w.shape[0], 3)
    with torch.no_grad():
        logp, _, at_ids = chunked_logprobs_at(h, w, t, ids, 1.0, chunk_tokens=4)
    assert at_ids.shape == (h.shape[0], 3) and logp.shape == (h.shape[0],)
    empty = chunked_logprobs_at(h[:0].requires_grad_(), w, t[:0], ids[:0], 1.0)
    assert [x.shape[0] for x in empty] == [0, 0, 0]
    with pytest.raises(ValueError, match="one row per target"):
        chunked_logprobs_at(h, w, t, ids[:-1], 1.0)
    with pytest.raises(ValueError, match="frozen"):
        chunked_logprobs_at(h, w.clone().requires_grad_(), t, ids, 1.0)


def test_log_prob_head_answers_the_log_probs_at_ids_after_the_targets():
    h, w, b, t = _case(tokens=12)
    linear = torch.nn.Linear(w.shape[1], w.shape[0])
    with torch.no_grad():
        linear.weight.copy_(w)
        linear.bias.copy_(b)
    linear.requires_grad_(False)
    head = LogProbHead(linear, chunk_tokens=3)
    hidden = h.view(3, 4, -1)
    rows, cols, targets = torch.tensor([0, 1, 2, 2]), torch.tensor([3, 0, 1, 2]), t[:4]
    ids = _ids(4, w.shape[0], 5)
    with head.scoring(rows, cols, targets, 0.9, ids):
        out = head(hidden)
    full = torch.log_softmax(linear(hidden)[rows, cols] / 0.9, -1)
    assert out.shape == (2 + 5, 4)
    torch.testing.assert_close(out[0], full.gather(-1, targets[:, None])[:, 0], atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(out[2:].T, full.gather(-1, ids), atol=1e-5, rtol=1e-5)
