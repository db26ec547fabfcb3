"""Log-probs and entropy of the sampled tokens without ever holding the `[tokens x vocab]` logits.

Qwen2.5 has a 151,936-token vocabulary: the plain path (`token_logprobs` on the model's
logits) materialises the logits, an fp32 copy, the tempered copy and the softmax temporaries of the
entropy, tens of GB for one 16k-token row. Here the hidden states of the predicting positions go
through the output layer a chunk of tokens at a time; each chunk's log-probs and entropy are taken
at the sampling temperature and its logits are dropped before the next chunk.

The backward pass needs no logits either. The output layer is frozen (LoRA never targets it), so
the only gradient is the one into the hidden states, and for the log-prob of token t that is
`(onehot(t) - softmax) @ W / temperature`: a `[tokens x hidden]` matrix computed in the same chunked
pass and scaled by the incoming gradient in backward. Peak memory is one chunk's logits, the values
equal the unchunked ones (fp32 to 1e-5, tested), and no logits are recomputed.
"""

from __future__ import annotations

from contextlib import contextmanager

import torch

DEFAULT_CHUNK_TOKENS = 1024


def token_logprobs(
    logits: torch.Tensor, targets: torch.Tensor, temperature: float
) -> tuple[torch.Tensor, torch.Tensor]:
    """Log-prob of each target token and the entropy of its distribution, both at `temperature`.

    vLLM (with `logprobs_mode="processed_logprobs"`) reports log-probs of the tempered distribution
    it sampled from, so the learner must divide its logits by the same temperature before the
    softmax, or the ratio is off on every token. The softmax runs in float32 (float64 stays float64)
    whatever the model's dtype, so it adds no bfloat16 rounding of its own. Entropy carries no gradient.
    """
    scaled = logits.to(torch.promote_types(logits.dtype, torch.float32)) / temperature
    log_norm = torch.logsumexp(scaled, dim=-1)
    logp = scaled.gather(-1, targets.unsqueeze(-1)).squeeze(-1) - log_norm
    with torch.no_grad():
        entropy = log_norm - (torch.softmax(scaled, dim=-1) * scaled).sum(-1)
    return logp, entropy


def _chunk_values(hidden, weight, bias, targets, temperature, want_grad):
    """(log-probs, entropy, d logp / d hidden or None) of one chunk, at `temperature`, softmax in fp32."""
    logits = torch.nn.functional.linear(hidden, weight, bias)  # the model's dtype, as the lm_head computes it
    scaled = logits.to(torch.promote_types(logits.dtype, torch.float32)) / temperature
    del logits
    log_norm = torch.logsumexp(scaled, dim=-1)
    logp = scaled.gather(-1, targets.unsqueeze(-1)).squeeze(-1) - log_norm
    probs = torch.exp(scaled - log_norm.unsqueeze(-1))
    entropy = log_norm - (probs * scaled).sum(-1)
    del scaled
    grad = None
    if want_grad:
        # d logp_t / d logits = (onehot(t) - p) / T; through the frozen output layer: @ W.
        probs.neg_().scatter_add_(-1, targets.unsqueeze(-1), torch.ones_like(logp).unsqueeze(-1))
        grad = (probs.to(weight.dtype) @ weight).to(logp.dtype) / temperature
    return logp, entropy, grad


class _ChunkedLogProbs(torch.autograd.Function):
    @staticmethod
    def forward(ctx, hidden, weight, bias, targets, temperature, chunk_tokens):
        want_grad = hidden.requires_grad
        parts = [
            _chunk_values(
                hidden[s : s + chunk_tokens], weight, bias, targets[s : s + chunk_tokens], temperature, want_grad
            )
            for s in range(0, hidden.shape[0], chunk_tokens)
        ]
        float_dtype = torch.promote_types(hidden.dtype, torch.float32)
        if not parts:
            empty = hidden.new_zeros(0, dtype=float_dtype)
            ctx.save_for_backward(hidden.new_zeros(hidden.shape, dtype=float_dtype))
            return empty, empty.clone()
        logp = torch.cat([p[0] for p in parts])
        entropy = torch.cat([p[1] for p in parts])
        ctx.save_for_backward(torch.cat([p[2] for p in parts]) if want_grad else None)
        ctx.hidden_dtype = hidden.dtype
        ctx.mark_non_differentiable(entropy)
        return logp, entropy

    @staticmethod
    def backward(ctx, grad_logp, grad_entropy):
        (dlogp_dhidden,) = ctx.saved_tensors
        grad_hidden = None
        if dlogp_dhidden is not None and ctx.needs_input_grad[0]:
            grad_hidden = (grad_logp.unsqueeze(-1) * dlogp_dhidden).to(ctx.hidden_dtype)
        return grad_hidden, None, None, None, None, None


def chunked_token_logprobs(
    hidden: torch.Tensor,
    weight: torch.Tensor,
    targets: torch.Tensor,
    temperature: float,
    *,
    bias: torch.Tensor | None = None,
    chunk_tokens: int = DEFAULT_CHUNK_TOKENS,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Log-prob of each target token and the entropy of its distribution, as `token_logprobs(hidden @ W.T + b)`.

    `hidden` is `[tokens, hidden_size]` (the positions that predict `targets`), `weight` the frozen
    output layer. Gradients flow into `hidden` only; entropy carries none.
    """
    if weight.requires_grad or (bias is not None and bias.requires_grad):
        raise ValueError("chunked_token_logprobs: the output layer must be frozen (LoRA does not train lm_head)")
    if chunk_tokens < 1:
        raise ValueError(f"chunk_tokens must be >= 1, got {chunk_tokens}")
    return _ChunkedLogProbs.apply(hidden, weight, bias, targets, temperature, chunk_tokens)


class LogProbHead(torch.nn.Module):
    """Stands in for a causal LM's `lm_head` so that a forward pass can return log-probs instead of logits.

    Outside `scoring()` it is the original head. Inside, the model's forward hands it the hidden
    states (at `logits_to_keep`), and it returns `stack([logp, entropy])` of the requested targets in
    place of the logits: the chunked computation runs inside the model's own forward, where FSDP has
    gathered the output layer's weight.
    """

    def __init__(self, head: torch.nn.Linear, chunk_tokens: int = DEFAULT_CHUNK_TOKENS):
        super().__init__()
        self.head = head
        self.chunk_tokens = chunk_tokens
        self._request: tuple | None = None

    @property
    def weight(self) -> torch.Tensor:  # what `get_output_embeddings().weight` callers expect
        return self.head.weight

    @contextmanager
    def scoring(self, rows: torch.Tensor, cols: torch.Tensor, targets: torch.Tensor, temperature: float):
        """Within the block, the model's `logits` output is `[2, M]`: target m's log-prob and entropy,
        predicted by the hidden state at `[rows[m], cols[m]]` of the kept positions."""
        self._request = (rows, cols, targets, temperature)
        try:
            yield
        finally:
            self._request = None

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:
        if self._request is None:
            return self.head(hidden)
        rows, cols, targets, temperature = self._request
        logp, entropy = chunked_token_logprobs(
            hidden[rows, cols],
            self.head.weight,
            targets,
            temperature,
            bias=self.head.bias,
            chunk_tokens=self.chunk_tokens,
        )
        return torch.stack([logp, entropy])
