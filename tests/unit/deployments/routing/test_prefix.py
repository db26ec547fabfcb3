"""The prefix-affinity policy (`deployments.routing.prefix`): block hashing, the LRU table, the routing decision."""

import random

import pytest

from deployments.routing.prefix import PrefixTable, block_hashes, decide, least_loaded


def test_block_hashes_cover_full_blocks_only_and_chain():
    ids = list(range(40))
    hashes = block_hashes(ids, 16, "policy-v1")
    assert len(hashes) == 2  # 40 tokens = 2 full blocks of 16; the partial tail is never cached by vLLM
    assert block_hashes(ids[:32], 16, "policy-v1") == hashes
    # Chained: the second block's hash depends on the first block too.
    changed = [999] + ids[1:]
    assert block_hashes(changed, 16, "policy-v1")[1] != hashes[1]
    # A different adapter is a different namespace from the first block on.
    other = block_hashes(ids, 16, "policy-v2")
    assert not set(other) & set(hashes)
    # Runs' adapters of the same version are namespaced by the full name (`alice/policy-v1`): never shared.
    alice, bob = block_hashes(ids, 16, "alice/policy-v1"), block_hashes(ids, 16, "bob/policy-v1")
    assert not set(alice) & set(bob) and not set(alice) & set(hashes)
    assert block_hashes(ids[:15], 16, "policy-v1") == []
    with pytest.raises(ValueError):
        block_hashes(ids, 0, "x")


def test_table_match_counts_only_blocks_some_replica_lacks():
    table = PrefixTable(100)
    shared = block_hashes(list(range(32)), 16, "base")  # e.g. a system prompt both replicas served
    table.record(shared, "a")
    table.record(shared, "b")
    prompt = block_hashes(list(range(32)) + [7] * 32, 16, "base")
    assert prompt[:2] == shared
    assert table.match(prompt, {"a", "b"}) == {}  # everyone holds the shared blocks: no preference
    table.record(prompt, "b")
    assert table.match(prompt, {"a", "b"}) == {"b": 4}
    # "Everyone" means the live replicas: with a fresh "c" beside "a", the shared blocks point to "a" ...
    assert table.match(prompt, {"a", "c"}) == {"a": 2}
    # ... and a lone live replica holds everything there is to hold, which prefers nothing.
    assert table.match(prompt, {"a"}) == {}


def test_table_match_stops_at_first_unknown_block():
    table = PrefixTable(100)
    hashes = block_hashes(list(range(64)), 16, "m")
    table.record(hashes[:1], "a")
    table.record(hashes[2:], "a")  # a later block known without its predecessor: unreachable through the chain
    assert table.match(hashes, {"a", "b"}) == {"a": 1}


def test_table_is_a_bounded_lru():
    table = PrefixTable(3)
    table.record([1, 2, 3], "a")
    assert table.match([1], {"a", "b"}) == {"a": 1}  # touches 1: now 2 is the least recently used
    table.record([4], "b")
    assert len(table) == 3
    assert table.holders(2) == frozenset() and table.holders(1) == {"a"} and table.holders(4) == {"b"}


def test_table_forgets_dead_replicas():
    table = PrefixTable(10)
    table.record([1, 2], "a")
    table.record([2], "b")
    table.forget({"a"})
    assert table.holders(1) == frozenset() and table.holders(2) == {"b"} and len(table) == 1


def test_decide_prefers_longest_match_then_spills_past_threshold():
    rng = random.Random(0)
    loads = {"a": 3, "b": 0}
    d = decide({"a": 4}, loads, spill_threshold=8, rng=rng)
    assert (d.replica, d.outcome, d.matched_blocks) == ("a", "affinity", 4)
    d = decide({"a": 4, "b": 2}, loads, spill_threshold=8, rng=rng)
    assert d.replica == "a"  # longest match wins even though b is less loaded
    d = decide({"a": 4}, {"a": 9, "b": 0}, spill_threshold=8, rng=rng)
    assert (d.replica, d.outcome, d.preferred) == ("b", "spilled", "a")
    d = decide({"a": 4}, {"a": 8, "b": 0}, spill_threshold=8, rng=rng)
    assert d.outcome == "affinity"  # exactly at the threshold still stays
    d = decide({}, {"a": 2, "b": 1}, spill_threshold=8, rng=rng)
    assert (d.replica, d.outcome) == ("b", "unmatched")
    d = decide({"gone": 5}, {"a": 2, "b": 1}, spill_threshold=8, rng=rng)
    assert d.outcome == "unmatched"  # a match on a replica that is not live is no match
    with pytest.raises(ValueError):
        decide({}, {}, 8, rng)


def test_least_loaded_breaks_ties_at_random():
    rng = random.Random(1)
    picks = {least_loaded({"a": 0, "b": 0, "c": 5}, rng) for _ in range(50)}
    assert picks == {"a", "b"}


def test_a_group_of_g_lands_on_one_replica_and_the_next_group_balances():
    """The whole policy on a rollout-like stream: the first of a group is unmatched, G-1 follow it."""
    table, rng, G = PrefixTable(1000), random.Random(0), 8
    loads = {"a": 0, "b": 0}
    outcomes, placed = [], {}
    for group in range(6):
        prompt = [group * 1000 + i for i in range(64)]
        hashes = block_hashes(prompt, 16, "policy-v1")
        for _ in range(G):
            d = decide(table.match(hashes, loads), loads, 8, rng)
            table.record(hashes, d.replica)
            loads[d.replica] += 1  # all in flight at once
            outcomes.append(d.outcome)
            placed.setdefault(group, set()).add(d.replica)
    assert all(len(replicas) == 1 for replicas in placed.values())
    assert outcomes.count("affinity") == 6 * (G - 1) and outcomes.count("unmatched") == 6
    assert abs(loads["a"] - loads["b"]) <= G  # groups alternate to the less loaded replica


def test_a_session_table_is_a_bounded_lru_that_forgets_replicas_that_left():
    from deployments.routing.prefix import SessionTable

    table = SessionTable(max_entries=2)
    table.record("s1", "a")
    table.record("s2", "b")
    assert table.replica("s1") == "a"  # s1 used last: s2 is the oldest now
    table.record("s3", "a")
    assert (table.replica("s2"), len(table)) == (None, 2)
    table.forget({"a"})
    assert (table.replica("s1"), table.replica("s3"), len(table)) == (None, None, 0)
    with pytest.raises(ValueError):
        SessionTable(0)


def test_a_sessions_outcome_says_whether_it_stayed_spilled_or_began():
    from deployments.routing.prefix import Decision, session_outcome

    loads = {"a": 0, "b": 0}
    assert session_outcome("a", loads, Decision("a", "affinity")) == "kept"
    assert session_outcome("a", loads, Decision("b", "spilled")) == "spilled"
    assert session_outcome(None, loads, Decision("b", "unmatched")) == "new"
    assert session_outcome("gone", loads, Decision("b", "unmatched")) == "new"  # its replica left the fleet
