"""The teacher with a fake OpenAI server on loopback: how the rollout reads its scores, at which temperature it asks
(the run's), what a failure costs (its group alone), and what the start-up checks refuse (another tokenizer, no
/tokenize, two answers that differ, scores at temperature 1 for a run that samples at another)."""

import asyncio
import io
import json
import math
import threading
import time
from http.server import ThreadingHTTPServer

import pytest

from app.objectives.distill import TEACHER_LOGPROBS, Distill, topk_stream_names
from app.rollout.producer import GroupProducer
from app.rollout.sampling import CompletionSampler
from app.rollout.teacher import (
    TEACHER_S,
    TEACHER_TOKENS,
    TeacherEndpoint,
    TeacherScorer,
    request_batches,
    teacher_logprobs,
    teacher_topk,
)
from app.tasks.rewards import RewardScorer, exact_answer
from contracts.rollouts import BatchStats, Choice, Group, Sample
from core.config import load_config
from tests.support.fake_fleet import JSONHandler
from tests.support.rollout_parts import PROBLEMS, run

HANG = 99  # a completion token the fake teacher never answers for in time
DISTILL = ["objectives=[{kind: distill, teacher: base}]"]


def score_of(token: int, position: int) -> float:
    return (
        -0.01 * token - 0.001 * position
    )  # tokens 0 .. k - 1 are a position's top k (its own token among them or not)


class FakeTeacher(JSONHandler):
    """vLLM's answers: `/v1/completions` with `prompt_logprobs`, `/v1/models`, `/tokenize` (by `encode`)."""

    encode = None  # text -> ids, or None: no /tokenize (404)
    jitter = 0.0  # added to every score, times the request's number: a teacher that answers differently each time
    tempers = True  # scores divided by the request's temperature (a spotrl fleet's teacher), or not (plain vLLM's)
    requests = 0
    asked = None  # the last scoring request's prompt_logprobs

    def do_GET(self):  # noqa: N802 - http.server's naming
        self.answer(200, {"data": [{"id": "the-teacher"}]})

    def do_POST(self):  # noqa: N802
        body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
        if self.path == "/tokenize":
            if type(self).encode is None:
                return self.answer(404, {"error": {"message": "Not Found"}})
            return self.answer(200, {"tokens": type(self).encode(body["prompt"])})
        type(self).requests += 1
        if any(HANG in seq for seq in body["prompt"]):
            time.sleep(2.0)
        shift = type(self).jitter * type(self).requests
        top = type(self).asked = body["prompt_logprobs"]
        scale = 1 / body["temperature"] if type(self).tempers else 1.0
        choices = [
            {
                "index": i,
                "text": "",
                "prompt_logprobs": [None]
                + [
                    {
                        str(t): {"logprob": score_of(t, p) * scale + shift, "rank": top + 1, "decoded_token": "x"},
                        **{
                            str(a): {"logprob": score_of(a, p) * scale, "rank": a + 1, "decoded_token": "y"}
                            for a in range(top)
                        },
                    }
                    for p, t in enumerate(seq)
                    if p > 0
                ],
            }
            for i, seq in enumerate(body["prompt"])
        ]
        self.answer(200, {"choices": choices})


@pytest.fixture
def teacher_url():
    FakeTeacher.encode, FakeTeacher.jitter, FakeTeacher.requests, FakeTeacher.tempers = None, 0.0, 0, True
    server = ThreadingHTTPServer(("127.0.0.1", 0), FakeTeacher)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    yield f"http://127.0.0.1:{server.server_port}"
    server.shutdown()


