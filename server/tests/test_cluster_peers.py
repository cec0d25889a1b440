"""The calls nodes make to each other (cluster/forwarding.py), through real etcd and
real node processes on loopback: replies of any size the server may send, the marker
of a forwarded call honoured only from a peer, bounds on what waits on a paused home,
and the give-back of a LeaseStream's unsent answers whose items live on another node.

One cluster serves the module; each test uses queues of its own, and a test that
pauses a node resumes it before it ends.
"""

from __future__ import annotations

import os
import pathlib
import signal
import time
from collections import Counter
from collections.abc import Iterator

import grpc
import pytest
from cluster_helpers import Cluster, Node

from querator.v1 import queue_pb2, queue_pb2_grpc, queues_pb2, storage_pb2

from conftest import Stubs, dur, wait_until

MIB = 1 << 20
# One item of 4.5 MB: more than gRPC's default 4 MiB receive limit, less than the
# 5 MB a request may be.
BIG = 4_500_000


@pytest.fixture(scope="module")
def cluster(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Cluster]:
    with Cluster(str(tmp_path_factory.mktemp("peers"))) as c:
        yield c


@pytest.fixture
def roomy() -> Iterator[list[grpc.Channel]]:
    """Channels (closed at the end) that read replies of up to 16 MiB."""
    channels: list[grpc.Channel] = []
    yield channels
    for channel in channels:
        channel.close()


def _roomy_stubs(node: Node, channels: list[grpc.Channel]) -> Stubs:
    options = [("grpc.max_receive_message_length", 16 * MIB), ("grpc.max_send_message_length", 16 * MIB)]
    channel = grpc.insecure_channel(node.address, options=options)
    channels.append(channel)
    return Stubs(channel)


def _home_and_other(cluster: Cluster, name: str) -> tuple[Node, Node]:
    """A one-partition queue's home, and a node that is not its home."""
    (placement,) = [q for q in cluster.nodes[0].info().queues if q.queue_name == name]
    (home,) = [n for n in cluster.nodes if n.node_id == placement.homes[0]]
    other = next(n for n in cluster.nodes if n is not home)
    return home, other


def _big_queue(cluster: Cluster, name: str, channels: list[grpc.Channel]) -> tuple[Stubs, bytes, str]:
    """A one-partition queue holding one 4.5 MB item: stubs on a node that is not its
    home, the item's payload and its message id."""
    cluster.nodes[0].stubs.create(name, requested_partitions=1, lease_timeout=dur(300))
    home, other = _home_and_other(cluster, name)
    payload = name.encode().ljust(BIG, b".")
    message_id = _roomy_stubs(home, channels).produce(name, [payload]).ids[0]
    return _roomy_stubs(other, channels), payload, message_id


def test_a_listing_page_over_4_mib_is_read_from_the_home_by_another_node(cluster: Cluster, roomy: list[grpc.Channel]) -> None:
    through, payload, message_id = _big_queue(cluster, "big-list", roomy)
    page = through.storage.ListItems(storage_pb2.ListItemsRequest(queue_name="big-list", page_size=10), timeout=30)
    assert [(i.payload, i.message_id) for i in page.items] == [(payload, message_id)]


def test_a_lease_of_an_item_over_4_mib_through_another_node_delivers_it(cluster: Cluster, roomy: list[grpc.Channel]) -> None:
    through, payload, message_id = _big_queue(cluster, "big-lease", roomy)
    leased = through.lease("big-lease", batch_size=1, timeout=30, request_timeout=dur(5))
    assert [(i.payload, i.message_id) for i in leased.items] == [(payload, message_id)]
    through.complete("big-lease", leased.partition, [leased.items[0].id])
    assert sum(s.total for s in through.stats("big-lease").partitions) == 0


