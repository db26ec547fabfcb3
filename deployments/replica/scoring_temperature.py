"""Prompt log-probs at the request's temperature: what a teacher's scores must be to compare with tempered samples.

The engine runs in `processed_logprobs` mode, so a sampled token's log-prob is taken after temperature. vLLM 0.32
scores prompt tokens (`prompt_logprobs`) before any sampling processor, in every mode: a scoring request at 0.7 got
the model's temperature-1 log-softmax, and a distillation that compares a student's tempered samples with a teacher
scored so compares unlike things (TRL's teacher clients, which send their `teacher_temperature`, and spotrl's own).
There is no engine setting for it, and asking vLLM for more alternatives cannot give the exact tempered value (the
normaliser needs the whole vocabulary). So the engine's worker computes it: `TemperedPromptLogprobs` is a vLLM worker
extension (`worker_extension_cls`) whose one call, made once by the replica after the engine starts, makes its model
runner divide each scoring request's prompt logits by the request's temperature before the log-softmax, the top-k and
the ranks, as vLLM's sampler divides a sampled token's. A greedy request (temperature below vLLM's 1e-5) is scored at
temperature 1, as vLLM's sampler treats greedy rows. Only temperature: top-k, top-p and min-p would give a token
outside the teacher's own nucleus -inf, which no log-ratio survives.

Both of vLLM's model runners are covered: the V1 runner (the CPU's, and a GPU's with `VLLM_USE_V2_MODEL_RUNNER=0`)
computes prompt log-probs per request in `_get_prompt_logprobs_dict`, which is replaced by `v1_prompt_logprobs_dict`
(vLLM 0.32's own, Apache-2.0, with the division added); the V2 runner (a GPU's default) computes them over the batch's
rows with a logits function, which is wrapped to divide each row by its request's temperature. The code is pinned to
the vLLM this project pins; `tests/integration/test_distill.py` checks the numbers against transformers on the CPU
(the V1 runner); the V2 wrapper is unit-tested over a stand-in of vLLM's `PromptLogprobsWorker`.
"""

from __future__ import annotations

import types
from collections.abc import Callable
from typing import Any

# vLLM's `_SAMPLING_EPS`: a request below it is greedy, and its sampler divides greedy rows by 1.
GREEDY_BELOW = 1e-5

# The modes whose log-probs are after temperature (`vllm.config.model.LogprobsMode`); raw modes stay raw.
PROCESSED_MODES = ("processed_logprobs", "processed_logits")


def scoring_temperature(temperature: float | None) -> float:
    """The temperature a request's prompt tokens are scored at: its own, or 1 for a greedy (or unset) one."""
    if temperature is None or temperature < GREEDY_BELOW:
        return 1.0
    return float(temperature)


def row_temperatures(spans: list[tuple[int, int, float]], num_rows: int) -> list[float]:
    """Per row of a batch's hidden states, the temperature its request is scored at: `spans` are (first row, end
    row, temperature) of each request; rows no span covers (padding) are left at 1."""
    rows = [1.0] * num_rows
    for start, end, temperature in spans:
        rows[start:end] = [temperature] * (end - start)
    return rows


def tempered_rows(logits_fn: Callable, hidden_states, temperatures) -> Callable:
    """`logits_fn` whose logits of rows taken from `hidden_states` are divided by those rows' `temperatures` (a
    tensor, one per row). V2 runs the logits function over slices of the batch's hidden states; a slice is a view,
    and where it starts in them is read off its storage offset, so the division follows the rows whatever the
    chunking."""
    import torch

    stride = hidden_states.stride(0)

    def logits_at_temperature(rows):
        if rows.untyped_storage().data_ptr() != hidden_states.untyped_storage().data_ptr() or rows.stride(0) != stride:
            raise RuntimeError("prompt log-probs: the logits function was given rows that are not the batch's")
        first = (rows.storage_offset() - hidden_states.storage_offset()) // stride
        logits = logits_fn(rows).to(torch.float32)
        return logits.div_(temperatures[first : first + rows.shape[0]].unsqueeze(1))

    return logits_at_temperature