def test_the_teachers_scores_are_read_at_the_model_tokens_only():
    prompt = [1, 2]
    episode = Sample([5, 6, 7], [-0.1, math.nan, -0.2], 1.0, completion_mask=[1, 0, 1])
    positions = [None, {2: -0.5}, {5: -0.1, 8: -3.0}, {6: -0.2}, {7: -0.3}]
    scores = teacher_logprobs(positions, len(prompt), episode)
    assert scores[0] == -0.1 and math.isnan(scores[1]) and scores[2] == -0.3
    with pytest.raises(ValueError, match="no log-prob for completion token 2"):
        teacher_logprobs(positions[:-1] + [{8: -1.0}], len(prompt), episode)
    with pytest.raises(ValueError, match="scored 4 positions of 5"):
        teacher_logprobs(positions[:-1], len(prompt), episode)


def test_the_teachers_top_k_is_read_by_rank_at_the_model_tokens_without_the_sampled_token_beyond_it():
    prompt = [1, 2]
    episode = Sample([5, 6, 1], [-0.1, math.nan, -0.2], 1.0, completion_mask=[1, 0, 1])
    positions = [
        None,
        {2: -0.5, 0: -0.1, 1: -0.2},
        {5: -4.0, 3: -0.3, 4: -0.2},  # the sampled token beyond the top 2: k + 1 entries, it is left out
        {6: -0.2},  # an observation: nothing read
        {1: -0.4, 7: -0.6},  # the sampled token among the top 2: k entries
    ]
    ids, logprobs = teacher_topk(positions, len(prompt), episode, 2)
    assert [ids[0][0], ids[1][0], logprobs[0][0], logprobs[1][0]] == [4.0, 3.0, -0.2, -0.3]
    assert [ids[0][2], ids[1][2], logprobs[0][2], logprobs[1][2]] == [1.0, 7.0, -0.4, -0.6]
    assert all(math.isnan(v[1]) for v in ids + logprobs)
    with pytest.raises(ValueError, match="1 alternatives for completion token 2, not 2"):
        teacher_topk(positions[:-1] + [{1: -0.4}], len(prompt), episode, 2)


def test_in_topk_mode_the_scorer_asks_for_k_alternatives_and_the_group_carries_them(teacher_url):
    k = 3
    sample = Sample([5, 1], [-0.1, -0.2], 1.0)
    group = Group(0, "p", [7, 8], 0, [sample, Sample([5, 1], [-0.1, -0.2], 1.0)])
    endpoint = TeacherEndpoint("url", teacher_url, "the-teacher")
    topk = load_config(None, ["objectives=[{kind: distill, teacher: base, mode: topk, top_k: 3}]"])
    configured = TeacherScorer.from_config(endpoint, topk)
    assert (configured.top_k, configured.max_entries) == (k, topk.fleet.max_prompt_logprobs_per_request)
    assert TeacherScorer.from_config(endpoint, load_config(None, DISTILL)).top_k == 0  # sampled mode: as before
    scorer = TeacherScorer(endpoint, endpoint.client(5.0, 0), top_k=k, max_entries=12)
    before = FakeTeacher.requests

    async def score():
        await scorer.score(group)
        await scorer.aclose()
        await configured.aclose()

    asyncio.run(score())
    assert FakeTeacher.requests - before == 2  # 2 sequences of 4 tokens x (3 + 1) log-probs: one request each
    ids, logprobs = topk_stream_names(k)
    assert sample.streams[TEACHER_LOGPROBS] == pytest.approx([score_of(5, 2), score_of(1, 3)])
    assert [sample.streams[n] for n in ids] == [[0.0, 0.0], [1.0, 1.0], [2.0, 2.0]]  # token 5 beyond, 1 among them
    assert [v for n in logprobs for v in sample.streams[n]] == pytest.approx(
        [score_of(r, p) for r in range(k) for p in (2, 3)]
    )
    Distill(top_k=k).annotate(group)  # what the objective checks before the group is queued


def test_a_group_whose_top_k_pass_what_a_request_may_ask_is_scored_in_several():
    seqs = [[1] * 4, [2] * 4, [3] * 2, [4] * 9]
    assert request_batches(seqs, 2, None) == [seqs]
    assert request_batches(seqs, 0, 100) == [seqs]  # the sampled token's alone: 19 log-probs, one request
    assert request_batches(seqs, 2, 18) == [seqs[:1], seqs[1:3], seqs[3:]]  # 12 + 12 > 18; 12 + 6; 27 alone


