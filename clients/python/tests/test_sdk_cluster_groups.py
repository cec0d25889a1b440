"""Ordered groups through the SDK against a cluster (real etcd, three real nodes): a
grouped produce goes to its group's home, and a Producer's and a consumer's view of
each group's order holds. Deliveries are checked by payload."""

from __future__ import annotations

import zlib
from collections.abc import Iterator

import pytest
from cluster_helpers import Cluster

import querator

from conftest import wait_until
from sdk_helpers import unique


@pytest.fixture(scope="module")
def cluster(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Cluster]:
    with Cluster(str(tmp_path_factory.mktemp("groups"))) as c:
        yield c


def _homes(cluster: Cluster, name: str) -> list[str]:
    return list(next(q for q in cluster.nodes[0].info().queues if q.queue_name == name).homes)


def test_grouped_items_go_to_their_groups_home_and_keep_their_order(cluster: Cluster) -> None:
    name = unique("groups")
    with querator.Client(cluster.nodes[1].address) as client:
        client.create_queue(name, partitions=6, lease_timeout=60)
        wait_until(lambda: len(set(_homes(cluster, name))) == 3, timeout=20)
        homes = _homes(cluster, name)
        keys = [f"customer-{i}" for i in range(12)]
        for key in keys:
            placed = client.produce(name, [querator.Item(f"{key}/0".encode(), group_key=key)])
            assert homes[placed.partitions[0]] == homes[zlib.crc32(key.encode()) % 6]
        with querator.Producer(client, name, max_items=4, max_in_flight=4) as producer:
            for n in range(1, 200):
                key = keys[n % len(keys)]
                producer.produce(f"{key}/{n}".encode(), group_key=key)
        seen: dict[str, list[int]] = {k: [] for k in keys}
        for _ in range(3000):
            batch = client.lease(name, batch_size=50, wait=0.2)
            if not batch and sum(map(len, seen.values())) == 211:
                break
            for item in batch:
                key, n = item.text.split("/")
                assert item.group_key == key
                seen[key].append(int(n))
            if batch:
                client.complete(batch)
        for i, key in enumerate(keys):
            assert seen[key] == [0] + [n for n in range(1, 200) if n % len(keys) == i], key
        stats = client.queue_stats(name)
        assert stats.total == 0 and sum(p.groups_in_flight for p in stats.partitions) == 0
