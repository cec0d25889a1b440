"""Fuzzing every RPC: whatever a caller sends, the answer is a documented status and the
server stays healthy.

hypothesis builds requests for each RPC of QueueService, QueuesService, StorageService
and KeysService with random field values: unicode and huge strings, ids that look like
ours but are not, out-of-range numbers, durations and timestamps, repeated fields too
long; and it sends random bytes as raw request messages. Every answer must be one of
the codes API.md documents, never UNKNOWN or INTERNAL, and always with a message. The
server here is healthy and gets one call at a time, so UNAVAILABLE (storage failing or
a request that broke its cycle) and RESOURCE_EXHAUSTED (overload; these requests stay
far below the 5 MB limit) are failures too. After each RPC's run the server still
answers health checks SERVING and still produces, leases and completes.

Examples are derandomized (the same every run) and bounded: the file takes seconds.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import grpc
import pytest
from google.protobuf import duration_pb2, field_mask_pb2, timestamp_pb2
from grpc_health.v1 import health_pb2, health_pb2_grpc
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from querator.v1 import cluster_pb2, cluster_pb2_grpc, keys_pb2, keys_pb2_grpc, queue_pb2, queues_pb2, storage_pb2

from conftest import Stubs, ThreadServer

C = grpc.StatusCode
DOCUMENTED = {
    C.OK,
    C.INVALID_ARGUMENT,
    C.NOT_FOUND,
    C.ALREADY_EXISTS,
    C.FAILED_PRECONDITION,
    C.RESOURCE_EXHAUSTED,
    C.UNAVAILABLE,
    C.DEADLINE_EXCEEDED,
}
# A healthy server answering one call at a time has no reason for these.
NOT_HERE = {C.UNAVAILABLE, C.RESOURCE_EXHAUSTED}
LEASE_CALL_TIMEOUT = 0.2  # an empty queue makes a Lease wait; keep that short
FUZZ = settings(
    max_examples=40,
    deadline=None,
    derandomize=True,
    database=None,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large, HealthCheck.large_base_example],
)
RAW = settings(FUZZ, max_examples=25)

QUEUES = ("fz", "fz-dlq", "fz-one")
INT32 = (-(2**31), 2**31 - 1)
INT64 = (-(2**63), 2**63 - 1)


# -- the server ----------------------------------------------------------------------------


class Fixture:
    def __init__(self, server: ThreadServer) -> None:
        self.server = server
        self.stubs = Stubs(grpc.insecure_channel(server.address))
        self.keys = keys_pb2_grpc.KeysServiceStub(self.stubs.channel)
        self.cluster = cluster_pb2_grpc.ClusterServiceStub(self.stubs.channel)
        self.ids: list[str] = []

    def ensure_queues(self) -> None:
        """Put back the queues (and a few items) fuzzed calls may have deleted or emptied."""
        existing = {
            q.queue_name
            for q in self.stubs.queues.ListQueues(queues_pb2.ListQueuesRequest(page_size=1000), timeout=10).queues
        }
        if "fz-dlq" not in existing:
            self.stubs.create("fz-dlq")
        if "fz" not in existing:
            self.stubs.create("fz", dead_queue="fz-dlq", requested_partitions=2, lease_timeout={"seconds": 600})
        if "fz-one" not in existing:
            self.stubs.create("fz-one")
        if sum(p.total for p in self.stubs.stats("fz").partitions) < 6:
            self.stubs.produce("fz", [f"seed-{n}".encode() for n in range(6)])
            self.stubs.lease("fz", batch_size=2)
        self.ids = [i.id for p in (0, 1) for i in self.stubs.list_items("fz", partition=p, page_size=50)]

    def healthy(self) -> None:
        health = health_pb2_grpc.HealthStub(self.stubs.channel)
        for service in ("", "querator.v1.QueueService", "querator.v1.QueuesService", "querator.v1.StorageService"):
            reply = health.Check(health_pb2.HealthCheckRequest(service=service), timeout=5)
            assert reply.status == health_pb2.HealthCheckResponse.SERVING, service
        # And it still does its job.
        self.ensure_queues()
        self.stubs.produce("fz-one", [b"canary"])
        lease = self.stubs.lease("fz-one", batch_size=1000)
        assert b"canary" in [i.payload for i in lease.items]
        self.stubs.complete("fz-one", lease.partition, [i.id for i in lease.items])


@pytest.fixture(scope="module")
def fx(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Fixture]:
    data = str(tmp_path_factory.mktemp("fuzz") / "data")
    server = ThreadServer(data, sync=False, map_size=1 << 22)
    fixture = Fixture(server)
    fixture.ensure_queues()
    yield fixture
    fixture.healthy()
    fixture.stubs.channel.close()
    server.stop()


def check(fx: Fixture, rpc: str, call: Callable[[], object]) -> None:
    try:
        call()
    except grpc.RpcError as exc:
        code, details = exc.code(), exc.details() or ""
        assert code in DOCUMENTED, f"{rpc} answered {code.name}: {details[:300]}"
        assert code not in NOT_HERE, f"{rpc} answered {code.name} on a healthy, idle server: {details[:300]}"
        assert details.strip(), f"{rpc} answered {code.name} without a message"


# -- strategies --------------------------------------------------------------------------------

huge_text = st.builds(lambda ch, n: ch * n, st.characters(codec="utf-8"), st.integers(513, 20_000))
texts = st.one_of(
    st.text(max_size=30),
    st.text(alphabet=st.characters(codec="utf-8"), min_size=1, max_size=80),
    huge_text,
    st.sampled_from(["", " ", "a b", "a/b", "a~b", "\x00", "\u200b", "é" * 600, "q" * 512, "q" * 513]),
)
# Mostly real queues, so requests get past the name check and reach the queue.
names = st.one_of(st.sampled_from(QUEUES), st.sampled_from(QUEUES), st.just("missing"), texts)
int32s = st.one_of(st.integers(*INT32), st.sampled_from([0, 1, -1, 2, 999, 1000, 1001, 1024, 1025, 65_536, 65_537]))
int64s = st.one_of(st.integers(*INT64), st.sampled_from([0, 1, -1, 253_402_300_799, 253_402_300_800, 2**62]))
nanos = st.one_of(st.integers(*INT32), st.sampled_from([0, 1, 999_999_999, 1_000_000_000, -1]))
durations = st.one_of(
    st.none(),
    st.builds(duration_pb2.Duration, seconds=int64s, nanos=nanos),
    st.builds(duration_pb2.Duration, seconds=st.integers(0, 5), nanos=st.integers(0, 999_999_999)),
)
timestamps = st.one_of(
    st.none(),
    st.builds(timestamp_pb2.Timestamp, seconds=int64s, nanos=nanos),
    st.builds(timestamp_pb2.Timestamp, seconds=st.integers(1_600_000_000, 2_000_000_000), nanos=st.integers(0, 10**9 - 1)),
)


def id_like() -> st.SearchStrategy[str]:
    part = st.one_of(st.integers(-5, 20), st.integers(-(2**70), 2**70))
    return st.one_of(
        st.builds(lambda u, p, s: f"{u:x}.{p:x}.{s:x}", part, part, part),
        st.builds(lambda u, p, s, d: f"{u:x}.{p:x}.{s:x}.{d:x}", part, part, part, part),
        st.sampled_from(["1.0.1", "0x1.0.0x1", " 1.0.1", "1_0.0.1", "1.0.1.0", "1..1", "...", "-", "1.0.ffffffffffffffff"]),
    )


def bent(real: str) -> st.SearchStrategy[str]:
    """``real`` with the same queue and partition but odd numbers after them."""
    head = ".".join(real.split(".")[:2])
    number = st.one_of(st.integers(-3, 3), st.sampled_from([2**63, 2**64 - 1, 2**64, 2**70, -(2**64)]))
    return st.one_of(
        st.builds(lambda seq: f"{head}.{seq:x}", number),
        st.builds(lambda seq, due: f"{head}.{seq:x}.{due:x}", number, number),
    )


def ids(fx: Fixture) -> st.SearchStrategy[str]:
    """Real ids, real ids bent out of shape, and junk."""
    if not fx.ids:
        return st.one_of(id_like(), texts)
    real = st.sampled_from(fx.ids)
    return st.one_of(real, real.flatmap(bent), id_like(), texts)


def id_lists(fx: Fixture) -> st.SearchStrategy[list[str]]:
    return st.one_of(
        st.lists(ids(fx), max_size=6),
        st.builds(lambda n: [f"1.0.{i:x}" for i in range(n)], st.sampled_from([1000, 1001])),
    )


def targets(fx: Fixture, names: st.SearchStrategy[str], parts: st.SearchStrategy[int]) -> st.SearchStrategy[tuple[str, int, list[str]]]:
    """(queue, partition, ids): half the time the queue and partition the ids belong to."""
    anything = st.tuples(names, parts, id_lists(fx))
    if not fx.ids:
        return anything
    matching = st.sampled_from(fx.ids).flatmap(
        lambda real: st.tuples(
            st.just("fz"),
            st.just(int(real.split(".")[1], 16)),
            st.lists(st.one_of(st.just(real), bent(real)), min_size=1, max_size=3, unique=True),
        )
    )
    return st.one_of(matching, anything)


def usually(valid: st.SearchStrategy[Any], fuzzed: st.SearchStrategy[Any]) -> st.SearchStrategy[Any]:
    return st.one_of(valid, valid, fuzzed)


def optional(msg: Any, field: str, value: Any) -> Any:
    if value is not None:
        getattr(msg, field).CopyFrom(value)
    return msg


def produce_item(encoding: str, payload: bytes, utf8: str, at: Any, key: str) -> queue_pb2.ProduceItem:
    item = queue_pb2.ProduceItem(encoding=encoding, kind=encoding[:5], reference=utf8[:5], payload=payload, utf8=utf8)
    item.idempotency_key = key
    return optional(item, "enqueue_at", at)


produce_items = st.builds(produce_item, texts, st.binary(max_size=64), texts, timestamps, st.one_of(st.just(""), texts))


def queue_info(
    name: str, dead: str, lease: Any, expire: Any, attempts: int, parts: int, dedup: Any, copies: tuple[int, int]
) -> queues_pb2.QueueInfo:
    info = queues_pb2.QueueInfo(queue_name=name, dead_queue=dead, reference=dead[:10], max_attempts=attempts)
    info.requested_partitions = parts
    info.replicas, info.min_in_sync = copies
    optional(info, "lease_timeout", lease)
    optional(info, "expire_timeout", expire)
    optional(info, "dedup_window", dedup)
    return info


partitions_counts = st.one_of(int32s, st.integers(0, 4))
queue_infos = st.builds(
    queue_info,
    names,
    st.one_of(st.just(""), names),
    durations,
    durations,
    int32s,
    partitions_counts,
    durations,
    # Mostly the one copy a single server keeps; sometimes more, or a minimum.
    st.one_of(st.just((0, 0)), st.tuples(st.one_of(st.integers(0, 3), int32s), st.one_of(st.just(0), int32s))),
)
mask_paths = st.lists(
    st.one_of(
        st.sampled_from(
            [
                "dead_queue",
                "reference",
                "lease_timeout",
                "expire_timeout",
                "max_attempts",
                "requested_partitions",
                "replicas",
                "min_in_sync",
                "queue.max_attempts",
                "queue_name",
                "created_at",
                "dedup_window",
                "lease_key_ttl",
            ]
        ),
        texts,
    ),
    max_size=4,
)


def storage_item(item_id: str, leased: bool, times: list[Any], attempts: int, text: str, payload: bytes) -> storage_pb2.StorageItem:
    item = storage_pb2.StorageItem(
        id=item_id, is_leased=leased, attempts=attempts, reference=text, encoding=text[:3], kind=text[:2], payload=payload
    )
    item.source_id = text[:40]
    for field, value in zip(("lease_deadline", "expire_deadline", "enqueue_at", "created_at"), times, strict=True):
        optional(item, field, value)
    return item


def storage_items(fx: Fixture) -> st.SearchStrategy[storage_pb2.StorageItem]:
    return st.builds(
        storage_item, ids(fx), st.booleans(), st.lists(timestamps, min_size=4, max_size=4), int32s, texts, st.binary(max_size=64)
    )


def request_strategies(fx: Fixture) -> dict[str, tuple[Any, st.SearchStrategy[Any]]]:
    """RPC name -> (callable stub method, strategy of its requests)."""
    q, qs, s = fx.stubs.queue, fx.stubs.queues, fx.stubs.storage

    def produce(name: str, timeout: Any, items: list[Any]) -> Any:
        return optional(queue_pb2.ProduceRequest(queue_name=name, items=items), "request_timeout", timeout)

    def lease(target: tuple[str, int, list[str]], batch: int, client: str, timeout: Any, key: str) -> Any:
        name, part, done = target
        request = queue_pb2.LeaseRequest(queue_name=name, batch_size=batch, client_id=client, complete_ids=done)
        request.complete_partition = part
        request.lease_key = key
        return optional(request, "request_timeout", timeout)

    def complete(target: tuple[str, int, list[str]], timeout: Any, keys: list[str]) -> Any:
        name, part, item_ids = target
        request = queue_pb2.CompleteRequest(queue_name=name, partition=part, ids=item_ids, lease_keys=keys)
        return optional(request, "request_timeout", timeout)

    def retry(target: tuple[str, int, list[str]], times: list[Any], dead: list[bool]) -> Any:
        name, part, item_ids = target
        items = [
            optional(queue_pb2.RetryItem(id=i, dead=d), "retry_at", at) for i, at, d in zip(item_ids, times, dead, strict=False)
        ]
        return queue_pb2.RetryRequest(queue_name=name, partition=part, items=items)

    def extend(target: tuple[str, int, list[str]], lease_timeout: Any, keys: list[str]) -> Any:
        name, part, item_ids = target
        request = queue_pb2.ExtendRequest(queue_name=name, partition=part, ids=item_ids, lease_keys=keys)
        return optional(request, "lease_timeout", lease_timeout)

    def delete_items(target: tuple[str, int, list[str]]) -> Any:
        name, part, item_ids = target
        return storage_pb2.DeleteItemsRequest(queue_name=name, partition=part, ids=item_ids)

    def update(info: Any, paths: list[str]) -> Any:
        return queues_pb2.UpdateQueueRequest(queue=info, update_mask=field_mask_pb2.FieldMask(paths=paths))

    def create(info: Any, present: bool) -> Any:
        return queues_pb2.CreateQueueRequest(queue=info) if present else queues_pb2.CreateQueueRequest()

    parts = st.one_of(st.integers(0, 1), st.integers(0, 1), st.integers(-1, 2), int32s)
    # Mostly-valid values for the fields around the ones being aimed at, so that more
    # requests get past validation into the queue.
    timeouts = usually(st.none(), durations)
    batches = usually(st.integers(1, 10), int32s)
    short = usually(st.just(""), texts)
    tokens = st.one_of(st.just(""), texts, st.sampled_from(["AQ", "AUkAAAAA", "=="]))
    page = st.one_of(st.integers(-1, 1001), int32s)
    aimed = targets(fx, names, parts)
    keys = usually(st.just([]), st.lists(st.one_of(texts, st.just("k")), max_size=3))
    return {
        "Produce": (
            q.Produce,
            st.builds(produce, names, durations, st.one_of(st.lists(produce_items, max_size=5), st.builds(lambda n: [queue_pb2.ProduceItem(utf8="x")] * n, st.sampled_from([0, 1000, 1001])))),
        ),
        "Lease": (q.Lease, st.builds(lease, aimed, batches, short, timeouts, short)),
        "Complete": (q.Complete, st.builds(complete, aimed, timeouts, keys)),
        "Retry": (q.Retry, st.builds(retry, aimed, st.lists(timestamps, min_size=6, max_size=6), st.lists(st.booleans(), min_size=6, max_size=6))),
        "Extend": (q.Extend, st.builds(extend, aimed, timeouts, keys)),
        "CreateQueue": (qs.CreateQueue, st.builds(create, queue_infos, st.booleans())),
        "GetQueue": (qs.GetQueue, st.builds(queues_pb2.GetQueueRequest, queue_name=names)),
        "ListQueues": (qs.ListQueues, st.builds(queues_pb2.ListQueuesRequest, page_size=page, page_token=tokens)),
        "UpdateQueue": (qs.UpdateQueue, st.builds(update, queue_infos, mask_paths)),
        "DeleteQueue": (qs.DeleteQueue, st.builds(queues_pb2.DeleteQueueRequest, queue_name=names, force=st.booleans())),
        "ClearQueue": (
            qs.ClearQueue,
            st.builds(queues_pb2.ClearQueueRequest, queue_name=names, queue=st.booleans(), scheduled=st.booleans(), destructive=st.booleans()),
        ),
        "GetQueueStats": (qs.GetQueueStats, st.builds(queues_pb2.GetQueueStatsRequest, queue_name=names)),
        "ListItems": (
            s.ListItems,
            st.builds(storage_pb2.ListItemsRequest, queue_name=names, partition=parts, page_size=page, page_token=tokens),
        ),
        "ListScheduledItems": (
            s.ListScheduledItems,
            st.builds(storage_pb2.ListScheduledItemsRequest, queue_name=names, partition=parts, page_size=page, page_token=tokens),
        ),
        "ImportItems": (
            s.ImportItems,
            st.builds(storage_pb2.ImportItemsRequest, queue_name=names, partition=parts, items=st.lists(storage_items(fx), max_size=4)),
        ),
        "DeleteItems": (s.DeleteItems, st.builds(delete_items, aimed)),
        "CreateKey": (
            fx.keys.CreateKey,
            st.builds(keys_pb2.CreateKeyRequest, role=st.integers(-1, 5), queues=st.lists(texts, max_size=3), description=texts),
        ),
        "ListKeys": (fx.keys.ListKeys, st.just(keys_pb2.ListKeysRequest())),
        "RevokeKey": (fx.keys.RevokeKey, st.builds(keys_pb2.RevokeKeyRequest, key_id=texts)),
        "ClusterInfo": (
            fx.cluster.ClusterInfo,
            st.builds(cluster_pb2.ClusterInfoRequest, queue_names=st.lists(names, max_size=4)),
        ),
        "RetireNodeDiscardingData": (
            fx.cluster.RetireNodeDiscardingData,
            st.builds(cluster_pb2.RetireNodeDiscardingDataRequest, node_id=texts),
        ),
    }


METHODS = {
    "Produce": "querator.v1.QueueService",
    "Lease": "querator.v1.QueueService",
    "Complete": "querator.v1.QueueService",
    "Retry": "querator.v1.QueueService",
    "Extend": "querator.v1.QueueService",
    "CreateQueue": "querator.v1.QueuesService",
    "GetQueue": "querator.v1.QueuesService",
    "ListQueues": "querator.v1.QueuesService",
    "UpdateQueue": "querator.v1.QueuesService",
    "DeleteQueue": "querator.v1.QueuesService",
    "ClearQueue": "querator.v1.QueuesService",
    "GetQueueStats": "querator.v1.QueuesService",
    "ListItems": "querator.v1.StorageService",
    "ListScheduledItems": "querator.v1.StorageService",
    "ImportItems": "querator.v1.StorageService",
    "DeleteItems": "querator.v1.StorageService",
    "CreateKey": "querator.v1.KeysService",
    "ListKeys": "querator.v1.KeysService",
    "RevokeKey": "querator.v1.KeysService",
    "ClusterInfo": "querator.v1.ClusterService",
    "RetireNodeDiscardingData": "querator.v1.ClusterService",
}


def _timeout(rpc: str) -> float:
    return LEASE_CALL_TIMEOUT if rpc == "Lease" else 10.0


# -- the tests ------------------------------------------------------------------------------------


@pytest.mark.parametrize("rpc", sorted(METHODS))
def test_every_answer_to_fuzzed_requests_is_documented(fx: Fixture, rpc: str) -> None:
    fx.ensure_queues()
    method, requests = request_strategies(fx)[rpc]

    @FUZZ
    @given(request=requests)
    def fuzz(request: Any) -> None:
        check(fx, rpc, lambda: method(request, timeout=_timeout(rpc)))

    fuzz()
    fx.healthy()


@pytest.mark.parametrize("rpc", sorted(METHODS))
def test_random_bytes_as_a_request_get_a_documented_answer(fx: Fixture, rpc: str) -> None:
    fx.ensure_queues()
    call = fx.stubs.channel.unary_unary(f"/{METHODS[rpc]}/{rpc}")

    @RAW
    @given(raw=st.one_of(st.binary(max_size=300), st.builds(lambda b: b"\x0a" + bytes([len(b)]) + b, st.binary(max_size=100))))
    def fuzz(raw: bytes) -> None:
        check(fx, rpc, lambda: call(raw, timeout=_timeout(rpc)))

    fuzz()
    fx.healthy()


@pytest.mark.parametrize("rpc", ["Produce", "Lease", "GetQueue", "CreateQueue", "ListItems", "DeleteQueue"])
def test_a_string_field_that_is_not_utf8_is_invalid_argument(fx: Fixture, rpc: str) -> None:
    # Field 1 as a length-delimited field holding bytes that are not UTF-8.
    raw = b"\x0a\x04\xff\xfe\xfd\xfc"
    if rpc == "CreateQueue":
        raw = b"\x0a\x06" + raw  # queue { queue_name = <not UTF-8> }
    call = fx.stubs.channel.unary_unary(f"/{METHODS[rpc]}/{rpc}")
    with pytest.raises(grpc.RpcError) as caught:
        call(raw, timeout=_timeout(rpc))
    assert caught.value.code() == C.INVALID_ARGUMENT, caught.value.details()


@pytest.mark.parametrize("rpc", ["Complete", "Retry", "Extend", "DeleteItems", "Lease.complete_ids"])
def test_an_id_of_ours_with_an_out_of_range_number_is_not_found(fx: Fixture, rpc: str) -> None:
    """An id with our queue and partition but a negative or 65-bit number names no item."""
    fx.ensure_queues()
    head = ".".join(fx.ids[0].split(".")[:2])
    partition = int(head.split(".")[1], 16)
    # DeleteItems skips ids it does not hold; the others name the id NOT_FOUND.
    expected = C.OK if rpc == "DeleteItems" else C.NOT_FOUND
    wrong = {}
    for bent in ("-1", "10000000000000000", "5.-1", "-1.10", "5.10000000000000000"):
        code = _call_with_id(fx, rpc, f"{head}.{bent}", partition)
        if code != expected:
            wrong[f"{head}.{bent}"] = code.name
    assert not wrong, f"{rpc}: expected {expected.name}, got {wrong}"


def _call_with_id(fx: Fixture, rpc: str, item_id: str, partition: int) -> grpc.StatusCode:
    calls: dict[str, Callable[[], object]] = {
        "Complete": lambda: fx.stubs.queue.Complete(
            queue_pb2.CompleteRequest(queue_name="fz", partition=partition, ids=[item_id]), timeout=10
        ),
        "Retry": lambda: fx.stubs.queue.Retry(
            queue_pb2.RetryRequest(queue_name="fz", partition=partition, items=[queue_pb2.RetryItem(id=item_id)]),
            timeout=10,
        ),
        "Extend": lambda: fx.stubs.queue.Extend(
            queue_pb2.ExtendRequest(queue_name="fz", partition=partition, ids=[item_id]), timeout=10
        ),
        "DeleteItems": lambda: fx.stubs.storage.DeleteItems(
            storage_pb2.DeleteItemsRequest(queue_name="fz", partition=partition, ids=[item_id]), timeout=10
        ),
        "Lease.complete_ids": lambda: fx.stubs.queue.Lease(
            queue_pb2.LeaseRequest(
                queue_name="fz", batch_size=1, complete_ids=[item_id], complete_partition=partition
            ),
            timeout=0.5,
        ),
    }
    try:
        calls[rpc]()
    except grpc.RpcError as exc:
        return exc.code()
    return C.OK


def test_a_request_over_5_mb_is_resource_exhausted_and_a_10_kb_id_keeps_its_status(fx: Fixture) -> None:
    big = queue_pb2.ProduceRequest(queue_name="fz", items=[queue_pb2.ProduceItem(payload=bytes(5_100_000))])
    with pytest.raises(grpc.RpcError) as caught:
        fx.stubs.queue.Produce(big, timeout=30)
    assert caught.value.code() == C.RESOURCE_EXHAUSTED, caught.value.details()
    for name in ("fz", "x" * 10_000):
        request = queue_pb2.CompleteRequest(queue_name=name, partition=0, ids=["y" * 10_000])
        with pytest.raises(grpc.RpcError) as caught:
            fx.stubs.queue.Complete(request, timeout=10)
        assert caught.value.code() in (C.NOT_FOUND, C.INVALID_ARGUMENT), caught.value.details()
        assert len(caught.value.details()) < 4096
    fx.healthy()


def test_the_health_service_is_serving_after_the_fuzzing(fx: Fixture, tmp_path: Path) -> None:
    fx.healthy()
