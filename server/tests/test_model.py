"""A stateful model test: the queue against a simple in-memory model.

hypothesis runs random sequences of produce, produce-later (scheduled), lease, complete,
lease-with-complete_ids, retry (now or dead), expire, clear and restart against a real
server on real LMDB, and after every step compares the queue with a model that knows
only the contract (API.md): FIFO order, attempts counted per lease, ids that change
when an item re-enters its partition, max_attempts 2 and a dead-letter queue, the
all-or-nothing rule, and that stale ids are NOT_FOUND.

Every operation is deterministic: "expire" is an Extend to a 1 ms lease followed by
bounded polling until the lifecycle has re-queued the items, and "restart" stops and
starts the server on the same data directory. Examples are derandomized and bounded.
"""

from __future__ import annotations

import shutil
import tempfile
import time
from dataclasses import dataclass

import grpc
from hypothesis import HealthCheck, settings
from hypothesis import strategies as st
from hypothesis.stateful import (
    RuleBasedStateMachine,
    initialize,
    invariant,
    precondition,
    rule,
)

from querator.v1 import queue_pb2, queues_pb2, storage_pb2

from conftest import Stubs, ThreadServer

Q = "m"
DLQ = "m-dlq"
MAX_ATTEMPTS = 2
NOW = {"seconds": 0}  # a Lease request_timeout of zero: answer at once
FAR = 3600  # seconds until produce-later items are due: never during a test


@dataclass
class Entry:
    payload: bytes
    attempts: int


def seq_of(item_id: str) -> int:
    return int(item_id.split(".")[2], 16)


def wait_for(predicate: object, what: str, timeout: float = 10.0) -> None:
    deadline = time.monotonic() + timeout
    while not predicate():  # type: ignore[operator]
        if time.monotonic() > deadline:
            raise AssertionError(f"{what} did not happen within {timeout}s")
        time.sleep(0.005)


