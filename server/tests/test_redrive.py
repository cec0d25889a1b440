"""RedriveItems: dead letters back to their source queues (or to a named queue) in one
call, each exactly once, also when the server is killed -9 in the middle of the move.

Real servers over real gRPC on real LMDB; the crash tests run ``querator serve`` as a
child process that kills itself at the named crash point (faults.py).
"""

from __future__ import annotations

import json
from collections import Counter
from collections.abc import Iterator
from pathlib import Path

import grpc
import lmdb
import pytest

from querator.v1 import queue_pb2, queues_pb2, storage_pb2
from querator_server.faults import APPLY, FAULT_FILE_ENV, REQUEST_FAULT_METADATA, REQUEST_FAULTS_ENV

from conftest import ProcessServer, Stubs, ThreadServer, bad_request_fields, dur, wait_until

EVENTUALLY = 20.0


def create(stubs: Stubs, name: str, **settings: object) -> None:
    stubs.create(name, lease_timeout=dur(60), expire_timeout=dur(3600), **settings)


def items_of(stubs: Stubs, name: str) -> list[storage_pb2.StorageItem]:
    """Ready and leased items of every partition."""
    info = stubs.queues.GetQueue(queues_pb2.GetQueueRequest(queue_name=name), timeout=10).queue
    return [item for p in range(info.requested_partitions) for item in stubs.list_items(name, p)]


def kill_all(stubs: Stubs, name: str, payloads: list[bytes], *, kind: str = "") -> dict[bytes, str]:
    """Produce ``payloads`` into ``name`` and give each up as dead; their ids by payload."""
    items = [queue_pb2.ProduceItem(payload=p, kind=kind) for p in payloads]
    stubs.queue.Produce(queue_pb2.ProduceRequest(queue_name=name, items=items), timeout=10)
    ids: dict[bytes, str] = {}
    while len(ids) < len(payloads):
        leased = stubs.lease(name, batch_size=100, request_timeout=dur(0.5))
        retry = [queue_pb2.RetryItem(id=i.id, dead=True) for i in leased.items]
        stubs.queue.Retry(queue_pb2.RetryRequest(queue_name=name, partition=leased.partition, items=retry), timeout=10)
        ids.update({i.payload: i.message_id for i in leased.items})
    return ids


def redrive(stubs: Stubs, name: str, **kw: object) -> storage_pb2.RedriveItemsResponse:
    request = storage_pb2.RedriveItemsRequest(queue_name=name, **kw)  # type: ignore[arg-type]
    return stubs.storage.RedriveItems(request, timeout=30)


def test_dead_letters_go_back_to_the_queue_each_died_in(stubs: Stubs) -> None:
    create(stubs, "dlq", requested_partitions=2)
    create(stubs, "a", dead_queue="dlq")
    create(stubs, "b", dead_queue="dlq", requested_partitions=3)
    from_a = kill_all(stubs, "a", [b"a1", b"a2"])
    from_b = kill_all(stubs, "b", [b"b1", b"b2", b"b3"])
    wait_until(lambda: len(items_of(stubs, "dlq")) == 5, timeout=EVENTUALLY)
    held = stubs.lease("dlq", batch_size=1, request_timeout=dur(0.5)).items[0]  # leased: it stays
    stubs.produce("dlq", [b"produced here"])  # no source queue: it stays, counted as skipped
    dead = {i.payload: i for i in items_of(stubs, "dlq")}

    answer = redrive(stubs, "dlq")
    assert (answer.moved, answer.skipped, answer.next_page_token) == (4, 1, "")
    left = {i.payload for i in items_of(stubs, "dlq")}
    assert left == {b"produced here", held.payload}
    for name, ids in (("a", from_a), ("b", from_b)):
        back = {i.payload: i for i in items_of(stubs, name)}
        want = {p for p in ids if p != held.payload}
        assert set(back) == want, name
        for payload in want:
            item = back[payload]
            assert item.message_id == ids[payload], "the message id survives the round trip"
            assert item.source_id == dead[payload].id, "its id in the dead-letter queue"
            assert (item.attempts, item.dead_reason, item.is_leased) == (0, queue_pb2.DEAD_REASON_UNSPECIFIED, False)
            assert item.HasField("expire_deadline")
    assert sorted(answer.message_ids) == sorted(ids for ids in {**from_a, **from_b}.values() if ids != held.message_id)
    leased = stubs.lease("b", batch_size=10, request_timeout=dur(0.5))
    assert {i.message_id for i in leased.items} <= set(from_b.values()) and all(i.attempts == 1 for i in leased.items)


