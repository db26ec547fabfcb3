"""The rank supervisor both learners stand on (`app.learner.rank_group.RankGroup`), over ranks without a model on a
loopback Ray: ranks are placed and joined at rank 0's address, answer in rank order, and come back joined after a
rank's death, restarted by Ray (the run learner's way) or replaced by new ones (the Tinker learner's)."""

import os
import time
import uuid

import pytest
import ray

from app.learner.rank_group import RankGroup

BUNDLE = {"CPU": 0.25}


class EchoRank:
    """A rank that answers the group's calls and tells who it is: its rank, its process, where it joined."""

    def __init__(self, label: str, rank: int, world_size: int):
        self.label, self.rank, self.world_size = label, rank, world_size
        self.joined: tuple[str, int] | None = None
        self.born = uuid.uuid4().hex

    def rendezvous_address(self) -> tuple[str, int]:
        return "127.0.0.1", 29500 + os.getpid() % 1000

    def join(self, address: str, port: int) -> None:
        self.joined = (address, port)

    def ping(self) -> int:
        return self.rank

    def incarnation(self) -> str:
        return self.born

    def who(self) -> tuple:
        return self.label, self.rank, self.world_size, os.getpid(), self.joined


@pytest.fixture(scope="module", autouse=True)
def ray_local():
    ray.init(
        address="local",
        num_cpus=2,
        resources={"learner_node": 1},
        include_dashboard=False,
        _node_ip_address="127.0.0.1",
        configure_logging=False,
    )
    yield
    ray.shutdown()


def _group(max_restarts: int, ranks: int = 2, label: str = "echo") -> RankGroup:
    return RankGroup(
        EchoRank, lambda rank: (label, rank, ranks), [BUNDLE] * ranks, max_restarts=max_restarts, what="echo"
    )


def _joined_as_one(group: RankGroup) -> list[int]:
    """The ranks' processes, once every rank is checked to have joined rank 0's address, in rank order."""
    answers = group.all("who")
    address = group.rank0("rendezvous_address")
    assert [(label, rank, size, joined) for label, rank, size, _, joined in answers] == [
        ("echo", rank, len(answers), address) for rank in range(len(answers))
    ]
    return [pid for *_, pid, _ in answers]


def test_ranks_are_placed_joined_at_rank_0s_address_and_answer_in_rank_order():
    group = _group(max_restarts=0, ranks=3)
    try:
        assert len(set(_joined_as_one(group))) == 3
        refs = group.call("ping")
        RankGroup.wait(refs)
        assert ray.get(refs) == [0, 1, 2]
    finally:
        group.stop()
    assert group.actors == []


def test_a_rank_ray_restarts_comes_back_joined_with_its_peers_restarted_too():
    group = _group(max_restarts=-1)
    try:
        before = _joined_as_one(group)
        handles = list(group.actors)
        ray.kill(group.actors[1], no_restart=False)  # as a preemption would: Ray restarts it
        group.restart(dead={1})
        after = _joined_as_one(group)
        assert group.actors == handles and not set(after) & set(before)  # the same actors, every one a new process
    finally:
        group.stop()


def test_ranks_ray_does_not_restart_are_replaced_by_new_ones_joined():
    group = _group(max_restarts=0)
    try:
        before = _joined_as_one(group)
        handles = list(group.actors)
        ray.kill(group.actors[1], no_restart=True)
        group.replace()
        after = _joined_as_one(group)
        assert not set(group.actors) & set(handles) and not set(after) & set(before)
    finally:
        group.stop()


def test_a_lone_rank_asks_for_its_bundles_custom_resources_itself():
    group = RankGroup(
        EchoRank, lambda rank: ("echo", rank, 1), [{**BUNDLE, "learner_node": 1}], max_restarts=0, what="echo"
    )
    try:
        _joined_as_one(group)
        deadline = time.monotonic() + 10  # Ray's count of what is free lags a little behind
        while ray.available_resources().get("learner_node", 0) and time.monotonic() < deadline:
            time.sleep(0.2)
        assert ray.available_resources().get("learner_node", 0) == 0  # the node's one unit is the rank's
    finally:
        group.stop()