class QueueMachine(RuleBasedStateMachine):
    def __init__(self) -> None:
        super().__init__()
        self.tmp = tempfile.mkdtemp(prefix="querator-model-")
        self.data_dir = f"{self.tmp}/data"
        self.server = ThreadServer(self.data_dir, sync=False)
        self.stubs = Stubs(grpc.insecure_channel(self.server.address))
        self.stubs.create(DLQ)
        self.stubs.create(Q, dead_queue=DLQ, max_attempts=MAX_ATTEMPTS, lease_timeout={"seconds": 600})
        self.ready: list[Entry] = []  # FIFO order
        self.leased: dict[str, Entry] = {}  # id -> entry (attempts as the lease reported it)
        self.scheduled: list[bytes] = []
        self.dead: list[bytes] = []  # payloads the DLQ must hold
        self.gone: list[str] = []  # ids that no longer name a leased item
        # Of those, the ids completed, and the ids retried (-> whether they went dead):
        # within the lease timeout (600 s here) a Complete / Retry sent again of them is done.
        self.completed: set[str] = set()
        self.retried: dict[str, bool] = {}
        self.made = 0

    def teardown(self) -> None:
        self.stubs.channel.close()
        self.server.stop()
        shutil.rmtree(self.tmp, ignore_errors=True)

    # -- helpers -----------------------------------------------------------------------

    def _payloads(self, n: int) -> list[bytes]:
        out = [f"item-{self.made + i}".encode() for i in range(n)]
        self.made += n
        return out

    def _pick(self, indexes: list[int]) -> list[str]:
        ids = sorted(self.leased, key=seq_of)
        return list(dict.fromkeys(ids[i % len(ids)] for i in indexes))

    def _code(self, call: object) -> grpc.StatusCode:
        try:
            call()  # type: ignore[operator]
        except grpc.RpcError as exc:
            return exc.code()
        return grpc.StatusCode.OK

    def _take_lease(self, reply: queue_pb2.LeaseResponse, batch: int) -> None:
        expected = self.ready[:batch]
        got = [(i.payload, i.attempts) for i in reply.items]
        assert got == [(e.payload, e.attempts + 1) for e in expected], (got, expected)
        del self.ready[: len(expected)]
        for item in reply.items:
            assert item.id not in self.leased and item.id not in self.gone
            self.leased[item.id] = Entry(item.payload, item.attempts)

    def _back_in_line(self, entry: Entry, dead: bool = False) -> None:
        if dead or entry.attempts >= MAX_ATTEMPTS:
            self.dead.append(entry.payload)
        else:
            self.ready.append(entry)

    # -- rules ---------------------------------------------------------------------------

    @initialize(n=st.integers(2, 6), batch=st.integers(1, 4))
    def some_items_and_leases(self, n: int, batch: int) -> None:
        self.produce(n)
        self.lease(batch)

    @rule(n=st.integers(1, 4))
    def produce(self, n: int) -> None:
        payloads = self._payloads(n)
        reply = self.stubs.produce(Q, payloads)
        assert len(reply.ids) == n and len(set(reply.ids)) == n
        self.ready += [Entry(p, 0) for p in payloads]

    @rule(n=st.integers(1, 2))
    def produce_later(self, n: int) -> None:
        payloads = self._payloads(n)
        at = {"seconds": int(time.time()) + FAR}
        items = [queue_pb2.ProduceItem(payload=p, enqueue_at=at) for p in payloads]
        self.stubs.queue.Produce(queue_pb2.ProduceRequest(queue_name=Q, items=items), timeout=10)
        self.scheduled += payloads

    @rule(batch=st.integers(1, 6))
    def lease(self, batch: int) -> None:
        reply = self.stubs.lease(Q, batch_size=batch, request_timeout=NOW)
        self._take_lease(reply, batch)

    @precondition(lambda self: self.leased)
    @rule(indexes=st.lists(st.integers(0, 50), min_size=1, max_size=4))
    def complete(self, indexes: list[int]) -> None:
        ids = self._pick(indexes)
        self.stubs.complete(Q, 0, ids)
        for i in ids:
            del self.leased[i]
        self.gone += ids
        self.completed.update(ids)

    @precondition(lambda self: self.leased)
    @rule(indexes=st.lists(st.integers(0, 50), min_size=1, max_size=3), batch=st.integers(1, 4))
    def lease_completing_the_last(self, indexes: list[int], batch: int) -> None:
        ids = self._pick(indexes)
        request = queue_pb2.LeaseRequest(
            queue_name=Q, batch_size=batch, complete_ids=ids, complete_partition=0, request_timeout=NOW
        )
        reply = self.stubs.queue.Lease(request, timeout=10)
        for i in ids:
            del self.leased[i]
        self.gone += ids
        self.completed.update(ids)
        self._take_lease(reply, batch)

    @precondition(lambda self: self.gone)
    @rule(index=st.integers(0, 1000), with_live=st.booleans())
    def complete_a_stale_id(self, index: int, with_live: bool) -> None:
        """A retried or expired id is NOT_FOUND, and takes the whole request down; a
        completed one is done (the Complete was sent again), and the rest completes."""
        stale = self.gone[index % len(self.gone)]
        ids = [stale]
        live = min(self.leased, key=seq_of) if with_live and self.leased else None
        if live is not None:
            ids.insert(0, live)
        request = queue_pb2.CompleteRequest(queue_name=Q, partition=0, ids=ids)
        if stale not in self.completed:
            assert self._code(lambda: self.stubs.queue.Complete(request, timeout=10)) == grpc.StatusCode.NOT_FOUND
            return
        assert list(self.stubs.queue.Complete(request, timeout=10).already_completed) == [stale]
        if live is not None:
            del self.leased[live]
            self.gone.append(live)
            self.completed.add(live)

    @precondition(lambda self: self.gone)
    @rule(index=st.integers(0, 1000))
    def retry_a_stale_id(self, index: int) -> None:
        """A retried id is done (named in dead_ids again if it went dead); a completed or
        expired one is NOT_FOUND."""
        stale = self.gone[index % len(self.gone)]
        request = queue_pb2.RetryRequest(queue_name=Q, partition=0, items=[queue_pb2.RetryItem(id=stale)])
        if stale not in self.retried:
            assert self._code(lambda: self.stubs.queue.Retry(request, timeout=10)) == grpc.StatusCode.NOT_FOUND
            return
        reply = self.stubs.queue.Retry(request, timeout=10)
        assert list(reply.already_retried) == [stale]
        assert list(reply.dead_ids) == ([stale] if self.retried[stale] else [])

    @precondition(lambda self: self.leased)
    @rule(indexes=st.lists(st.integers(0, 50), min_size=1, max_size=4), dead=st.lists(st.booleans(), min_size=4, max_size=4))
    def retry(self, indexes: list[int], dead: list[bool]) -> None:
        ids = self._pick(indexes)
        items = [queue_pb2.RetryItem(id=i, dead=d) for i, d in zip(ids, dead, strict=False)]
        reply = self.stubs.queue.Retry(queue_pb2.RetryRequest(queue_name=Q, partition=0, items=items), timeout=10)
        for item in items:
            self._back_in_line(self.leased.pop(item.id), dead=item.dead)
            self.gone.append(item.id)
            self.retried[item.id] = item.id in reply.dead_ids

    @precondition(lambda self: self.leased)
    @rule(indexes=st.lists(st.integers(0, 50), min_size=1, max_size=3))
    def expire(self, indexes: list[int]) -> None:
        """Shorten leases to 1 ms and wait until the lifecycle has taken them back."""
        ids = self._pick(indexes)
        request = queue_pb2.ExtendRequest(queue_name=Q, partition=0, ids=ids, lease_timeout={"nanos": 1_000_000})
        self.stubs.queue.Extend(request, timeout=10)
        remaining = len(self.leased) - len(ids)
        wait_for(lambda: self.stubs.stats(Q).partitions[0].total_leased == remaining, "lease expiry")
        # Expired together, they go back (or to the DLQ) in their partition's order.
        for item_id in sorted(ids, key=seq_of):
            self._back_in_line(self.leased.pop(item_id))
            self.gone.append(item_id)

    @rule(scheduled=st.booleans())
    def clear(self, scheduled: bool) -> None:
        """ClearQueue removes ready items (never leased ones), and scheduled ones if asked."""
        request = queues_pb2.ClearQueueRequest(queue_name=Q, queue=True, scheduled=scheduled)
        self.stubs.queues.ClearQueue(request, timeout=10)
        self.ready = []
        if scheduled:
            self.scheduled = []

    @rule()
    def restart(self) -> None:
        self.stubs.channel.close()
        self.server.stop()
        self.server = ThreadServer(self.data_dir, sync=False)
        self.stubs = Stubs(grpc.insecure_channel(self.server.address))

    # -- what must always hold ------------------------------------------------------------

    @invariant()
    def storage_matches_the_model(self) -> None:
        listed = self.stubs.list_items(Q)
        ready = [(i.payload, i.attempts) for i in listed if not i.is_leased]
        assert ready == [(e.payload, e.attempts) for e in self.ready]
        leased = {i.id: (i.payload, i.attempts) for i in listed if i.is_leased}
        assert leased == {k: (e.payload, e.attempts) for k, e in self.leased.items()}
        request = storage_pb2.ListScheduledItemsRequest(queue_name=Q, page_size=1000)
        later = [i.payload for i in self.stubs.storage.ListScheduledItems(request, timeout=10).items]
        assert later == self.scheduled
        part = self.stubs.stats(Q).partitions[0]
        assert (part.total, part.total_leased, part.scheduled) == (
            len(self.ready) + len(self.leased),
            len(self.leased),
            len(self.scheduled),
        )

    @invariant()
    def dead_letters_arrive_once_each(self) -> None:
        want = sorted(self.dead)

        def arrived() -> bool:
            return sorted(i.payload for i in self.stubs.list_items(DLQ)) == want

        wait_for(arrived, f"dead letters {want[-3:]}")
        items = self.stubs.list_items(DLQ)
        assert all(i.attempts == 0 and i.source_id for i in items)


QueueMachine.TestCase.settings = settings(
    max_examples=25,
    stateful_step_count=25,
    deadline=None,
    derandomize=True,
    database=None,
    suppress_health_check=[HealthCheck.too_slow],
)
test_the_queue_behaves_like_its_model = QueueMachine.TestCase