def test_filters_a_named_target_max_items_and_page_tokens(stubs: Stubs) -> None:
    create(stubs, "dlq")
    create(stubs, "src", dead_queue="dlq", max_attempts=1)
    create(stubs, "other")
    kill_all(stubs, "src", [b"x1", b"x2", b"x3"], kind="x")
    kill_all(stubs, "src", [b"y1"], kind="y")
    wait_until(lambda: len(items_of(stubs, "dlq")) == 4, timeout=EVENTUALLY)

    # The reason filter: none of them ran out of attempts.
    assert redrive(stubs, "dlq", dead_reason=queue_pb2.DEAD_REASON_MAX_ATTEMPTS).moved == 0
    first = redrive(stubs, "dlq", target_queue="other", kind="x", max_items=2, dead_reason=queue_pb2.DEAD_REASON_RETRY_DEAD)
    assert first.moved == 2 and first.next_page_token
    second = redrive(stubs, "dlq", target_queue="other", kind="x", max_items=2, page_token=first.next_page_token)
    assert second.moved == 1 and second.next_page_token == ""
    assert sorted(i.payload for i in items_of(stubs, "other")) == [b"x1", b"x2", b"x3"]
    assert [i.payload for i in items_of(stubs, "dlq")] == [b"y1"]
    assert items_of(stubs, "src") == []


def test_bad_redrives_answer_invalid_argument_or_not_found(stubs: Stubs) -> None:
    create(stubs, "dlq")
    bad: list[tuple[dict[str, object], str]] = [
        ({"queue_name": "dlq", "target_queue": "dlq"}, "target_queue"),
        ({"queue_name": "dlq", "max_items": 1001}, "max_items"),
        ({"queue_name": "dlq", "max_items": -1}, "max_items"),
        ({"queue_name": "dlq", "dead_reason": 42}, "dead_reason"),
        ({"queue_name": "dlq", "page_token": "forged"}, "page_token"),
        ({"queue_name": "dlq", "kind": "k" * 513}, "kind"),
        ({"queue_name": "dlq", "target_queue": "has space"}, "target_queue"),
    ]
    for fields, field in bad:
        with pytest.raises(grpc.RpcError) as caught:
            stubs.storage.RedriveItems(storage_pb2.RedriveItemsRequest(**fields), timeout=10)  # type: ignore[arg-type]
        assert caught.value.code() == grpc.StatusCode.INVALID_ARGUMENT, field
        assert bad_request_fields(caught.value) == [field]
    for fields in ({"queue_name": "nope"}, {"queue_name": "dlq", "target_queue": "nope"}):
        with pytest.raises(grpc.RpcError) as caught:
            stubs.storage.RedriveItems(storage_pb2.RedriveItemsRequest(**fields), timeout=10)  # type: ignore[arg-type]
        assert caught.value.code() == grpc.StatusCode.NOT_FOUND


# -- kill -9 in the middle of a redrive ------------------------------------------------


@pytest.fixture
def proc(data_dir: str) -> Iterator[ProcessServer]:
    srv = ProcessServer(data_dir)
    yield srv
    srv.stop()


@pytest.mark.parametrize("crash_at", ["redrive-taken", "redrive-stored"])
def test_kill9_in_the_middle_of_a_redrive_leaves_every_item_in_exactly_one_queue(
    proc: ProcessServer, monkeypatch: pytest.MonkeyPatch, crash_at: str
) -> None:
    """Killed after the dead-letter queue committed the move out (the items are in no
    queue a reader sees), or after the source stored them (they are in both
    environments' files): after the restart each item is in the source exactly once.
    The source has 40 partitions, so its storage is a directory of its own while the
    dead-letter queue's is in a commit group: no transaction spans the two."""
    proc.start()
    stubs = Stubs(grpc.insecure_channel(proc.address))
    try:
        create(stubs, "dlq", requested_partitions=2)
        create(stubs, "src", dead_queue="dlq", requested_partitions=40)
        sent = kill_all(stubs, "src", [b"p%d" % i for i in range(30)])
        wait_until(lambda: len(items_of(stubs, "dlq")) == 30, timeout=EVENTUALLY)
    finally:
        stubs.channel.close()
    proc.terminate()

    monkeypatch.setenv("QUERATOR_CRASH_AT", crash_at)
    proc.start()
    stubs = Stubs(grpc.insecure_channel(proc.address))
    try:
        with pytest.raises(grpc.RpcError) as caught:
            redrive(stubs, "dlq")
        assert caught.value.code() == grpc.StatusCode.UNAVAILABLE
    finally:
        stubs.channel.close()
    wait_until(lambda: proc.proc is not None and proc.proc.poll() is not None, timeout=EVENTUALLY)
    assert proc.proc is not None and proc.proc.returncode == -9, "the crash point did not fire"

    monkeypatch.delenv("QUERATOR_CRASH_AT")
    proc.start()
    stubs = Stubs(grpc.insecure_channel(proc.address))
    try:
        # The hand-over finished during start-up, before the server took calls.
        back = items_of(stubs, "src")
        assert items_of(stubs, "dlq") == []
        counts = Counter(i.message_id for i in back)
        assert counts == Counter(sent.values()), "an item was lost or duplicated"
        assert {i.payload: i.message_id for i in back} == sent
        # Nothing is left in transit: a second redrive finds nothing, a restart adds nothing.
        assert redrive(stubs, "dlq").moved == 0
    finally:
        stubs.channel.close()
    proc.terminate()
    proc.start()
    stubs = Stubs(grpc.insecure_channel(proc.address))
    try:
        assert Counter(i.message_id for i in items_of(stubs, "src")) == Counter(sent.values())
        assert items_of(stubs, "dlq") == []
    finally:
        stubs.channel.close()


