"""A replica whose node is going (`deployments.replica.notices`, `deployments.replica.inflight`) without an engine: the
generations in flight cut short with their tokens so far (`HandBack`, also the partial-rollouts machinery), new
ones refused as draining, the ingress told, and what still runs at the deadline handed back, not before."""

import asyncio
import time
from types import SimpleNamespace

import pytest

from contracts.control import Cut, CutGenerations, HandBack, HandedBack
from contracts.notices import Notice
from contracts.serving import ABORTED, GenerateRequest, ReplicaDraining, ReplicaUnavailable, Sampling
from core.config import SpotConfig
from deployments.replica.notices import ReplicaNotices
from deployments.replica.shell import Replica
from tests.support.replica_parts import BASE_MODEL, REPLICA, StandInLLM, adapter_slots


class StreamingLLM(StandInLLM):
    """Samples token 7 every `step_s` per choice, up to max_tokens; an aborted request answers what it has, as vLLM's
    abort output does (token ids and log-probs of every choice, finish reason "abort")."""

    def __init__(self, step_s: float = 0.01):
        super().__init__()
        self.step_s, self.aborted = step_s, set()

    async def generate(self, prompt, params, request_id, lora_request=None):
        made, reason = 0, "length"
        while made < params.max_tokens:
            if request_id in self.aborted:
                reason = "abort"
                break
            await asyncio.sleep(self.step_s)
            made += 1
        entry = {7: SimpleNamespace(logprob=-0.5, rank=1)}
        outputs = [
            SimpleNamespace(
                index=i, token_ids=[7] * made, logprobs=[entry] * made, finish_reason=reason, stop_reason=None
            )
            for i in range(params.n)
        ]
        yield SimpleNamespace(outputs=outputs, prompt_logprobs=None)

    async def abort(self, request_ids):
        self.aborted.update(request_ids)


def _replica(tmp_path, llm) -> Replica:
    slots = adapter_slots(tmp_path, llm)
    return Replica(REPLICA, slots.engine, slots, 60.0)


def _request(n=2, max_tokens=1000) -> GenerateRequest:
    return GenerateRequest([1, 2, 3], BASE_MODEL, Sampling(n=n, max_tokens=max_tokens, logprobs=0))


def test_hand_back_cuts_generations_short_with_their_tokens_and_log_probs(tmp_path):
    async def scenario():
        replica = _replica(tmp_path, StreamingLLM())
        long, short = asyncio.create_task(replica.generate(_request())), replica.generate(_request(n=1, max_tokens=3))
        finished = await short
        await asyncio.sleep(0.1)
        assert replica.inflight.sequences == 2 and replica.inflight.requests == 1  # n counts: what autoscaling sees
        assert await replica.control(CutGenerations(("policy-v9",))) == Cut(REPLICA, 0)  # another version's only
        assert await replica.control(HandBack()) == HandedBack(REPLICA, 1)
        return finished, await long, replica

    finished, cut, replica = asyncio.run(scenario())
    assert not finished.handed_back and finished.choices[0].finish_reason == "length"
    assert cut.handed_back and [c.finish_reason for c in cut.choices] == [ABORTED, ABORTED]
    made = len(cut.choices[0].token_ids)
    assert 0 < made < 1000 and cut.choices[1].logprobs == [-0.5] * made
    assert replica.inflight.sequences == 0


def _notices(replica: Replica, told: list, stopping=None, **spot) -> ReplicaNotices:
    async def tell_ingress(draining: bool):
        if draining:
            told.append(time.monotonic())
        else:
            told.append("serving")

    spot = SpotConfig(**{"drain_node": False, **spot})
    return ReplicaNotices(REPLICA, replica.inflight, spot, tell_ingress, stopping)


def test_a_draining_replica_refuses_new_work_tells_the_ingress_and_hands_back_at_deadline_less_margin(tmp_path):
    async def scenario():
        replica, told = _replica(tmp_path, StreamingLLM()), []
        replica.notices = notices = _notices(replica, told, handback_margin_s=10.0)
        running = asyncio.create_task(replica.generate(_request()))
        await asyncio.sleep(0.05)
        start = time.monotonic()
        draining = asyncio.create_task(notices.drain(Notice("gcp", time.time() + 10.5)))  # hand back 0.5 s from now
        await asyncio.sleep(0.01)
        with pytest.raises(ReplicaDraining) as refused:
            await replica.generate(_request())
        await draining
        return start, told, await running, refused.value, notices

    start, told, cut, refused, notices = asyncio.run(scenario())
    assert isinstance(refused, ReplicaUnavailable) and refused.replica == REPLICA  # the ingress sends it elsewhere
    assert told and told[0] - start < 0.1  # the ingress heard at once
    assert cut.handed_back and notices.handed_back == 1
    assert all(c.finish_reason == ABORTED for c in cut.choices)


