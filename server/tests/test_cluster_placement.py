"""Placement and the catalog entry format: pure functions every node must agree on."""

from __future__ import annotations

from collections import Counter

import pytest

from querator_server.cluster.etcd import Endpoint, prefix_end
from querator_server.cluster.placement import Home, QueueEntry, key_partition, place
from querator_server.errors import InvalidArgument
from querator_server.model import QueueConfig


@pytest.mark.parametrize("partitions", [1, 2, 3, 7, 30])
def test_new_partitions_spread_over_the_live_nodes(partitions: int) -> None:
    homes = place(partitions, ["n3", "n1", "n2"])
    counts = Counter(h.node for h in homes)
    assert max(counts.values()) - min(counts.values(), default=0) <= 1
    assert len(counts) == min(partitions, 3)
    for node in counts:  # local indexes 0, 1, 2, ... on each node
        assert sorted(h.index for h in homes if h.node == node) == list(range(counts[node]))


def test_added_partitions_even_out_and_never_renumber_existing_ones() -> None:
    existing = place(2, ["n1", "n2"])  # before n3 joined
    added = place(4, ["n1", "n2", "n3"], existing)
    assert Counter(h.node for h in existing + added) == {"n1": 2, "n2": 2, "n3": 2}
    assert existing == [Home("n1", 0), Home("n2", 0)]
    assert {h for h in added if h.node != "n3"} == {Home("n1", 1), Home("n2", 1)}


def test_queues_of_one_partition_go_to_the_node_homing_the_fewest_partitions() -> None:
    load: Counter[str] = Counter()
    for _ in range(10):
        (home,) = place(1, ["n1", "n2"], load=load)
        load[home.node] += 1
    assert load == {"n1": 5, "n2": 5}
    # The queue's own spread comes first: a queue of two partitions gets one on each node
    # even when one node is busier.
    assert Counter(h.node for h in place(2, ["n1", "n2"], load={"n1": 9})) == {"n1": 1, "n2": 1}
    assert place(1, ["n1", "n2"], load={"n1": 9}) == [Home("n2", 0)]


def test_no_live_node_cannot_place() -> None:
    with pytest.raises(ValueError):
        place(1, [])


def test_an_entry_round_trips_and_maps_local_indexes_to_partitions() -> None:
    config = QueueConfig(name="q", reference="r", max_attempts=4, partitions=3, uid=99, group=2)
    entry = QueueEntry(config, (Home("n1", 0), Home("n2", 0), Home("n1", 1)), key_partitions=3)
    back = QueueEntry.decode("q", entry.encode(), mod_revision=7, generation=5)
    assert back.config == config.replace(uid=0, group=-1)  # a node's own uid and group are not shared
    assert back.homes == entry.homes and (back.mod_revision, back.generation) == (7, 5)
    assert back.local_partitions("n1") == {0: 0, 1: 2} and back.local_count("n1") == 2
    assert back.local_count("n3") == 0 and back.nodes() == ["n1", "n2"]


def test_a_key_always_maps_to_the_same_partition() -> None:
    assert key_partition("order-42", 5) == key_partition("order-42", 5)
    assert len({key_partition(f"k{i}", 4) for i in range(100)}) == 4


def test_cluster_urls() -> None:
    assert Endpoint.parse("etcd://a:1,b:2/prod") == Endpoint(("a:1", "b:2"), "/prod/")
    for bad in ("http://a:1/prod", "etcd://a:1", "etcd:///prod"):
        with pytest.raises(InvalidArgument):
            Endpoint.parse(bad)
    assert prefix_end(b"/prod/") == b"/prod0"


def test_a_catalog_entry_holds_the_pause_only_while_set() -> None:
    """An entry of a queue never paused reads the same to a node from before pausing
    existed (its settings have no new keys); a paused one carries both flags."""
    homes = (Home("n1", 0), Home("n2", 0))
    plain = QueueEntry(QueueConfig(name="q", partitions=2), homes, key_partitions=2)
    assert b"paused" not in plain.encode()
    held = QueueEntry(QueueConfig(name="q", partitions=2, paused=True, produce_paused=True), homes, key_partitions=2)
    config = QueueEntry.decode("q", held.encode(), 1, 1).config
    assert (config.paused, config.produce_paused) == (True, True)
    resumed = QueueEntry.decode("q", plain.encode(), 2, 1).config
    assert (resumed.paused, resumed.produce_paused) == (False, False)


def test_a_replicated_queues_primary_goes_to_the_node_serving_the_fewest_and_copies_to_the_least_loaded() -> None:
    from querator_server.cluster.placement import place_shard

    live = ["n1", "n2", "n3", "n4"]
    # n3 serves no primary: it is primary; copies on the nodes keeping the fewest copies.
    assert place_shard(3, live, {"n1": 2, "n2": 1, "n4": 1}, {"n1": 2, "n2": 3, "n3": 1, "n4": 0}) == ["n3", "n4", "n1"]
    # Ties on primaries go to the node keeping the fewest copies, then node id order.
    assert place_shard(2, live, {}, {"n1": 1, "n3": 2}) == ["n2", "n4"]
    assert place_shard(2, live, {}, {}) == ["n1", "n2"]
    # Queues created one after another take turns as primary over the nodes.
    primaries: Counter[str] = Counter()
    copies: Counter[str] = Counter()
    for _ in range(8):
        chosen = place_shard(2, live, primaries, copies)
        primaries[chosen[0]] += 1
        copies.update(chosen)
        assert len(set(chosen)) == 2
    # Primaries come out even; copies within two of each other (a primary goes where the
    # fewest primaries are, whatever copies that node keeps already).
    assert primaries == {"n1": 2, "n2": 2, "n3": 2, "n4": 2}
    assert max(copies.values()) - min(copies.values()) <= 2 and sum(copies.values()) == 16
    with pytest.raises(ValueError, match="3 copies need 3 live nodes, 2 live"):
        place_shard(3, ["n1", "n2"], {}, {})