def test_a_teacher_failure_costs_its_group_alone(teacher_url):
    calls = {"n": 0}

    async def generate(prompt_ids, model, n, max_tokens, temperature, top_p=1.0, top_k=-1):
        calls["n"] += 1
        first = HANG if calls["n"] == 2 else 5  # the second group's samples make the teacher time out
        return [Choice(i, [first, 6], [-0.1, -0.2], str(i), "stop") for i in range(n)]

    async def main():
        cfg = load_config(None, [*DISTILL, "rollout.max_inflight_tasks=1"])
        endpoint = TeacherEndpoint("url", teacher_url, "the-teacher")
        scorer = TeacherScorer(endpoint, endpoint.client(timeout_s=0.5, retries=0))
        sampler = CompletionSampler(generate, RewardScorer([exact_answer], timeout_s=2.0))
        w = GroupProducer(cfg, PROBLEMS, lambda p: [1, 2, 3], sampler, teacher=scorer)
        w.start()
        groups = (await w.get_groups(3)).groups
        alive = w._producer is not None and not w._producer.done()
        stats = w.stats()
        await w.stop()
        return groups, w.counters, stats, alive

    groups, counters, stats, alive = run(main())
    assert [g.group_id for g in groups] == [0, 2, 3] and alive  # group 1 was lost, the producer went on
    assert counters["teacher_failed"] == 1 and counters["dropped_failed"] == 0
    assert stats.metrics()["distill/teacher_failed_total"] == 1
    for group in groups:
        for sample in group.samples:  # prompt [1, 2, 3]: completion tokens at positions 3 and 4
            assert sample.streams[TEACHER_LOGPROBS] == pytest.approx([score_of(5, 3), score_of(6, 4)])
        assert group.costs[TEACHER_TOKENS] == 8 * 5 and group.costs[TEACHER_S] > 0
    # What scoring cost reaches the step's metrics, summed over its groups.
    assert BatchStats.of(groups, 0).metrics()[TEACHER_TOKENS] == 3 * 8 * 5


def test_a_distilling_producer_needs_a_teacher():
    cfg = load_config(None, DISTILL)
    sampler = CompletionSampler(lambda *a, **k: None, RewardScorer([exact_answer], timeout_s=2.0))
    with pytest.raises(ValueError, match="needs a teacher"):
        GroupProducer(cfg, PROBLEMS, lambda p: [1], sampler)


@pytest.fixture(scope="module")
def student_folder(tmp_path_factory):
    from tiny.tokenizer import build_tokenizer

    folder = tmp_path_factory.mktemp("student")
    build_tokenizer(2, seed=0).save_pretrained(folder)
    return str(folder)


