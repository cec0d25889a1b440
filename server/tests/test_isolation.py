"""One failing request fails alone: never the other requests of its cycle.

A call carrying ``querator-fault: apply`` (with ``QUERATOR_REQUEST_FAULTS=1``, faults.py)
raises in the step that applies its request, after that step's writes. Each test holds
the queue's commits (the ``stall`` write fault) while the failing request and twenty
Produce calls (and, where there is one, a healthy twin of the failing request) pile up in
the queue's inbox, so that all of them are applied by one cycle once the stall ends. The
failing request must answer INTERNAL with nothing of it stored; every other request must
succeed as if the failing one had never been sent.
"""

from __future__ import annotations

import os
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import grpc
import pytest

from querator.v1 import queue_pb2, queues_pb2, storage_pb2
from querator_server.faults import APPLY, FAULT_FILE_ENV, REQUEST_FAULT_METADATA, REQUEST_FAULTS_ENV

from conftest import Stubs, ThreadServer, dur, secs, wait_until

FAULT = ((REQUEST_FAULT_METADATA, APPLY),)
GOOD_PRODUCES = 20


@dataclass
class Env:
    server: ThreadServer
    stubs: Stubs
    stall: Path
    leased_a: list[str] = field(default_factory=list)  # leased before the cycle
    leased_b: list[str] = field(default_factory=list)


@pytest.fixture
def env(tmp_path: Path, monkeypatch: pytest.MonkeyPatch, request: pytest.FixtureRequest) -> Iterator[Env]:
    """A server whose queues share commit groups (the default), or with ``False`` as the
    fixture's parameter, queues with environments of their own."""
    stall = tmp_path / "fault"
    monkeypatch.setenv(REQUEST_FAULTS_ENV, "1")
    monkeypatch.setenv(FAULT_FILE_ENV, str(stall))
    server = ThreadServer(str(tmp_path / "data"), commit_groups=getattr(request, "param", True))
    stubs = Stubs(grpc.insecure_channel(server.address))
    try:
        stubs.create("q", lease_timeout=dur(60))
        stubs.produce("q", [b"pre-%d" % i for i in range(10)])
        leased = [i.id for i in stubs.lease("q", batch_size=6).items]
        yield Env(server, stubs, stall, leased[:3], leased[3:])
    finally:
        stall.unlink(missing_ok=True)
        stubs.channel.close()
        server.stop()


def _items(stubs: Stubs) -> list[storage_pb2.StorageItem]:
    return stubs.list_items("q")


def _payloads(stubs: Stubs) -> list[bytes]:
    return [i.payload for i in _items(stubs)]


def _leased(stubs: Stubs) -> dict[str, storage_pb2.StorageItem]:
    return {i.id: i for i in _items(stubs) if i.is_leased}


@dataclass
class Case:
    # (faulty call, healthy twin or None); each takes the stubs and metadata
    send: Callable[[Env, Any], grpc.Future]
    twin: bool
    # checks after the cycle: the failing request left nothing, the twin did its part
    check: Callable[[Env, dict[str, Any]], None]
    in_inbox: bool = True  # GetQueueStats is answered from memory, not in a cycle


def _produce(e: Env, md: Any) -> grpc.Future:
    tag = b"faulty" if md else b"twin"
    req = queue_pb2.ProduceRequest(queue_name="q", items=[queue_pb2.ProduceItem(payload=tag, kind="k")])
    return e.stubs.queue.Produce.future(req, metadata=md, timeout=30)


def _check_produce(e: Env, before: dict[str, Any]) -> None:
    got = _payloads(e.stubs)
    assert b"faulty" not in got and b"twin" in got


def _lease(e: Env, md: Any) -> grpc.Future:
    req = queue_pb2.LeaseRequest(queue_name="q", batch_size=3, request_timeout=dur(0.2))
    return e.stubs.queue.Lease.future(req, metadata=md, timeout=30)


def _check_lease(e: Env, before: dict[str, Any]) -> None:
    leased = _leased(e.stubs)
    twin = before["twin_result"]
    # Only the twin's three items were leased in the cycle, on top of the six before.
    ids = [i.id for i in twin.items]
    assert len(ids) == 3 and set(ids) <= set(leased)
    assert len(leased) == 6 + 3


def _lease_completing(e: Env, md: Any) -> grpc.Future:
    ids = e.leased_a if md else e.leased_b
    req = queue_pb2.LeaseRequest(queue_name="q", batch_size=1, complete_ids=ids, request_timeout=dur(0.2))
    return e.stubs.queue.Lease.future(req, metadata=md, timeout=30)


