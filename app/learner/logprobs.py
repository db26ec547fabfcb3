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

Top-k distillation (`app.objectives.distill`, `mode: topk`) also wants the log-probs at k more ids per token (the
teacher's top k), with gradient. Their gradients differ only in the one-hot row, `(W[id] - p @ W) / temperature`,
so the same pass keeps `p @ W` (`[tokens x hidden]`, as above) and a copy of the output layer's rows at the ids it
was asked (at most the whole layer, however long the sequence); backward weighs those rows by the incoming
gradient a chunk at a time. Still no `[tokens x vocab]` tensor beyond one chunk's, and the weight is never read
in backward (FSDP may have resharded it by then).

A run that samples with top-k/top-p/min-p gets its vLLM log-probs normalised over the kept tokens; the head then
masks, chunk by chunk, the tokens the sampler would not keep (`app.learner.truncation`) before the log-softmax, so
the ratio compares like with like.
"""

from __future__ import annotations

from contextlib import contextmanager

import torch

from app.learner.truncation import Truncation, kept, truncate

DEFAULT_CHUNK_TOKENS = 1024


def token_logprobs(
    logits: torch.Tensor, targets: torch.Tensor, temperature: float, truncation: Truncation | None = None
) -> tuple[torch.Tensor, torch.Tensor]:
    """Log-prob of each target token and the entropy of its distribution, both at `temperature` (and over the tokens
    the sampler's `truncation` keeps, `app.learner.truncation`, as vLLM's are).

    vLLM (with `logprobs_mode="processed_logprobs"`) reports log-probs of the tempered distribution
    it sampled from, so the learner must divide its logits by the same temperature before the
    softmax, or the ratio is off on every token. The softmax runs in float32 (float64 stays float64)
    whatever the model's dtype, so it adds no bfloat16 rounding of its own. Entropy carries no gradient.
    """
    scaled = logits.to(torch.promote_types(logits.dtype, torch.float32)) / temperature
    if truncation is not None and truncation.active:  # out of place: `logits` may carry a gradient
        with torch.no_grad():
            keep = kept(scaled, truncation, targets)
        scaled = scaled.masked_fill(~keep, torch.finfo(scaled.dtype).min)
    log_norm = torch.logsumexp(scaled, dim=-1)
    logp = scaled.gather(-1, targets.unsqueeze(-1)).squeeze(-1) - log_norm
    with torch.no_grad():
        entropy = log_norm - (torch.softmax(scaled, dim=-1) * scaled).sum(-1)
    return logp, entropy


def _chunk_values(hidden, weight, bias, targets, temperature, want_grad, truncation=None):
    """(log-probs, entropy, d logp / d hidden or None) of one chunk, at `temperature` and over the tokens the
    sampler's `truncation` keeps, softmax in fp32 (outside the kept set `probs` is 0, so the gradient is right)."""
    logits = torch.nn.functional.linear(hidden, weight, bias)  # the model's dtype, as the lm_head computes it
    scaled = truncate(logits.to(torch.promote_types(logits.dtype, torch.float32)) / temperature, truncation, targets)
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
    def forward(ctx, hidden, weight, bias, targets, temperature, chunk_tokens, truncation):
        want_grad = hidden.requires_grad
        parts = [
            _chunk_values(
                hidden[s : s + chunk_tokens],
                weight,
                bias,
                targets[s : s + chunk_tokens],
                temperature,
                want_grad,
                truncation,
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
        return grad_hidden, None, None, None, None, None, None


def chunked_token_logprobs(
    hidden: torch.Tensor,
    weight: torch.Tensor,
    targets: torch.Tensor,
    temperature: float,
    *,
    bias: torch.Tensor | None = None,
    chunk_tokens: int = DEFAULT_CHUNK_TOKENS,
    truncation: Truncation | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Log-prob of each target token and the entropy of its distribution, as
    `token_logprobs(hidden @ W.T + b, truncation=truncation)`.

    `hidden` is `[tokens, hidden_size]` (the positions that predict `targets`), `weight` the frozen
    output layer. Gradients flow into `hidden` only; entropy carries none.
    """
    if weight.requires_grad or (bias is not None and bias.requires_grad):
        raise ValueError("chunked_token_logprobs: the output layer must be frozen (LoRA does not train lm_head)")
    if chunk_tokens < 1:
        raise ValueError(f"chunk_tokens must be >= 1, got {chunk_tokens}")
    return _ChunkedLogProbs.apply(hidden, weight, bias, targets, temperature, chunk_tokens, truncation)


def _chunk_values_at(hidden, weight, bias, targets, ids, temperature, want_grad):
    """(log-probs of the targets, entropy, log-probs at `ids` [chunk, k], p @ W or None) of one chunk."""
    logits = torch.nn.functional.linear(hidden, weight, bias)
    scaled = logits.to(torch.promote_types(logits.dtype, torch.float32)) / temperature
    del logits
    log_norm = torch.logsumexp(scaled, dim=-1)
    logp = scaled.gather(-1, targets.unsqueeze(-1)).squeeze(-1) - log_norm
    at_ids = scaled.gather(-1, ids) - log_norm.unsqueeze(-1)
    probs = torch.exp(scaled - log_norm.unsqueeze(-1))
    entropy = log_norm - (probs * scaled).sum(-1)
    del scaled
    expected = (probs.to(weight.dtype) @ weight).to(logp.dtype) if want_grad else None  # p @ W
    return logp, entropy, at_ids, expected


class _ChunkedLogProbsAt(torch.autograd.Function):
    """`_ChunkedLogProbs` plus the log-probs at `ids` (`[tokens, k]`), both with gradient into `hidden`."""

    @staticmethod
    def forward(ctx, hidden, weight, bias, targets, ids, temperature, chunk_tokens):
        want_grad = hidden.requires_grad
        parts = [
            _chunk_values_at(
                hidden[s : s + chunk_tokens],
                weight,
                bias,
                targets[s : s + chunk_tokens],
                ids[s : s + chunk_tokens],
                temperature,
                want_grad,
            )
            for s in range(0, hidden.shape[0], chunk_tokens)
        ]
        float_dtype = torch.promote_types(hidden.dtype, torch.float32)
        if parts:
            logp, entropy, at_ids = (torch.cat([p[i] for p in parts]) for i in range(3))
        else:
            logp = hidden.new_zeros(0, dtype=float_dtype)
            entropy, at_ids = logp.clone(), hidden.new_zeros((0, ids.shape[1]), dtype=float_dtype)
        ctx.mark_non_differentiable(entropy)
        ctx.want_grad, ctx.hidden_dtype, ctx.temperature, ctx.chunk_tokens = (
            want_grad,
            hidden.dtype,
            temperature,
            chunk_tokens,
        )
        if want_grad:
            # The output layer's rows at every id asked (the targets first), and where each token's ids sit among them.
            rows, where = torch.unique(torch.cat([targets.unsqueeze(-1), ids], dim=-1), return_inverse=True)
            expected = torch.cat([p[3] for p in parts]) if parts else hidden.new_zeros(hidden.shape, dtype=float_dtype)
            ctx.save_for_backward(expected, weight[rows].detach(), where)
        return logp, entropy, at_ids

    @staticmethod
    def backward(ctx, grad_logp, grad_entropy, grad_at_ids):
        if not ctx.want_grad or not ctx.needs_input_grad[0]:
            return (None,) * 7
        expected, rows, where = ctx.saved_tensors
        grads = torch.cat([grad_logp.unsqueeze(-1), grad_at_ids], dim=-1)  # [tokens, 1 + k], as `where`
        # d/dh of sum_j g_j logp(id_j) = (sum_j g_j W[id_j] - (sum_j g_j) p @ W) / T, a chunk of tokens at a time:
        # one chunk's gathered rows are [chunk / (1 + k), 1 + k, hidden], no larger than one chunk's hidden states.
        step = max(1, ctx.chunk_tokens // grads.shape[1])
        weighted = (
            torch.cat(
                [
                    torch.einsum("nk,nkh->nh", grads[s : s + step], rows[where[s : s + step]].to(grads.dtype))
                    for s in range(0, grads.shape[0], step)
                ]
            )
            if grads.shape[0]
            else expected.new_zeros(expected.shape)
        )
        grad_hidden = (weighted - grads.sum(-1, keepdim=True) * expected) / ctx.temperature
        return grad_hidden.to(ctx.hidden_dtype), None, None, None, None, None, None


def chunked_logprobs_at(
    hidden: torch.Tensor,
    weight: torch.Tensor,
    targets: torch.Tensor,
    ids: torch.Tensor,
    temperature: float,
    *,
    bias: torch.Tensor | None = None,
    chunk_tokens: int = DEFAULT_CHUNK_TOKENS,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """`chunked_token_logprobs` and the log-prob of each of `ids` (`[tokens, k]`) at each token, all at `temperature`:
    `log_softmax(hidden @ W.T + b)` gathered at the targets and at `ids`, one chunk of tokens at a time.

    Gradients flow into `hidden` only, from the targets' log-probs and from those at `ids`; entropy carries none.
    """
    if weight.requires_grad or (bias is not None and bias.requires_grad):
        raise ValueError("chunked_logprobs_at: the output layer must be frozen (LoRA does not train lm_head)")
    if chunk_tokens < 1:
        raise ValueError(f"chunk_tokens must be >= 1, got {chunk_tokens}")
    if ids.dim() != 2 or ids.shape[0] != targets.shape[0]:
        raise ValueError(f"ids must be [tokens, k] with one row per target, got {tuple(ids.shape)}")
    return _ChunkedLogProbsAt.apply(hidden, weight, bias, targets, ids, temperature, chunk_tokens)


class LogProbHead(torch.nn.Module):
    """Stands in for a causal LM's `lm_head` so that a forward pass can return log-probs instead of logits.

    Outside `scoring()` it is the original head. Inside, the model's forward hands it the hidden
    states (at `logits_to_keep`), and it returns `stack([logp, entropy])` of the requested targets in
    place of the logits: the chunked computation runs inside the model's own forward, where FSDP has
    gathered the output layer's weight. With a `truncation` (the run's sampler's top-k/top-p/min-p), the
    targets' log-probs and entropies are over the tokens it keeps, as the sampler's are.
    """

    def __init__(
        self, head: torch.nn.Linear, chunk_tokens: int = DEFAULT_CHUNK_TOKENS, truncation: Truncation | None = None
    ):
        super().__init__()
        self.head = head
        self.chunk_tokens = chunk_tokens
        self.truncation = truncation if truncation is not None and truncation.active else None
        self._request: tuple | None = None

    @property
    def weight(self) -> torch.Tensor:  # what `get_output_embeddings().weight` callers expect
        return self.head.weight

    @contextmanager
    def scoring(
        self,
        rows: torch.Tensor,
        cols: torch.Tensor,
        targets: torch.Tensor,
        temperature: float,
        ids: torch.Tensor | None = None,
    ):
        """Within the block, the model's `logits` output is `[2, M]`: target m's log-prob and entropy,
        predicted by the hidden state at `[rows[m], cols[m]]` of the kept positions; with `ids` (`[M, k]`),
        `[2 + k, M]`: the log-probs at target m's k ids follow."""
        self._request = (rows, cols, targets, temperature, ids)
        try:
            yield
        finally:
            self._request = None

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:
        if self._request is None:
            return self.head(hidden)
        rows, cols, targets, temperature, ids = self._request
        if ids is not None:
            if self.truncation is not None:  # the config refuses it (`RunConfig`); a second guard for other callers
                raise ValueError("log-probs at ids (top-k distillation) under a truncated sampler are not supported")
            logp, entropy, at_ids = chunked_logprobs_at(
                hidden[rows, cols],
                self.head.weight,
                targets,
                ids,
                temperature,
                bias=self.head.bias,
                chunk_tokens=self.chunk_tokens,
            )
            return torch.cat([torch.stack([logp, entropy]), at_ids.T])
        logp, entropy = chunked_token_logprobs(
            hidden[rows, cols],
            self.head.weight,
            targets,
            temperature,
            bias=self.head.bias,
            chunk_tokens=self.chunk_tokens,
            truncation=self.truncation,
        )
        return torch.stack([logp, entropy])


def forward_scores(model, head: LogProbHead, mb, temperature: float, ids: torch.Tensor | None = None) -> torch.Tensor:
    """One forward of micro-batch `mb` (`app.learner.packing.MicroBatch`) through `model`, whose output layer is `head`:
    `[2, M]` (each target's log-prob, with gradient, and entropy) or `[2 + k, M]` with `ids` (`[M, k]`).

    No attention mask: packed rows pass their sample boundaries instead, padded rows are right-padded (see
    `app.learner.packing`); position_ids restart at every packed sample, for the rotary embedding.
    """
    extra = {"packed_cu_seqlens": mb.cu_seqlens} if mb.cu_seqlens is not None else {}
    with head.scoring(mb.target_rows, mb.target_cols, mb.targets, temperature, ids):
        out = model(
            input_ids=mb.input_ids,
            position_ids=mb.position_ids,
            logits_to_keep=mb.logits_to_keep,
            use_cache=False,
            **extra,
        )
    return out.logits