def _forget_queue(data_dir: str, name: str) -> None:
    """Remove a queue from the catalog of a stopped server, as a deletion that a crash
    interrupted leaves it (start-up then drops its storage)."""
    env = lmdb.open(str(Path(data_dir) / "catalog"), max_dbs=4)
    with env.begin(write=True) as txn:
        queues = env.open_db(b"queues", txn=txn)
        keys = [key for key, raw in txn.cursor(db=queues) if json.loads(raw)["name"] == name]
        assert len(keys) == 1 and txn.delete(keys[0], db=queues)
    env.close()


def test_items_in_transit_to_a_queue_that_is_gone_come_back_to_the_dead_letter_queue(
    proc: ProcessServer, monkeypatch: pytest.MonkeyPatch, data_dir: str
) -> None:
    proc.start()
    stubs = Stubs(grpc.insecure_channel(proc.address))
    try:
        create(stubs, "dlq")
        create(stubs, "src", dead_queue="dlq")
        create(stubs, "tmp", requested_partitions=40)
        sent = kill_all(stubs, "src", [b"p%d" % i for i in range(5)])
        wait_until(lambda: len(items_of(stubs, "dlq")) == 5, timeout=EVENTUALLY)
        before = {i.message_id: i for i in items_of(stubs, "dlq")}
    finally:
        stubs.channel.close()
    proc.terminate()

    monkeypatch.setenv("QUERATOR_CRASH_AT", "redrive-taken")
    proc.start()
    stubs = Stubs(grpc.insecure_channel(proc.address))
    try:
        with pytest.raises(grpc.RpcError):
            redrive(stubs, "dlq", target_queue="tmp")
    finally:
        stubs.channel.close()
    wait_until(lambda: proc.proc is not None and proc.proc.poll() is not None, timeout=EVENTUALLY)
    assert proc.proc is not None and proc.proc.returncode == -9, "the crash point did not fire"
    _forget_queue(data_dir, "tmp")

    monkeypatch.delenv("QUERATOR_CRASH_AT")
    proc.start()
    stubs = Stubs(grpc.insecure_channel(proc.address))
    try:
        back = items_of(stubs, "dlq")
        assert Counter(i.message_id for i in back) == Counter(sent.values()), "an item was lost or duplicated"
        for item in back:  # back as dead letters, their history intact
            was = before[item.message_id]
            assert (item.payload, item.source_id, item.dead_reason, item.dead_attempts) == (
                was.payload,
                was.source_id,
                was.dead_reason,
                was.dead_attempts,
            )
        assert items_of(stubs, "src") == []
    finally:
        stubs.channel.close()


def test_a_redrive_that_fails_while_applied_moves_nothing_and_fails_alone(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A RedriveItems that raises in its step (``querator-fault: apply``) in the same
    cycle as a healthy one: it answers INTERNAL and moves nothing; the other moves its
    items (test_isolation.py holds the commits the same way)."""
    stall = tmp_path / "fault"
    monkeypatch.setenv(REQUEST_FAULTS_ENV, "1")
    monkeypatch.setenv(FAULT_FILE_ENV, str(stall))
    server = ThreadServer(str(tmp_path / "data"))
    stubs = Stubs(grpc.insecure_channel(server.address))
    try:
        create(stubs, "dlq")
        create(stubs, "src", dead_queue="dlq")
        sent = kill_all(stubs, "src", [b"a", b"b", b"c", b"d"])
        wait_until(lambda: len(items_of(stubs, "dlq")) == 4, timeout=EVENTUALLY)
        actor = server.server.manager.actor("dlq")

        stall.write_text("stall")  # hold the commits: what follows waits for one cycle
        first = stubs.queue.Produce.future(
            queue_pb2.ProduceRequest(queue_name="dlq", items=[queue_pb2.ProduceItem(payload=b"first")]), timeout=30
        )
        wait_until(lambda: stubs.stats("dlq").in_flight == 1, timeout=20)
        request = storage_pb2.RedriveItemsRequest(queue_name="dlq", max_items=2)
        faulty = stubs.storage.RedriveItems.future(request, metadata=((REQUEST_FAULT_METADATA, APPLY),), timeout=30)
        twin = stubs.storage.RedriveItems.future(request, timeout=30)
        wait_until(lambda: actor.waiting_requests() == 2, timeout=20)
        stall.unlink()

        with pytest.raises(grpc.RpcError) as failed:
            faulty.result(timeout=30)
        assert failed.value.code() == grpc.StatusCode.INTERNAL
        first.result(timeout=30)
        assert twin.result(timeout=30).moved == 2
        back = items_of(stubs, "src")
        left = [i for i in items_of(stubs, "dlq") if i.payload != b"first"]
        assert len(back) == 2 and len(left) == 2
        assert Counter(i.message_id for i in back + left) == Counter(sent.values())
    finally:
        stall.unlink(missing_ok=True)
        stubs.channel.close()
        server.stop()
