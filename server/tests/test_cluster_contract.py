"""The single-node contract suites, run again against a node in cluster mode with R = 1
(issue 28, case 10: "with --cluster and R=1: unchanged"). Every test of
test_queue_service.py and test_queues_service.py is collected here too, with the
``server`` fixture replaced: a server started with ``cluster`` (a real etcd, a namespace
of its own per test) and ``replicas = 1``. The same calls get the same answers, the same
error codes and the same field names, but for the two tests in ``DIFFERENT``.

Run first, this found five differences, each fixed where the cluster routes calls: a
queue name no queue can have answered NOT_FOUND, not INVALID_ARGUMENT naming
``queue_name`` (Produce, Lease, Complete, GetQueueStats, DeleteQueue ...); a Lease's
``request_timeout`` below 0 or above 15 minutes was not refused; DeleteQueue without
``force`` dropped a queue that held only scheduled items; a Lease waiting on a queue that
was deleted answered NOT_FOUND rather than empty."""

from __future__ import annotations

import os
import uuid
from collections.abc import Iterator

import grpc
import pytest
import test_queue_service
import test_queues_service
from cluster_helpers import Etcd

from querator.v1 import queues_pb2

from conftest import Stubs, ThreadServer, expect_code, free_port, wait_until

# Tests of what a single node does and a cluster does differently on purpose.
DIFFERENT = {
    # A single node has no other node for a copy: replicas above 1 are INVALID_ARGUMENT
    # there; a cluster answers FAILED_PRECONDITION naming its live nodes
    # (test_cluster_replicas.py).
    "test_a_single_server_keeps_one_copy_and_refuses_replicas_naming_the_field",
    # CreateQueue in a cluster is the catalog's change, answered once this node applied
    # it: storage failing at the queue's home leaves the queue created and failing there
    # (UNAVAILABLE naming the failure, cluster_reconcile_failed logged) until the
    # storage works again, rather than a create that did not happen.
    "test_create_when_storage_fails_is_unavailable_and_retryable",
}

for _module in (test_queue_service, test_queues_service):
    for _name, _value in vars(_module).items():
        if not _name.startswith("_") and _name not in DIFFERENT and _name not in globals():
            globals()[_name] = _value


@pytest.fixture(scope="module")
def etcd(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Etcd]:
    with Etcd(str(tmp_path_factory.mktemp("contract-etcd"))) as e:
        yield e


@pytest.fixture
def server(data_dir: str, etcd: Etcd) -> Iterator[ThreadServer]:
    srv = ThreadServer(
        data_dir,
        address=f"127.0.0.1:{free_port()}",  # a cluster node advertises its port
        cluster=f"etcd://{etcd.endpoint}/contract-{uuid.uuid4().hex[:8]}",
        node_id="n1",
        replicas=1,
    )
    yield srv
    srv.stop()


def test_create_when_storage_fails_in_a_cluster_answers_unavailable_until_the_storage_works(
    server: ThreadServer, stubs: Stubs
) -> None:
    """The cluster's side of the second test in DIFFERENT: the create is the catalog's,
    so it stands; this node's calls then answer UNAVAILABLE naming why its storage could
    not be made (not NOT_FOUND for a queue GetQueue shows), and once the storage works
    the node makes it without another change of the catalog. Before, every call
    answered NOT_FOUND "queue 'q' does not exist" until some other catalog change."""
    blockers = test_queues_service.block_new_storage(server.data_dir)
    stubs.create("q")
    error = expect_code(lambda: stubs.produce("q", [b"x"]), grpc.StatusCode.UNAVAILABLE)
    assert "could not make its storage" in (error.details() or ""), error.details()
    assert stubs.queues.GetQueue(queues_pb2.GetQueueRequest(queue_name="q"), timeout=10).queue.queue_name == "q"
    for path in blockers:
        os.remove(path)
    wait_until(lambda: _produces(stubs), timeout=10)  # its own retry: 1 s, doubling
    assert [i.payload for i in stubs.lease("q", batch_size=10).items] == [b"x"]


def _produces(stubs: Stubs) -> bool:
    try:
        stubs.produce("q", [b"x"])
    except grpc.RpcError as exc:
        assert exc.code() == grpc.StatusCode.UNAVAILABLE, exc
        return False
    return True
