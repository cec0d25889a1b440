"""PauseQueue / ResumeQueue in a cluster: the pause is in the queue's catalog entry, and
every node homing a partition honours it, including one that was down when it was set.

A real etcd and three real node processes (cluster_helpers.py); each node's
``querator_queue_paused`` gauge reads its own actor's settings, so it shows that the
node itself applied the pause, not only that the catalog holds it.
"""

from __future__ import annotations

import time
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor

import grpc
import pytest
from cluster_helpers import Cluster, Node

from querator.v1 import queue_pb2, queues_pb2

from conftest import dur, wait_until


@pytest.fixture(scope="module")
def cluster(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Cluster]:
    with Cluster(str(tmp_path_factory.mktemp("cluster")), metrics=True) as c:
        yield c


def _paused_gauge(node: Node, queue: str) -> float | None:
    return node.gauge(f'querator_queue_paused{{queue="{queue}"}}')


def _live(node: Node) -> set[str]:
    return {m.node_id for m in node.info().members if m.live}


def _get(node: Node, name: str) -> queues_pb2.QueueInfo:
    return node.stubs.queues.GetQueue(queues_pb2.GetQueueRequest(queue_name=name), timeout=10).queue


def test_a_pause_holds_on_every_node_even_one_that_was_down(cluster: Cluster) -> None:
    n1, n2, n3 = cluster.nodes
    n1.stubs.create("held", requested_partitions=3)
    homes = [q for q in n1.info().queues if q.queue_name == "held"][0].homes
    assert sorted(homes) == ["n1", "n2", "n3"]  # one partition on each node
    for i in range(6):  # a node produces into the partition it homes
        cluster.nodes[i % 3].stubs.produce("held", [f"p{i}".encode()])
    assert [p.total for p in n1.stubs.stats("held").partitions] == [2, 2, 2]

    n3.kill9()
    wait_until(lambda: "n3" not in _live(n1), timeout=20, interval=0.2)
    info = n2.stubs.queues.PauseQueue(queues_pb2.PauseQueueRequest(queue_name="held"), timeout=15).queue
    assert info.paused and not info.produce_paused
    n3.start()
    wait_until(lambda: _live(n1) == {"n1", "n2", "n3"}, timeout=20, interval=0.2)
    for node in cluster.nodes:
        wait_until(lambda node=node: _paused_gauge(node, "held") == 1.0, timeout=15, interval=0.2)
        assert _get(node, "held").paused

    # Six items ready over three homes, and no node hands out any of them.
    for node in cluster.nodes:
        started = time.monotonic()
        assert node.stubs.lease("held", 10, timeout=10, request_timeout=dur(0.5)).items == []
        assert time.monotonic() - started >= 0.4
    n3.stubs.produce("held", [b"while-paused"])  # produce goes on

    with ThreadPoolExecutor(1) as pool:
        waiting = pool.submit(n3.stubs.lease, "held", 50, "", 30, request_timeout=dur(20))
        time.sleep(1.0)
        assert not waiting.done()
        n1.stubs.queues.ResumeQueue(queues_pb2.ResumeQueueRequest(queue_name="held"), timeout=15)
        got = [item.payload for item in waiting.result(25).items]
    assert got  # the waiting lease was served once the queue was resumed
    for node in cluster.nodes:
        wait_until(lambda node=node: _paused_gauge(node, "held") == 0.0, timeout=15, interval=0.2)
    deadline = time.monotonic() + 30
    while len(got) < 7 and time.monotonic() < deadline:
        got += [item.payload for item in n2.stubs.lease("held", 50, timeout=10, request_timeout=dur(1)).items]
    assert sorted(got) == sorted([f"p{i}".encode() for i in range(6)] + [b"while-paused"])


def test_paused_for_produce_is_refused_through_every_node(cluster: Cluster) -> None:
    n1, n2, n3 = cluster.nodes
    n1.stubs.create("shut", requested_partitions=3)
    n2.stubs.queues.PauseQueue(queues_pb2.PauseQueueRequest(queue_name="shut", produce=True), timeout=15)
    for node in cluster.nodes:
        wait_until(lambda node=node: _paused_gauge(node, "shut") == 2.0, timeout=15, interval=0.2)
    for node in cluster.nodes:
        for _ in range(3):  # a produce goes to one home; three tries reach more than one
            with pytest.raises(grpc.RpcError) as err:
                node.stubs.queue.Produce(queue_pb2.ProduceRequest(queue_name="shut", payloads=[b"x"]), timeout=10)
            assert err.value.code() == grpc.StatusCode.FAILED_PRECONDITION
            assert "paused for produce" in err.value.details()
    n3.stubs.queues.ResumeQueue(queues_pb2.ResumeQueueRequest(queue_name="shut"), timeout=15)
    for node in cluster.nodes:
        wait_until(lambda node=node: _paused_gauge(node, "shut") == 0.0, timeout=15, interval=0.2)
        node.stubs.produce("shut", [b"ok"])
    assert sum(p.total for p in n1.stubs.stats("shut").partitions) == 3