def test_generations_that_end_before_the_deadline_are_not_handed_back(tmp_path):
    async def scenario():
        replica = _replica(tmp_path, StreamingLLM())
        notices = _notices(replica, [], handback_margin_s=1.0)
        running = asyncio.create_task(replica.generate(_request(max_tokens=20)))
        await asyncio.sleep(0.01)
        await notices.drain(Notice("aws", time.time() + 120.0))  # returns as soon as nothing runs
        return await running, notices

    done, notices = asyncio.run(scenario())
    assert not done.handed_back and done.choices[0].finish_reason == "length" and notices.handed_back == 0


def test_draining_errors_keep_the_replica_through_pickling():
    import pickle

    err = pickle.loads(pickle.dumps(ReplicaDraining("its node is going", "r7")))
    assert isinstance(err, ReplicaUnavailable) and err.replica == "r7" and err.status == 503


def test_a_new_replica_loads_every_lineages_pinned_versions_before_it_takes_traffic(tmp_path):
    """A replacement, or one the autoscaler added mid-run: the fleet's own newest versions and every registered run's
    window (`deployments.replica.warm_start`), read from the bucket; each loads into its LoRA slots."""
    from core.bucket.records import RunRecords
    from core.config import load_fleet_config
    from deployments.replica.warm_start import adapters_to_serve
    from tests.support.replica_parts import adapter_folder, lineage_store

    url = f"file://{tmp_path}/bucket"
    cfg = load_fleet_config(None, [f"bucket.url={url}", "fleet.max_staleness=1", "fleet.max_loras=10"])
    slots = adapter_slots(tmp_path, window=2, max_loras=10)
    for v in (1, 2, 3):
        slots.sources.store.publish(adapter_folder(tmp_path / f"own{v}", f"own {v}".encode()), v)
    alice = lineage_store(url, "alice", cache_dir=tmp_path / "cache")
    for v in (4, 5, 6):
        alice.publish(adapter_folder(tmp_path / f"alice{v}", f"alice {v}".encode()), v)
    for v in (2, 3):  # the average an `ema` self teacher's learner publishes beside each version
        lineage_store(url, stem="ema", cache_dir=tmp_path / "cache").publish(
            adapter_folder(tmp_path / f"own-ema{v}", f"own ema {v}".encode()), v
        )
    carol, carol_ema = (lineage_store(url, "carol", stem, cache_dir=tmp_path / "cache") for stem in ("policy", "ema"))
    for v in (1, 2):
        carol.publish(adapter_folder(tmp_path / f"carol{v}", f"carol {v}".encode()), v)
        carol_ema.publish(adapter_folder(tmp_path / f"carol-ema{v}", f"carol ema {v}".encode()), v)
    records = RunRecords.from_config(cfg, url)
    records.save("alice", {"token_sha256": "x", "max_staleness": 2})
    records.save("bob", {"token_sha256": "y"})  # registered, nothing published yet
    records.save("carol", {"token_sha256": "z", "max_staleness": 0, "lineages": 2})  # self-distils from its average

    async def scenario():
        wanted = await adapters_to_serve(cfg, slots.sources, url)
        for name, ref in wanted:
            await slots.load(name, ref)
        return wanted

    wanted = asyncio.run(scenario())
    assert [name for name, _ in wanted] == [
        "policy-v2",
        "policy-v3",
        "ema-v2",
        "ema-v3",
        "alice/policy-v4",
        "alice/policy-v5",
        "alice/policy-v6",
        "carol/policy-v2",
        "carol/ema-v2",
    ]
    assert slots.names == tuple(sorted(name for name, _ in wanted))