def test_a_lease_stream_through_another_node_delivers_an_item_over_4_mib(cluster: Cluster, roomy: list[grpc.Channel]) -> None:
    through, payload, message_id = _big_queue(cluster, "big-stream", roomy)
    message = queue_pb2.LeaseStreamRequest(
        request=queue_pb2.LeaseRequest(queue_name="big-stream", batch_size=1, request_timeout=dur(5))
    )
    (answer,) = list(through.queue.LeaseStream(iter([message]), timeout=30))
    assert answer.WhichOneof("result") == "response", answer.error
    assert [(i.payload, i.message_id) for i in answer.response.items] == [(payload, message_id)]
    through.complete("big-stream", answer.response.partition, [answer.response.items[0].id])
    assert sum(s.total for s in through.stats("big-stream").partitions) == 0


# What a client sent to pass its call off as one forwarded by another node: the bare
# marker, or the marker with a made-up proof.
FORGED = (("x-querator-forwarded", "n1"),)
MADE_UP = (*FORGED, ("x-querator-peer-proof", f"{int(time.time() * 1000)}.0011223344556677.{'ab' * 32}"))


def test_a_client_sending_the_forwarded_marker_cannot_delete_a_non_empty_queue(cluster: Cluster) -> None:
    n1 = cluster.nodes[0]
    n1.stubs.create("kept", requested_partitions=2)
    (placement,) = [q for q in n1.info().queues if q.queue_name == "kept"]
    full, empty = [next(n for n in cluster.nodes if n.node_id == home) for home in placement.homes]
    assert full is not empty
    full.stubs.produce("kept", [b"acknowledged"])  # on the receiving node's own partition
    # ``empty``'s partition is empty: by the marker alone it would look only at itself.
    request = queues_pb2.DeleteQueueRequest(queue_name="kept")
    with pytest.raises(grpc.RpcError) as refused:
        empty.stubs.queues.DeleteQueue(request, timeout=10, metadata=FORGED)
    assert refused.value.code() == grpc.StatusCode.FAILED_PRECONDITION, refused.value.details()
    assert "still holds items" in (refused.value.details() or "")
    assert sum(s.total for s in n1.stubs.stats("kept").partitions) == 1
    assert "forwarded_marker_ignored" in empty.stderr_text()


@pytest.mark.parametrize("marker", [FORGED, MADE_UP], ids=["bare", "made-up-proof"])
def test_a_client_sending_the_forwarded_marker_cannot_bypass_a_keys_dedup(
    cluster: Cluster, marker: tuple[tuple[str, str], ...]
) -> None:
    n1 = cluster.nodes[0]
    name = f"deduped-{len(marker)}"
    n1.stubs.create(name, requested_partitions=3)
    (placement,) = [q for q in n1.info().queues if q.queue_name == name]
    assert len(set(placement.homes)) == 3
    for attempt in range(50):  # a key whose home is not the node it is sent to (2 in 3 are)
        key = f"order-{attempt}"
        item = queue_pb2.ProduceItem(payload=b"once", idempotency_key=key)
        first = n1.stubs.queue.Produce(queue_pb2.ProduceRequest(queue_name=name, items=[item]), timeout=10)
        if placement.homes[first.partition] != "n1":
            break
    else:
        pytest.fail("every key's home was n1")
    again = n1.stubs.queue.Produce(queue_pb2.ProduceRequest(queue_name=name, items=[item]), timeout=10, metadata=marker)
    assert (again.partition, list(again.ids), again.duplicates) == (first.partition, list(first.ids), 1)
    held = [m for m in _payloads_by_node(cluster, name) if m == b"once"]
    assert len(held) == 1


def _payloads_by_node(cluster: Cluster, name: str) -> list[bytes]:
    """Every item of the queue, read partition by partition from any node."""
    n1 = cluster.nodes[0]
    out: list[bytes] = []
    for partition in range(len(n1.stubs.stats(name).partitions)):
        out.extend(i.payload for i in n1.stubs.list_items(name, partition))
    return out