def v1_prompt_logprobs_dict(self, hidden_states, num_scheduled_tokens: dict[str, int]) -> dict[str, Any]:
    """vLLM 0.32's `GPUModelRunner._get_prompt_logprobs_dict` (which the CPU runner inherits), bound to a runner in
    its place: the same chunked bookkeeping, with each request's prompt logits divided by its scoring temperature
    (in the processed modes) before the log-softmax and the top-k."""
    import torch
    from vllm.utils.torch_utils import async_tensor_h2d
    from vllm.v1.outputs import LogprobsTensors

    num_prompt_logprobs_dict = self.num_prompt_logprobs
    if not num_prompt_logprobs_dict:
        return {}
    tempered = self.model_config.logprobs_mode in PROCESSED_MODES
    prompt_logprobs_dict: dict[str, Any] = {}
    completed_prefill_reqs = []
    for req_id, num_prompt_logprobs in num_prompt_logprobs_dict.items():
        num_tokens = num_scheduled_tokens.get(req_id)
        if num_tokens is None:  # preempted in prefill
            continue
        request = self.requests[req_id]
        if request.prompt_token_ids is None:  # prompt embeddings have no prompt log-probs
            continue
        num_prompt_tokens = len(request.prompt_token_ids)
        prompt_token_ids = async_tensor_h2d(request.prompt_token_ids, device=self.device)
        logprobs_tensors = request.in_progress_prompt_logprobs_cpu
        if logprobs_tensors is None:  # the whole prompt's, filled chunk by chunk
            logprobs_tensors = LogprobsTensors.empty_cpu(num_prompt_tokens - 1, num_prompt_logprobs + 1)
            request.in_progress_prompt_logprobs_cpu = logprobs_tensors
        start_idx = request.num_computed_tokens
        start_tok = start_idx + 1
        num_remaining_tokens = num_prompt_tokens - start_tok
        if num_tokens <= num_remaining_tokens:  # a chunk; more follow (on ==, they are returned with the next step)
            num_logits = num_tokens
        else:  # the last chunk
            num_logits = num_remaining_tokens
            completed_prefill_reqs.append(req_id)
            prompt_logprobs_dict[req_id] = logprobs_tensors
        if num_logits <= 0:
            continue
        req_idx = self.input_batch.req_id_to_index[req_id]
        offset = self.query_start_loc.np[req_idx].item()
        logits = self.model.compute_logits(hidden_states[offset : offset + num_logits])
        if tempered:
            temperature = scoring_temperature(request.sampling_params.temperature)
            if temperature != 1.0:
                logits = logits.to(torch.float32).div_(temperature)
        tgt_token_ids = prompt_token_ids[start_tok : start_tok + num_logits]
        if self.model_config.logprobs_mode in ("raw_logits", "processed_logits"):
            scores = logits.to(torch.float32)
        else:
            scores = self.sampler.compute_logprobs(logits)
        token_ids, logprobs, ranks, *_ = self.sampler.gather_logprobs(scores, num_prompt_logprobs, tgt_token_ids)
        chunk_slice = slice(start_idx, start_idx + num_logits)
        logprobs_tensors.logprob_token_ids[chunk_slice].copy_(token_ids, non_blocking=True)
        logprobs_tensors.logprobs[chunk_slice].copy_(logprobs, non_blocking=True)
        logprobs_tensors.selected_token_ranks[chunk_slice].copy_(ranks, non_blocking=True)
    for req_id in completed_prefill_reqs:
        del num_prompt_logprobs_dict[req_id]
        self.requests[req_id].in_progress_prompt_logprobs_cpu = None
    if prompt_logprobs_dict:  # the non-blocking copies above must have landed
        self._sync_device()
    return prompt_logprobs_dict


def temper_v2(worker) -> None:
    """Make a V2 runner's `PromptLogprobsWorker` score at each request's temperature: it remembers each request's
    temperature as it is added, and its batch computation gets a logits function that divides each row by its
    request's."""
    import torch

    temperatures: dict[str, float] = {}
    add_request, remove_request, compute = worker.add_request, worker.remove_request, worker.compute_prompt_logprobs

    def add(req_id, req_idx, sampling_params):
        if sampling_params.prompt_logprobs is not None:
            temperatures[req_id] = scoring_temperature(sampling_params.temperature)
        return add_request(req_id, req_idx, sampling_params)

    def remove(req_id):
        temperatures.pop(req_id, None)
        return remove_request(req_id)

    def compute_prompt_logprobs(logits_fn, hidden_states, input_batch, *args, **kwargs):
        spans = [
            (int(input_batch.query_start_loc_np[i]), int(input_batch.query_start_loc_np[i + 1]), temperatures[req_id])
            for i, req_id in enumerate(input_batch.req_ids)
            if temperatures.get(req_id, 1.0) != 1.0
        ]
        if spans:
            rows = torch.tensor(row_temperatures(spans, hidden_states.shape[0]), device=hidden_states.device)
            logits_fn = tempered_rows(logits_fn, hidden_states, rows)
        return compute(logits_fn, hidden_states, input_batch, *args, **kwargs)

    worker.add_request, worker.remove_request, worker.compute_prompt_logprobs = add, remove, compute_prompt_logprobs


class TemperedPromptLogprobs:
    """vLLM worker extension (`worker_extension_cls`): `spotrl_temper_prompt_logprobs`, called once through
    `collective_rpc`, makes the worker's model runner score prompt tokens at each request's temperature."""

    def spotrl_temper_prompt_logprobs(self) -> str:
        """Install the tempered scoring on this worker's runner; answers what it did: "v1" or "v2" (the runner it
        tempered), "raw" (a raw log-probs mode: left as the model's own values, as sampled tokens' are), "none" (a
        V2 pipeline stage that computes no log-probs)."""
        runner = self.model_runner
        if runner.model_config.logprobs_mode not in PROCESSED_MODES:
            return "raw"
        if hasattr(runner, "prompt_logprobs_worker"):
            if runner.prompt_logprobs_worker is None:
                return "none"
            temper_v2(runner.prompt_logprobs_worker)
            return "v2"
        if not hasattr(runner, "_get_prompt_logprobs_dict"):
            raise RuntimeError(f"{type(runner).__name__}: no prompt log-probs to temper in this vLLM")
        runner._get_prompt_logprobs_dict = types.MethodType(v1_prompt_logprobs_dict, runner)
        return "v1"