def test_a_generation_still_waiting_for_a_lora_slot_is_handed_back_too_and_never_reaches_the_engine(tmp_path):
    """Every slot holds an adapter with requests in flight, so a request for another version waits for one: handed
    back meanwhile, it answers at once once it could start (no choice: the ingress sends it whole elsewhere), and
    the doomed engine never samples it."""
    from tests.support.replica_parts import publish

    class CountingLLM(StreamingLLM):
        def __init__(self):
            super().__init__()
            self.started = []

        async def generate(self, prompt, params, request_id, lora_request=None):
            self.started.append(lora_request.lora_name if lora_request else None)
            async for out in super().generate(prompt, params, request_id, lora_request):
                yield out

    async def scenario():
        llm = CountingLLM()
        slots = adapter_slots(tmp_path, llm, window=1, max_loras=1)
        publish(slots.sources.store, tmp_path, 1, 2)
        replica = Replica(REPLICA, slots.engine, slots, 60.0)
        sampling = Sampling(n=2, max_tokens=1000, logprobs=0)
        running = asyncio.create_task(replica.generate(GenerateRequest([1, 2], "policy-v1", sampling)))
        await until(lambda: llm.started)  # the first LoRA request imports vLLM: seconds
        waiting = asyncio.create_task(replica.generate(GenerateRequest([1, 2], "policy-v2", sampling)))
        await until(lambda: replica.inflight.requests == 2)
        await asyncio.sleep(0.2)
        assert [name.split("@")[0] for name in llm.started] == ["policy-v1"]  # v2 waits for the only slot
        assert await replica.control(HandBack()) == HandedBack(REPLICA, 2)
        return await running, await waiting, llm

    first, second, llm = asyncio.run(scenario())
    assert first.handed_back and all(c.finish_reason == ABORTED for c in first.choices)
    assert second.handed_back and second.choices == [] and len(llm.started) == 1


async def until(condition, timeout_s: float = 60.0) -> None:
    deadline = time.monotonic() + timeout_s
    while not condition():
        assert time.monotonic() < deadline, "timed out"
        await asyncio.sleep(0.01)


def test_a_generation_cut_while_it_waits_for_its_adapter_answers_empty_cut_choices(tmp_path):
    from deployments.replica.shell import unstarted

    cut = unstarted(Sampling(n=3, logprobs=2), handed_back=False)
    assert [(c.index, c.token_ids, c.logprobs, c.top_logprobs, c.finish_reason) for c in cut] == [
        (i, [], [], [], ABORTED) for i in range(3)
    ]
    assert unstarted(Sampling(n=3), handed_back=True) == []


def test_a_replica_that_serve_begins_to_stop_hands_back_at_once_not_at_the_deadline(tmp_path):
    """Serve stops a draining replica as soon as its replacement runs, which may be a minute before the notice's
    deadline: the generations in flight are handed back then, not lost with it (the shipped margin, 10 s)."""

    async def scenario():
        replica = _replica(tmp_path, StreamingLLM())
        stops = asyncio.Event()

        async def stopping():
            return stops.is_set()

        notices = _notices(replica, [], stopping)
        running = asyncio.create_task(replica.generate(_request()))
        await asyncio.sleep(0.05)
        draining = asyncio.create_task(notices.drain(Notice("aws", time.time() + 120.0)))
        await asyncio.sleep(0.3)
        assert notices.handed_back == 0  # no hurry yet: 110 s to the hand-back
        stops.set()  # the replacement runs: Serve starts the graceful stop
        cut = await asyncio.wait_for(running, 5)
        draining.cancel()
        return cut, notices

    cut, notices = asyncio.run(scenario())
    assert cut.handed_back and notices.handed_back == 1


def test_a_node_that_outlives_its_notice_serves_again_and_is_watched_for_the_next(tmp_path, monkeypatch):
    import deployments.replica.notices as replica_notices

    monkeypatch.setattr(replica_notices, "OUTLIVED_S", 0.2)

    async def scenario():
        replica, told = _replica(tmp_path, StreamingLLM()), []
        replica.notices = notices = _notices(replica, told)
        await notices.answer(Notice("file", time.time() + 0.1))  # nothing in flight; returns once outlived
        done = await replica.generate(_request(max_tokens=3))
        return told, done, notices

    told, done, notices = asyncio.run(scenario())
    assert told[-1] == "serving" and not notices.draining and done.choices[0].finish_reason == "length"


def test_a_drain_that_ray_refuses_with_an_error_drains_the_replica_all_the_same(tmp_path, monkeypatch):
    import deployments.replica.notices as replica_notices

    def refuses(notice):
        raise RuntimeError("GCS unavailable")

    monkeypatch.setattr(replica_notices, "drain_this_node", refuses)

    async def scenario():
        replica, told = _replica(tmp_path, StreamingLLM()), []
        notices = _notices(replica, told, drain_node=True)
        notices._loop = asyncio.get_running_loop()
        await asyncio.to_thread(notices._heard, Notice("aws", time.time() + 120.0))  # the watcher's thread
        await asyncio.sleep(0.1)
        return told, notices

    told, notices = asyncio.run(scenario())
    assert notices.draining and told and told[0] != "serving"