def _rss_kib(node: Node, field: str) -> int:
    """The node process's resident memory (VmRSS) or its peak so far (VmHWM), in KiB."""
    assert node.proc is not None
    with open(f"/proc/{node.proc.pid}/status") as status:
        (line,) = [line for line in status if line.startswith(f"{field}:")]
    return int(line.split()[1])


def test_calls_forwarded_to_a_paused_home_are_bounded_in_memory_and_in_time(cluster: Cluster) -> None:
    cluster.nodes[0].stubs.create("paused-home", requested_partitions=1)
    home, other = _home_and_other(cluster, "paused-home")
    # 40 Completes of 4.9 MB each (980 ids of 5,000 bytes: refused by the home, which
    # never gets to look), sent without a deadline through the node that is not the home.
    big = queue_pb2.CompleteRequest(queue_name="paused-home", partition=0, ids=[f"{n:05d}".ljust(5000, "x") for n in range(980)])
    assert 4_800_000 < big.ByteSize() < 5_000_000
    options = [("grpc.max_send_message_length", 16 * MIB)]
    other.stubs.stats("paused-home")  # the other node's connection to the home is up
    before = _rss_kib(other, "VmRSS")
    with grpc.insecure_channel(other.address, options=options) as channel:
        stub = queue_pb2_grpc.QueueServiceStub(channel)
        home.signal(signal.SIGSTOP)
        try:
            calls = [stub.Complete.future(big) for _ in range(40)]
            ended = time.monotonic() + 60
            for call in calls:  # bounded: each call ends on its own, whatever the caller's deadline
                call.exception(timeout=max(0.1, ended - time.monotonic()))
            peak = _rss_kib(other, "VmHWM")
        finally:
            home.signal(signal.SIGCONT)
        assert all(call.done() for call in calls), "calls to the paused home still waiting after a minute"
        codes = Counter(call.code() for call in calls)
    wait_until(lambda: home.node_id in cluster.live(other), timeout=30)  # back, for the next tests
    grown_mib = (peak - before) / 1024
    print(f"the forwarding node: {before / 1024:.0f} MiB before, peak {peak / 1024:.0f} MiB; outcomes {dict(codes)}")
    # The calls let through hold their request while the home is paused; the others
    # are refused at once, before any copy of their 4.9 MB is made for the home.
    assert grown_mib < 500, f"{grown_mib:.0f} MiB more for 40 calls of 4.9 MB"
    refused = [call for call in calls if call.code() == grpc.StatusCode.UNAVAILABLE and "unanswered" in (call.details() or "")]
    assert refused and all(home.node_id in (call.details() or "") for call in refused)
    # The calls let through end when the keepalive drops the connection to the paused
    # home (about 15 s). Without it they were still waiting after 80 s, their 30 s
    # deadline notwithstanding: their requests sat in a full TCP send buffer.
    assert set(codes) == {grpc.StatusCode.UNAVAILABLE}