def test_a_teacher_server_is_checked_by_its_token_ids_and_by_scoring_twice(teacher_url, student_folder):
    from app.teacher_setup import prepare_teacher
    from core.models import load_tokenizer
    from tiny.tokenizer import build_tokenizer

    cfg_overrides = [f"objectives=[{{kind: distill, teacher: {{url: '{teacher_url}'}}}}]"]
    cfg = load_config(None, cfg_overrides)
    student = load_tokenizer(student_folder)
    with pytest.raises(SystemExit, match="has no /tokenize"):
        prepare_teacher(cfg, None, student_folder, None)

    other = build_tokenizer(2, seed=0, vocab_size=320)  # fewer merges: other ids for the same strings
    FakeTeacher.encode = staticmethod(lambda text: other(text, add_special_tokens=False)["input_ids"])
    with pytest.raises(SystemExit, match="its tokenizer is not the student's"):
        prepare_teacher(cfg, None, student_folder, None)

    FakeTeacher.encode = staticmethod(lambda text: student(text, add_special_tokens=False)["input_ids"])
    endpoint = prepare_teacher(cfg, None, student_folder, None)
    assert (endpoint.kind, endpoint.url, endpoint.model) == ("url", teacher_url, "the-teacher")
    assert FakeTeacher.asked == 0
    topk = load_config(
        None, [f"objectives=[{{kind: distill, mode: topk, top_k: 4, teacher: {{url: '{teacher_url}'}}}}]"]
    )
    prepare_teacher(topk, None, student_folder, None)
    assert FakeTeacher.asked == 4  # the self-test asks what the rollout will

    tempered = load_config(None, [*cfg_overrides, "sampling.temperature=0.7"])
    assert prepare_teacher(tempered, None, student_folder, None).model == "the-teacher"  # it scores at 0.7 when asked
    FakeTeacher.tempers = False  # plain vLLM: at temperature 1 whatever it is asked
    with pytest.raises(SystemExit, match="scores at temperature 1 whatever it is asked"):
        prepare_teacher(tempered, None, student_folder, None)
    assert prepare_teacher(cfg, None, student_folder, None).model == "the-teacher"  # a run that samples at 1 is fine

    FakeTeacher.jitter = 0.05  # its second answer 0.05 away from its first: beyond the default 0.01
    with pytest.raises(SystemExit, match="scored one sequence twice"):
        prepare_teacher(cfg, None, student_folder, None)


def test_scoring_asks_what_trls_distillation_trainer_asks(teacher_url):
    seen = []

    class Spy(FakeTeacher):
        def do_POST(self):  # noqa: N802
            raw = self.rfile.read(int(self.headers["Content-Length"]))
            seen.append(json.loads(raw))
            self.rfile = io.BytesIO(raw)
            super().do_POST()

    server = ThreadingHTTPServer(("127.0.0.1", 0), Spy)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    endpoint = TeacherEndpoint("url", f"http://127.0.0.1:{server.server_port}", "m")
    try:
        client = endpoint.client(5.0, 0)
        asyncio.run(client.aprompt_logprobs([[1, 2, 3]], "m"))
        # A run's scorer asks at the run's sampling temperature: its samples' log-probs are taken after it.
        scorer = TeacherScorer.from_config(endpoint, load_config(None, [*DISTILL, "sampling.temperature=0.7"]))
        group = Group(0, "p", [1, 2], 0, [Sample([3], [-0.1], 1.0)])
        asyncio.run(scorer.score(group))
    finally:
        server.shutdown()
    plain, run_at = seen
    assert plain == {"model": "m", "prompt": [[1, 2, 3]], "max_tokens": 1, "temperature": 1.0, "prompt_logprobs": 0}
    assert run_at == {**plain, "temperature": 0.7}
    assert group.samples[0].streams[TEACHER_LOGPROBS] == pytest.approx([score_of(3, 2) / 0.7])


