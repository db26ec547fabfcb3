"""Prompt log-probs at the request's temperature (`deployments.replica.scoring_temperature`) without an engine: the
temperature a request is scored at, the rows of a batch each request's temperature divides, vLLM 0.32's V1 prompt
log-probs with the division (run with vLLM's own sampler and log-prob tensors over a stand-in runner, chunked prefill
too), the V2 wrapper over a stand-in `PromptLogprobsWorker`, and which runner the extension tempers."""

from types import SimpleNamespace

import numpy as np
import pytest
import torch

from deployments.replica.scoring_temperature import (
    TemperedPromptLogprobs,
    row_temperatures,
    scoring_temperature,
    temper_v2,
    tempered_rows,
    v1_prompt_logprobs_dict,
)

VOCAB, HIDDEN = 11, 4


def test_a_request_is_scored_at_its_temperature_and_a_greedy_one_at_1():
    assert scoring_temperature(0.7) == 0.7 and scoring_temperature(1.5) == 1.5
    assert scoring_temperature(0.0) == scoring_temperature(1e-6) == scoring_temperature(None) == 1.0


def test_each_request_divides_its_own_rows():
    assert row_temperatures([(0, 2, 0.5), (3, 5, 2.0)], 6) == [0.5, 0.5, 1.0, 2.0, 2.0, 1.0]


def _lm_head(seed: int = 0) -> torch.Tensor:
    return torch.randn(HIDDEN, VOCAB, generator=torch.Generator().manual_seed(seed))


def test_the_rows_follow_the_slices_whatever_the_chunking():
    hidden, head = torch.randn(10, HIDDEN), _lm_head()
    temperatures = torch.tensor([0.5] * 4 + [1.0] * 3 + [2.0] * 3)
    logits_fn = tempered_rows(lambda rows: rows @ head, hidden, temperatures)
    expected = (hidden @ head) / temperatures.unsqueeze(1)
    for chunk in (1, 3, 4, 10):
        got = torch.cat([logits_fn(hidden[:8][a : a + chunk]) for a in range(0, 8, chunk)])
        torch.testing.assert_close(got, expected[:8])
    with pytest.raises(RuntimeError, match="not the batch's"):
        logits_fn(hidden.clone()[:2])  # rows of another tensor: where they sit in the batch is unknown


class StandInV2Worker:
    """vLLM 0.32's V2 `PromptLogprobsWorker` as far as the wrapper sees it: requests added and removed, and the
    batch's prompt log-probs computed with a logits function over slices of the hidden states."""

    def __init__(self):
        self.added, self.removed = [], []

    def add_request(self, req_id, req_idx, sampling_params):
        self.added.append(req_id)

    def remove_request(self, req_id):
        self.removed.append(req_id)

    def compute_prompt_logprobs(self, logits_fn, hidden_states, input_batch, chunk=3):
        rows = hidden_states[: int(input_batch.query_start_loc_np[-1])]
        return torch.cat([logits_fn(rows[a : a + chunk]).log_softmax(-1) for a in range(0, rows.shape[0], chunk)])


def test_the_v2_runner_scores_each_request_at_its_temperature():
    worker, head = StandInV2Worker(), _lm_head(1)
    temper_v2(worker)
    worker.add_request("hot", 0, SimpleNamespace(temperature=0.5, prompt_logprobs=3))
    worker.add_request("greedy", 1, SimpleNamespace(temperature=0.0, prompt_logprobs=0))
    worker.add_request("sampling", 2, SimpleNamespace(temperature=0.5, prompt_logprobs=None))
    assert worker.added == ["hot", "greedy", "sampling"]  # vLLM's own bookkeeping still runs
    hidden = torch.randn(12, HIDDEN)  # the batch's rows, and padding past them
    batch = SimpleNamespace(req_ids=["greedy", "hot", "sampling"], query_start_loc_np=np.array([0, 3, 7, 9]))
    got = worker.compute_prompt_logprobs(lambda rows: rows @ head, hidden, batch)
    logits = hidden[:9] @ head
    torch.testing.assert_close(got[:3], logits[:3].log_softmax(-1))  # greedy: at 1
    torch.testing.assert_close(got[3:7], (logits[3:7] / 0.5).log_softmax(-1))
    torch.testing.assert_close(got[7:], logits[7:].log_softmax(-1))  # asked for no prompt log-probs
    worker.remove_request("hot")
    assert worker.removed == ["hot"]
    torch.testing.assert_close(
        worker.compute_prompt_logprobs(lambda r: r @ head, hidden, batch), logits.log_softmax(-1)
    )