@pytest.mark.parametrize("via", ["another-node", "the-home"])
def test_a_lease_stream_in_a_cluster_gives_back_what_it_never_sent(cluster: Cluster, via: str) -> None:
    name = f"unread-{via}"
    cluster.nodes[0].stubs.create(name, requested_partitions=1, lease_timeout=dur(300))
    home, other = _home_and_other(cluster, name)
    if via == "the-home":  # its answers' partition is in cluster numbers all the same
        other = home
    for start in range(0, 3000, 400):
        home.stubs.produce(name, [f"{n:05d}".encode().ljust(10_000, b".") for n in range(start, min(start + 400, 3000))])

    def leased() -> int:
        return home.stubs.stats(name).partitions[0].total_leased

    # Leases of 100 items (1 MB answers) from a client that reads nothing: the answers
    # wait on the stream's node until the stream ends.
    # The stream has a connection of its own: the answers it never read are not left
    # in the way of the test's other calls.
    message = queue_pb2.LeaseStreamRequest(request=queue_pb2.LeaseRequest(queue_name=name, batch_size=100))
    with grpc.insecure_channel(other.address, options=[("grpc.use_local_subchannel_pool", 1)]) as channel:
        call = queue_pb2_grpc.QueueServiceStub(channel).LeaseStream(iter([message] * 30), timeout=60)  # type: ignore[misc]
        last, steady_since = -1, time.monotonic()
        deadline = time.monotonic() + 30
        while time.monotonic() - steady_since < 1.0:
            assert time.monotonic() < deadline, "leasing never stopped"
            if (now := leased()) != last:
                last, steady_since = now, time.monotonic()
            time.sleep(0.05)
        assert last >= 1000
        call.cancel()
    # What was never sent goes back to ready at once (the lease runs for 300 s), with
    # the attempt its lease took; what the transport took (a few answers) stays leased.
    wait_until(lambda: leased() <= last // 2, timeout=30)
    stats = home.stubs.stats(name).partitions[0]
    assert stats.total == 3000
    ready = [i for i in home.stubs.list_items(name) if not i.is_leased]  # the first page's
    assert ready and all(i.attempts == 0 for i in ready)
    again = other.stubs.lease(name, batch_size=1000, request_timeout=dur(0))
    assert again.items and {i.attempts for i in again.items} == {1}


def test_the_nodes_own_give_back_call_refuses_a_client(cluster: Cluster) -> None:
    cluster.nodes[0].stubs.create("held", requested_partitions=1, lease_timeout=dur(300))
    home, _ = _home_and_other(cluster, "held")
    home.stubs.produce("held", [b"mine"])
    lease = home.stubs.lease("held", batch_size=1, request_timeout=dur(5))
    item = lease.items[0]
    answer = queue_pb2.LeaseResponse(queue_name="held", partition=lease.partition)
    answer.columns.ids.append(item.id)
    answer.columns.lease_deadlines_us.append(item.lease_deadline.ToMicroseconds())
    assert home.channel is not None
    for marker in ((), FORGED, MADE_UP):
        give_back = home.channel.unary_unary(
            "/querator.internal.Peer/GiveBackUnsent",
            request_serializer=queue_pb2.LeaseResponse.SerializeToString,
            response_deserializer=lambda data: data,
        )
        with pytest.raises(grpc.RpcError) as refused:
            give_back(answer, timeout=10, metadata=marker)
        assert refused.value.code() == grpc.StatusCode.PERMISSION_DENIED
    assert home.stubs.stats("held").partitions[0].total_leased == 1


def test_a_call_forwarded_without_a_deadline_to_a_stuck_home_ends(tmp_path: pathlib.Path) -> None:
    # A home whose storage stalls (a slow disk: the test's fault file) but which is
    # alive: keepalive does not end the call, only the forwarded call's own bound does.
    with Cluster(str(tmp_path), size=0) as c:
        faults = {f"n{i}": str(tmp_path / f"fault-n{i}") for i in (1, 2)}
        for node_id, fault in faults.items():
            node = Node(node_id, str(tmp_path / node_id), c.url, c.ttl, env={"QUERATOR_FAULT_FILE": fault})
            c.nodes.append(node)
            node.start()
        n1 = c.nodes[0]
        wait_until(lambda: c.live(n1) == {"n1", "n2"}, timeout=20)
        n1.stubs.create("stuck", requested_partitions=1)
        home, other = _home_and_other(c, "stuck")
        home.stubs.produce("stuck", [b"held"])
        lease = home.stubs.lease("stuck", batch_size=1, request_timeout=dur(5))
        with open(faults[home.node_id], "w") as f:
            f.write("stall\n")
        try:
            complete = queue_pb2.CompleteRequest(queue_name="stuck", partition=lease.partition, ids=[lease.items[0].id])
            call = other.stubs.queue.Complete.future(complete)  # no deadline
            try:
                call.exception(timeout=90)  # the stall itself gives up after 120 s
            finally:
                call.cancel()
        finally:
            os.remove(faults[home.node_id])
        assert call.code() == grpc.StatusCode.DEADLINE_EXCEEDED, call.details()