def test_a_self_teacher_scores_the_completion_after_its_privileged_prompt(teacher_url):
    from app.tasks.privileged import privileged_prompt
    from contracts.rollouts import Group

    seen = []

    class Spy(FakeTeacher):
        def do_POST(self):  # noqa: N802
            raw = self.rfile.read(int(self.headers["Content-Length"]))
            seen.append(json.loads(raw))
            self.rfile = io.BytesIO(raw)
            super().do_POST()

    server = ThreadingHTTPServer(("127.0.0.1", 0), Spy)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    problem = PROBLEMS[0]
    template = "Hint: {answer}\n{prompt}"
    encode = {problem.prompt: [1, 2, 3], privileged_prompt(template, problem): [7, 7, 7, 7, 1, 2, 3]}
    try:
        url = f"http://127.0.0.1:{server.server_port}"
        endpoint = TeacherEndpoint("self", url, "policy-v0", context=template, live=True)
        scorer = TeacherScorer(endpoint, endpoint.client(5.0, 0), lambda p: encode[p.prompt])
        episode = Sample([5, 40, 6], [-0.1, math.nan, -0.2], 1.0, completion_mask=[1, 0, 1])
        single = Sample([5, 6], [-0.1, -0.2], 1.0)
        group = Group(0, problem.id, [1, 2, 3], 0, [single, episode])
        run(scorer.score(group, problem, "policy-v4"))
        with pytest.raises(ValueError, match="needs the group's problem"):
            run(scorer.score(group))
    finally:
        server.shutdown()
    (body,) = seen
    # The teacher saw its privileged prompt (7 tokens) before the student's own completion, under the newest version.
    assert body["model"] == "policy-v4"
    assert body["prompt"] == [[7, 7, 7, 7, 1, 2, 3, 5, 6], [7, 7, 7, 7, 1, 2, 3, 5, 40, 6]]
    assert single.streams[TEACHER_LOGPROBS] == pytest.approx([score_of(5, 7), score_of(6, 8)])
    scores = episode.streams[TEACHER_LOGPROBS]  # the observation token is left unscored (NaN), as ever
    assert scores[0] == pytest.approx(score_of(5, 7)) and math.isnan(scores[1])
    assert scores[2] == pytest.approx(score_of(6, 9))
    assert group.costs[TEACHER_TOKENS] == 9 + 10


def test_an_ema_self_teacher_scores_with_the_newest_versions_number_of_the_runs_ema_lineage():
    from contracts.rollouts import Group

    seen = []

    class Spy(FakeTeacher):
        def do_POST(self):  # noqa: N802
            raw = self.rfile.read(int(self.headers["Content-Length"]))
            seen.append(json.loads(raw)["model"])
            self.rfile = io.BytesIO(raw)
            super().do_POST()

    server = ThreadingHTTPServer(("127.0.0.1", 0), Spy)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    problem = PROBLEMS[0]
    try:
        url = f"http://127.0.0.1:{server.server_port}"
        endpoint = TeacherEndpoint("self", url, "alice/ema-v0", context="{answer}{prompt}", live=True, ema=True)
        scorer = TeacherScorer(endpoint, endpoint.client(5.0, 0), lambda p: [1, 2, 3])
        for newest in ("alice/policy-v4", "alice/policy-v5"):
            run(scorer.score(Group(0, problem.id, [1, 2, 3], 0, [Sample([5, 6], [-0.1, -0.2], 1.0)]), problem, newest))
    finally:
        server.shutdown()
    assert seen == ["alice/ema-v4", "alice/ema-v5"]  # the average published beside each, never the policy itself


def test_a_self_teacher_needs_the_students_tokenisation():
    endpoint = TeacherEndpoint("self", "http://127.0.0.1:1", "base", context="{answer}{prompt}")
    with pytest.raises(ValueError, match="need the student's tokenisation"):
        TeacherScorer(endpoint, endpoint.client(1.0, 0))


def test_a_failed_episodes_feedback_is_what_the_self_teacher_is_shown():
    from app.rollout.teacher import sample_feedback
    from contracts.rollouts import Group

    failed = Sample([5, 40, 6], [-0.1, math.nan, -0.2], 0.0, completion_mask=[1, 0, 1], turn_rewards=[1.0, 0.0])
    failed.feedback, failed.solved = "wrong: 12", False
    solved = Sample([5], [-0.1], 1.0, turn_rewards=[1.0], solved=True, feedback="well done")
    broken = Sample([5], [-0.1], math.nan, turn_rewards=[], env_error=True, feedback="error: timed out")
    single = Sample([5], [-0.1], 0.0, feedback="ignored")
    assert [sample_feedback(s) for s in (failed, solved, broken, single)] == ["wrong: 12", "", "error: timed out", ""]

    problem = PROBLEMS[0]
    seen = []
    endpoint = TeacherEndpoint("self", "http://127.0.0.1:1", "base", context="{feedback}|{answer}|{prompt}")
    scorer = TeacherScorer(endpoint, endpoint.client(1.0, 0), lambda p: seen.append(p.prompt) or [len(seen)])
    group = Group(0, problem.id, [9], 0, [failed, solved, broken, solved])
    prompts = scorer.teacher_prompts(group, problem)
    assert seen == [f"wrong: 12|{problem.answer}|{problem.prompt}", f"|{problem.answer}|{problem.prompt}"] + [
        f"error: timed out|{problem.answer}|{problem.prompt}"
    ]
    assert prompts == [[1], [2], [3], [2]]  # each distinct prompt tokenised once
    quiet = TeacherEndpoint("self", "http://127.0.0.1:1", "base", context="{feedback}{answer}{prompt}", feedback=False)
    seen.clear()
    TeacherScorer(quiet, quiet.client(1.0, 0), lambda p: seen.append(p.prompt) or [0]).teacher_prompts(group, problem)
    assert seen == [problem.answer + problem.prompt]  # feedback: none shows the teacher nothing of it