def _check_lease_completing(e: Env, before: dict[str, Any]) -> None:
    leased = _leased(e.stubs)
    assert set(e.leased_a) <= set(leased), "the failing Lease's complete_ids were applied"
    assert not set(e.leased_b) & set(leased)


def _complete(e: Env, md: Any) -> grpc.Future:
    ids = e.leased_a if md else e.leased_b
    return e.stubs.queue.Complete.future(queue_pb2.CompleteRequest(queue_name="q", ids=ids), metadata=md, timeout=30)


def _retry(e: Env, md: Any) -> grpc.Future:
    ids = e.leased_a if md else e.leased_b
    items = [queue_pb2.RetryItem(id=i) for i in ids]
    return e.stubs.queue.Retry.future(queue_pb2.RetryRequest(queue_name="q", items=items), metadata=md, timeout=30)


def _check_acked(e: Env, before: dict[str, Any]) -> None:
    leased = _leased(e.stubs)
    assert set(e.leased_a) <= set(leased), "the failing request changed its items"
    assert not set(e.leased_b) & set(leased)


def _extend(e: Env, md: Any) -> grpc.Future:
    ids = e.leased_a if md else e.leased_b
    req = queue_pb2.ExtendRequest(queue_name="q", ids=ids, lease_timeout=dur(3600))
    return e.stubs.queue.Extend.future(req, metadata=md, timeout=30)


def _check_extend(e: Env, before: dict[str, Any]) -> None:
    leased = _leased(e.stubs)
    for item_id in e.leased_a:
        assert leased[item_id].lease_deadline == before["deadlines"][item_id]
    for item_id in e.leased_b:
        assert secs(leased[item_id].lease_deadline) > time.time() + 3000


def _list(scheduled: bool) -> Callable[[Env, Any], grpc.Future]:
    def send(e: Env, md: Any) -> grpc.Future:
        if scheduled:
            req = storage_pb2.ListScheduledItemsRequest(queue_name="q")
            return e.stubs.storage.ListScheduledItems.future(req, metadata=md, timeout=30)
        return e.stubs.storage.ListItems.future(storage_pb2.ListItemsRequest(queue_name="q"), metadata=md, timeout=30)

    return send


def _check_listed(e: Env, before: dict[str, Any]) -> None:
    assert before["twin_result"] is not None


def _import(e: Env, md: Any) -> grpc.Future:
    tag = b"faulty" if md else b"twin"
    req = storage_pb2.ImportItemsRequest(queue_name="q", items=[storage_pb2.StorageItem(payload=tag, source_id=tag.decode())])
    return e.stubs.storage.ImportItems.future(req, metadata=md, timeout=30)


def _delete(e: Env, md: Any) -> grpc.Future:
    ids = e.leased_a if md else e.leased_b
    return e.stubs.storage.DeleteItems.future(storage_pb2.DeleteItemsRequest(queue_name="q", ids=ids), metadata=md, timeout=30)


def _clear(e: Env, md: Any) -> grpc.Future:
    return e.stubs.queues.ClearQueue.future(
        queues_pb2.ClearQueueRequest(queue_name="q", queue=True, destructive=True), metadata=md, timeout=30
    )


def _check_clear(e: Env, before: dict[str, Any]) -> None:
    assert len(_items(e.stubs)) == 10 + GOOD_PRODUCES, "the failing ClearQueue removed items"


def _stats(e: Env, md: Any) -> grpc.Future:
    return e.stubs.queues.GetQueueStats.future(queues_pb2.GetQueueStatsRequest(queue_name="q"), metadata=md, timeout=30)


def _check_stats(e: Env, before: dict[str, Any]) -> None:
    assert sum(p.total for p in before["twin_result"].partitions) >= 10


CASES = {
    "produce": Case(_produce, True, _check_produce),
    "lease": Case(_lease, True, _check_lease),
    "lease-with-complete_ids": Case(_lease_completing, True, _check_lease_completing),
    "complete": Case(_complete, True, _check_acked),
    "retry": Case(_retry, True, _check_acked),
    "extend": Case(_extend, True, _check_extend),
    "list-items": Case(_list(False), True, _check_listed),
    "list-scheduled-items": Case(_list(True), True, _check_listed),
    "import-items": Case(_import, True, _check_produce),
    "delete-items": Case(_delete, True, _check_acked),
    "clear-queue": Case(_clear, False, _check_clear),
    "get-queue-stats": Case(_stats, True, _check_stats, in_inbox=False),
}