def _v1_runner(prompts: dict[str, tuple[list[int], float, int]], head: torch.Tensor, mode="processed_logprobs"):
    """A V1 runner as `_get_prompt_logprobs_dict` reads it, with vLLM's own sampler: `prompts` are each request's
    prompt ids, temperature and number of alternatives; the batch lays the requests out in that order."""
    from vllm.v1.sample.sampler import Sampler

    runner = SimpleNamespace(
        num_prompt_logprobs={req_id: top for req_id, (_, _, top) in prompts.items()},
        requests={
            req_id: SimpleNamespace(
                prompt_token_ids=ids,
                in_progress_prompt_logprobs_cpu=None,
                num_computed_tokens=0,
                sampling_params=SimpleNamespace(temperature=t),
            )
            for req_id, (ids, t, _) in prompts.items()
        },
        device=torch.device("cpu"),
        model_config=SimpleNamespace(logprobs_mode=mode),
        input_batch=SimpleNamespace(req_id_to_index={req_id: i for i, req_id in enumerate(prompts)}),
        model=SimpleNamespace(compute_logits=lambda rows: rows @ head),
        sampler=Sampler(logprobs_mode=mode),
        _sync_device=lambda: None,
    )
    return runner


def _step(runner, hidden: torch.Tensor, scheduled: dict[str, int]):
    """One engine step that runs `scheduled` tokens of each request, laid out one request after the other."""
    starts = np.cumsum([0, *scheduled.values()])
    runner.query_start_loc = SimpleNamespace(np=starts)
    runner.input_batch.req_id_to_index = {req_id: i for i, req_id in enumerate(scheduled)}
    out = v1_prompt_logprobs_dict(runner, hidden, scheduled)
    for req_id, n in scheduled.items():
        runner.requests[req_id].num_computed_tokens += n
    return out


def _expected(head, embeddings, ids, temperature, top):
    logprobs = ((embeddings[ids[:-1]] @ head) / temperature).log_softmax(-1)
    chosen = logprobs.gather(1, torch.tensor(ids[1:]).unsqueeze(1))
    return chosen.squeeze(1), logprobs.topk(top).values


def test_the_v1_runner_scores_each_request_at_its_temperature_chunk_by_chunk():
    head, embeddings = _lm_head(2), torch.randn(VOCAB, HIDDEN, generator=torch.Generator().manual_seed(3))
    hot, greedy = [1, 5, 2, 9, 4, 7], [3, 8, 6, 0]
    runner = _v1_runner({"hot": (hot, 0.5, 2), "greedy": (greedy, 0.0, 2)}, head)
    # Step 1: the whole of "greedy" and the first 3 tokens of "hot" (a chunked prefill); step 2: the rest of "hot".
    first = _step(runner, torch.cat([embeddings[hot[:3]], embeddings[greedy]]), {"hot": 3, "greedy": 4})
    assert list(first) == ["greedy"] and list(runner.num_prompt_logprobs) == ["hot"]
    second = _step(runner, embeddings[hot[3:]], {"hot": 3})
    for req_id, ids, temperature, answer in (("hot", hot, 0.5, second), ("greedy", greedy, 1.0, first)):
        chosen, top = _expected(head, embeddings, ids, temperature, 2)
        scored = answer[req_id]
        torch.testing.assert_close(scored.logprobs[:, 0], chosen)  # the token's own, then the top 2
        torch.testing.assert_close(scored.logprobs[:, 1:], top)
        ranks = (embeddings[ids[:-1]] @ head) > (embeddings[ids[:-1]] @ head).gather(1, torch.tensor(ids[1:])[:, None])
        assert scored.selected_token_ranks.tolist() == (ranks.sum(1) + 1).tolist()


def test_a_raw_mode_is_left_raw():
    head, embeddings = _lm_head(4), torch.randn(VOCAB, HIDDEN)
    ids = [2, 4, 6]
    runner = _v1_runner({"r": (ids, 0.5, 1)}, head, mode="raw_logprobs")
    scored = _step(runner, embeddings[ids], {"r": 3})["r"]
    torch.testing.assert_close(scored.logprobs[:, 0], _expected(head, embeddings, ids, 1.0, 1)[0])


def test_the_extension_tempers_the_runner_it_finds():
    def worker(runner):
        extension = TemperedPromptLogprobs()
        extension.model_runner = runner
        return extension

    processed = SimpleNamespace(logprobs_mode="processed_logprobs")
    v1 = SimpleNamespace(model_config=processed, _get_prompt_logprobs_dict=None)
    assert worker(v1).spotrl_temper_prompt_logprobs() == "v1" and v1._get_prompt_logprobs_dict.__func__ is (
        v1_prompt_logprobs_dict
    )
    v2 = SimpleNamespace(model_config=processed, prompt_logprobs_worker=StandInV2Worker())
    assert worker(v2).spotrl_temper_prompt_logprobs() == "v2"
    assert (
        worker(SimpleNamespace(model_config=processed, prompt_logprobs_worker=None)).spotrl_temper_prompt_logprobs()
        == "none"
    )
    raw = SimpleNamespace(model_config=SimpleNamespace(logprobs_mode="raw_logprobs"), _get_prompt_logprobs_dict=None)
    assert worker(raw).spotrl_temper_prompt_logprobs() == "raw" and raw._get_prompt_logprobs_dict is None
    with pytest.raises(RuntimeError, match="no prompt log-probs to temper"):
        worker(SimpleNamespace(model_config=processed)).spotrl_temper_prompt_logprobs()