def test_several_teachers_each_score_the_problems_that_name_them(teacher_url):
    from dataclasses import replace

    from app.objectives.distill import TEACHER_INDEX
    from app.rollout.teacher import TeacherChoice
    from contracts.rollouts import Group

    def scorer():
        endpoint = TeacherEndpoint("url", teacher_url, "the-teacher")
        return TeacherScorer(endpoint, endpoint.client(1.0, 0))

    choice = TeacherChoice({"math": scorer(), "default": scorer()}, "subject")
    mathy = replace(PROBLEMS[0], columns={"subject": "math"})
    plain, unknown = PROBLEMS[1], replace(PROBLEMS[2], columns={"subject": "art"})
    groups = [
        Group(i, p.id, [1, 2], 0, [Sample([5, HANG if i == 2 else 6], [-0.1, -0.2], 1.0)])
        for i, p in enumerate((mathy, plain, mathy))
    ]

    async def main():
        await choice.score(groups[0], mathy)
        await choice.score(groups[1], plain)
        with pytest.raises(Exception):  # noqa: B017 - the fake teacher hangs past the client's timeout
            await choice.score(groups[2], mathy)
        with pytest.raises(ValueError, match="names teacher 'art'"):
            await choice.score(groups[1], unknown)
        await choice.aclose()

    run(main())
    assert groups[0].samples[0].streams[TEACHER_INDEX] == [1.0, 1.0]  # sorted: default, math
    assert groups[1].samples[0].streams[TEACHER_INDEX] == [0.0, 0.0]
    assert (
        groups[0].costs["distill/math/teacher_tokens"] == 4 and "distill/default/teacher_tokens" not in groups[0].costs
    )
    assert groups[1].costs["distill/default/teacher_tokens"] == groups[1].costs[TEACHER_TOKENS] == 4
    assert choice.failed_by_teacher() == {"default": 0, "math": 1}


def test_the_rollout_scores_with_its_one_teacher_or_chooses_among_several():
    from app.rollout.teacher import TeacherChoice, scorer_for

    def endpoint(name=None):
        return TeacherEndpoint("base", "http://127.0.0.1:1", "base", name=name)

    one = load_config(None, DISTILL)
    assert isinstance(scorer_for(one, endpoint(), lambda p: [1]), TeacherScorer)
    assert isinstance(scorer_for(one, {"teacher": endpoint("teacher")}, lambda p: [1]), TeacherScorer)
    assert scorer_for(one, None, lambda p: [1]) is None
    several = load_config(
        None, ["objectives=[{kind: distill, teachers: {default: base, hard: base}, teacher_field: level}]"]
    )
    assert list(several.teachers) == ["default", "hard"] and several.teacher is several.teachers["default"]
    choice = scorer_for(several, {n: endpoint(n) for n in several.teachers}, lambda p: [1])
    assert isinstance(choice, TeacherChoice) and choice.field == "level" and choice.names == ["default", "hard"]