@pytest.mark.parametrize("env", [True, False], indirect=True, ids=["commit-group", "own-environment"])
@pytest.mark.parametrize("kind", sorted(CASES))
def test_a_request_that_fails_while_applied_fails_alone(env: Env, kind: str) -> None:
    case = CASES[kind]
    stubs = env.stubs
    actor = env.server.server.manager.actor("q")
    before: dict[str, Any] = {"deadlines": {i.id: i.lease_deadline for i in _items(stubs) if i.is_leased}}
    # Hold the queue's commits: one Produce's cycle waits on its commit, and everything
    # sent meanwhile waits in the queue's inbox for the next cycle.
    env.stall.write_text("stall")
    first = stubs.queue.Produce.future(
        queue_pb2.ProduceRequest(queue_name="q", items=[queue_pb2.ProduceItem(payload=b"first")]), timeout=30
    )
    wait_until(lambda: stubs.stats("q").in_flight == 1, timeout=20)
    faulty = case.send(env, FAULT)
    twin = case.send(env, None) if case.twin else None
    produces = [
        stubs.queue.Produce.future(
            queue_pb2.ProduceRequest(queue_name="q", items=[queue_pb2.ProduceItem(payload=b"good-%d" % i)]), timeout=30
        )
        for i in range(GOOD_PRODUCES - 1)
    ]
    expected = len(produces) + (1 if twin is not None else 0) + (1 if case.in_inbox else 0)
    if kind == "get-queue-stats":
        expected -= 1  # the twin too is answered from memory
    wait_until(lambda: actor.waiting_requests() == expected, timeout=20)
    env.stall.unlink()

    with pytest.raises(grpc.RpcError) as failed:
        faulty.result(timeout=30)
    assert failed.value.code() == grpc.StatusCode.INTERNAL, failed.value.details()
    assert "it was not applied" in (failed.value.details() or "") or kind == "get-queue-stats"
    first.result(timeout=30)
    for call in produces:
        call.result(timeout=30)
    before["twin_result"] = twin.result(timeout=30) if twin is not None else None
    case.check(env, before)
    got = _payloads(stubs)
    assert all(b"good-%d" % i in got for i in range(GOOD_PRODUCES - 1))
    # The queue goes on serving normally.
    stubs.produce("q", [b"after"])
    assert b"after" in _payloads(stubs)


def test_a_failing_lifecycle_step_fails_alone_and_is_tried_again(env: Env) -> None:
    """The lifecycle step (here: leases running out) fails half-way: it is rolled back,
    the requests of its cycles are applied, and it runs again once it can."""
    stubs = env.stubs
    stubs.create("short", lease_timeout=dur(0.5))
    stubs.produce("short", [b"a", b"b"])
    leased = [i.id for i in stubs.lease("short", batch_size=1).items]
    group = os.path.join("groups", "0")
    env.stall.write_text(f"lifecycle-error {group}")
    time.sleep(1.5)  # the lease ran out a second ago; its re-queue keeps failing
    # Requests in a cycle with the failing lifecycle step: hold the commits while they
    # pile up, past the second the lifecycle waits after a failure, then let them go.
    actor = env.server.server.manager.actor("short")
    env.stall.write_text(f"lifecycle-error {group}\nstall {group}")
    calls = [
        stubs.queue.Produce.future(
            queue_pb2.ProduceRequest(queue_name="short", items=[queue_pb2.ProduceItem(payload=b"d%d" % i)]), timeout=30
        )
        for i in range(6)
    ]
    wait_until(lambda: actor.waiting_requests() >= 5 and actor.waiting_requests() + stubs.stats("short").in_flight == 6)
    time.sleep(1.2)
    env.stall.write_text(f"lifecycle-error {group}")
    for call in calls:
        call.result(timeout=30)
    listed = {i.id: i for i in stubs.list_items("short")}
    assert leased[0] in listed and listed[leased[0]].is_leased, "a failed lifecycle step left changes"
    assert sorted(i.payload for i in listed.values()) == [b"a", b"b"] + [b"d%d" % i for i in range(6)]
    env.stall.unlink()
    # Tried again about a second later: the item goes back to the queue under a new id.
    wait_until(lambda: leased[0] not in {i.id for i in stubs.list_items("short")}, timeout=20)
    assert sorted(i.payload for i in stubs.list_items("short") if not i.is_leased) == sorted(
        [b"a", b"b"] + [b"d%d" % i for i in range(6)]
    )
