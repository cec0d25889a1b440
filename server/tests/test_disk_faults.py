"""Disk faults: a full disk or map, failing writes, and a data directory start-up cannot trust.

docs/operations.md, "Faults and what they return". A write that storage refuses is
answered UNAVAILABLE (full file system, I/O error) or RESOURCE_EXHAUSTED (LMDB map full),
with a message that says why; nothing already acknowledged is lost and the server
carries on once space returns. A corrupt or foreign file in the data directory stops
start-up with a message naming the file, never a silently empty queue.

Most faults are injected with ``QUERATOR_FAULT_FILE`` (faults.py): while the named file
exists, every storage commit meets the fault it names, so a running server can be made to
fail and then recover. One test fills a real, small tmpfs; it needs permission to mount.
"""

from __future__ import annotations

import contextlib
import json
import os
import random
import shutil
import subprocess
import sys
import threading
import time
import urllib.request
from collections import Counter
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import grpc
import lmdb
import pytest
from google.protobuf import field_mask_pb2
from grpc_health.v1 import health_pb2, health_pb2_grpc

import querator
from querator.v1 import queue_pb2, queues_pb2, storage_pb2
from querator_server.faults import FAULT_FILE_ENV, write_fault
from querator_server.logging import RepeatedFailure

from conftest import ProcessServer, Stubs, ThreadServer, free_port, wait_until

OK = grpc.StatusCode.OK
UNAVAILABLE = grpc.StatusCode.UNAVAILABLE
EXHAUSTED = grpc.StatusCode.RESOURCE_EXHAUSTED
LONG_LEASE = {"seconds": 600}
SHORT_WAIT = {"nanos": 200_000_000}


# -- helpers -----------------------------------------------------------------------------


def connect(address: str) -> Stubs:
    return Stubs(grpc.insecure_channel(address))


@contextlib.contextmanager
def _served(data_dir: str) -> Iterator[Stubs]:
    """A server on ``data_dir`` in this process, and stubs to it, while in the block."""
    srv = ThreadServer(data_dir)
    stubs = connect(srv.address)
    try:
        yield stubs
    finally:
        stubs.channel.close()
        srv.stop()


def status_of(call: Callable[[], object]) -> tuple[grpc.StatusCode, str]:
    try:
        call()
    except grpc.RpcError as exc:
        return exc.code(), exc.details() or ""
    return OK, ""


def stored(stubs: Stubs, name: str) -> list[storage_pb2.StorageItem]:
    """Every ready and leased item of every partition, following page tokens."""
    info = stubs.queues.GetQueue(queues_pb2.GetQueueRequest(queue_name=name), timeout=10).queue
    items: list[storage_pb2.StorageItem] = []
    for partition in range(info.requested_partitions):
        token = ""
        for _ in range(1000):
            request = storage_pb2.ListItemsRequest(queue_name=name, partition=partition, page_size=500, page_token=token)
            page = stubs.storage.ListItems(request, timeout=10)
            items.extend(page.items)
            token = page.next_page_token
            if not token:
                break
    return items


def _health(address: str, service: str) -> int:
    with grpc.insecure_channel(address) as channel:
        request = health_pb2.HealthCheckRequest(service=service)
        return health_pb2_grpc.HealthStub(channel).Check(request, timeout=10).status  # type: ignore[no-any-return]


def stats_total(stubs: Stubs, name: str) -> tuple[int, int]:
    parts = stubs.stats(name).partitions
    return sum(p.total for p in parts), sum(p.total_leased for p in parts)


@pytest.fixture
def fault_switch(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """The file whose presence injects a write fault; servers started after this see it."""
    switch = tmp_path / "write-fault"
    monkeypatch.setenv(FAULT_FILE_ENV, str(switch))
    return switch


# -- injected faults on a running server ---------------------------------------------------


def test_a_full_disk_refuses_writes_with_unavailable_loses_nothing_and_recovers(
    data_dir: str, fault_switch: Path
) -> None:
    with _served(data_dir) as stubs:
        stubs.create("dlq")
        stubs.create("q", dead_queue="dlq", lease_timeout=LONG_LEASE)
        acked = {f"a{i}".encode() for i in range(20)}
        stubs.produce("q", sorted(acked))
        lease = stubs.lease("q", batch_size=5)
        leased = [i.id for i in lease.items]
        assert len(leased) == 5

        fault_switch.write_text("no-space")
        writes: dict[str, Callable[[], object]] = {
            "Produce": lambda: stubs.produce("q", [b"refused"]),
            "Complete": lambda: stubs.complete("q", 0, leased[:1]),
            "Retry": lambda: stubs.queue.Retry(
                queue_pb2.RetryRequest(queue_name="q", items=[queue_pb2.RetryItem(id=leased[1])]), timeout=10
            ),
            "Extend": lambda: stubs.queue.Extend(queue_pb2.ExtendRequest(queue_name="q", ids=leased[2:3]), timeout=10),
            "ImportItems": lambda: stubs.storage.ImportItems(
                storage_pb2.ImportItemsRequest(queue_name="q", items=[storage_pb2.StorageItem(payload=b"refused")]),
                timeout=10,
            ),
            "ClearQueue": lambda: stubs.queues.ClearQueue(
                queues_pb2.ClearQueueRequest(queue_name="q", queue=True), timeout=10
            ),
        }
        for rpc, call in writes.items():
            code, message = status_of(call)
            assert code == UNAVAILABLE, (rpc, code, message)
            assert "no space left on device" in message.lower(), (rpc, message)
        # A Lease cannot take ready items while their lease cannot be written: it says
        # so, rather than wait and answer no items as if the queue were empty.
        code, message = status_of(lambda: stubs.lease("q", batch_size=5, request_timeout=SHORT_WAIT))
        assert code == UNAVAILABLE and "no space left on device" in message.lower(), (code, message)
        # Reads that need no commit keep working, and show every partition faulty.
        assert stats_total(stubs, "q") == (20, 5)
        assert sorted(i.payload for i in stored(stubs, "q")) == sorted(acked)
        assert stubs.queues.GetQueue(queues_pb2.GetQueueRequest(queue_name="q"), timeout=10).queue.queue_name == "q"
        parts = stubs.stats("q").partitions
        assert all(p.faulty and "no space left on device" in p.failure.lower() for p in parts), parts
        assert all(p.faulty_since.seconds for p in parts), parts

        fault_switch.unlink()  # space returns: found with no call to wait for
        wait_until(lambda: not any(p.faulty for p in stubs.stats("q").partitions), timeout=10)
        stubs.complete("q", lease.partition, leased)  # the leases held through the fault
        stubs.produce("q", [b"after"])
        payloads = sorted(i.payload for i in stored(stubs, "q"))
        done = {p.payload for p in lease.items}
        assert payloads == sorted((acked - done) | {b"after"})
        assert stats_total(stubs, "q") == (16, 0)

    with _served(data_dir) as stubs:  # and it all holds across a restart
        assert sorted(i.payload for i in stored(stubs, "q")) == sorted((acked - done) | {b"after"})
        assert stats_total(stubs, "q") == (16, 0)


def test_admin_calls_on_a_full_disk_say_why_they_failed(data_dir: str, fault_switch: Path) -> None:
    with _served(data_dir) as stubs:
        stubs.create("q")
        fault_switch.write_text("no-space")
        update = queues_pb2.UpdateQueueRequest(
            queue=queues_pb2.QueueInfo(queue_name="q", max_attempts=3),
            update_mask=field_mask_pb2.FieldMask(paths=["max_attempts"]),
        )
        admin: dict[str, Callable[[], object]] = {
            "CreateQueue": lambda: stubs.create("new"),
            "UpdateQueue": lambda: stubs.queues.UpdateQueue(update, timeout=10),
        }
        results = {rpc: status_of(call) for rpc, call in admin.items()}
        fault_switch.unlink()
        # Nothing changed, and the server carries on.
        names = [q.queue_name for q in stubs.queues.ListQueues(queues_pb2.ListQueuesRequest(), timeout=10).queues]
        assert names == ["q"]
        assert stubs.queues.GetQueue(queues_pb2.GetQueueRequest(queue_name="q"), timeout=10).queue.max_attempts == 0
        stubs.create("new")
        assert all(code == UNAVAILABLE for code, _ in results.values()), results
        unclear = {rpc: message for rpc, (_, message) in results.items() if "no space" not in message.lower()}
        assert not unclear, f"admin errors do not say the disk is full: {unclear}"


def test_a_delete_queue_that_storage_refuses_leaves_the_queue_working(data_dir: str, fault_switch: Path) -> None:
    with _served(data_dir) as stubs:
        stubs.create("q")
        stubs.produce("q", [b"kept"])
        fault_switch.write_text("io-error")
        code, message = status_of(
            lambda: stubs.queues.DeleteQueue(queues_pb2.DeleteQueueRequest(queue_name="q", force=True), timeout=10)
        )
        fault_switch.unlink()
        assert code == UNAVAILABLE, (code, message)
        # The catalog still has the queue, so it must still work, not answer "deleted".
        assert stubs.queues.GetQueue(queues_pb2.GetQueueRequest(queue_name="q"), timeout=10).queue.queue_name == "q"
        stubs.produce("q", [b"after"])
        assert [i.payload for i in stored(stubs, "q")] == [b"kept", b"after"]


def test_a_lease_whose_complete_ids_storage_refused_does_not_answer_ok(data_dir: str, fault_switch: Path) -> None:
    """Lease.complete_ids is all-or-nothing: an OK must mean the completions are on disk."""
    with _served(data_dir) as stubs:
        stubs.create("q", lease_timeout=LONG_LEASE)
        stubs.produce("q", [b"x", b"y"])
        first = stubs.lease("q", batch_size=2)
        done = [i.id for i in first.items]
        fault_switch.write_text("io-error")
        request = queue_pb2.LeaseRequest(
            queue_name="q", batch_size=1, complete_ids=done, complete_partition=first.partition, request_timeout=SHORT_WAIT
        )
        code, message = status_of(lambda: stubs.queue.Lease(request, timeout=5))
        fault_switch.unlink()
        completed = stats_total(stubs, "q") == (0, 0)
        assert code != OK or completed, "Lease answered OK but its complete_ids were not applied"
        assert code == UNAVAILABLE, (code, message)
        assert stats_total(stubs, "q") == (2, 2)  # nothing was completed; the leases still hold
        stubs.complete("q", first.partition, done)


def test_a_map_that_cannot_grow_gives_resource_exhausted_and_recovers(data_dir: str, fault_switch: Path) -> None:
    with _served(data_dir) as stubs:
        stubs.create("q", lease_timeout=LONG_LEASE)
        acked = [f"m{i}".encode() for i in range(10)]
        stubs.produce("q", acked)
        lease = stubs.lease("q", batch_size=2)

        fault_switch.write_text("map-full")
        code, message = status_of(lambda: stubs.produce("q", [b"refused"]))
        assert code == EXHAUSTED and "storage is full" in message, (code, message)
        code, message = status_of(lambda: stubs.complete("q", lease.partition, [i.id for i in lease.items]))
        assert code == EXHAUSTED, (code, message)
        code, message = status_of(lambda: stubs.lease("q", batch_size=2, request_timeout=SHORT_WAIT))
        assert code == EXHAUSTED and "storage is full" in message, (code, message)
        assert stats_total(stubs, "q") == (10, 2)
        assert all(p.faulty and "storage is full" in p.failure for p in stubs.stats("q").partitions)

        fault_switch.unlink()
        wait_until(lambda: not any(p.faulty for p in stubs.stats("q").partitions), timeout=10)
        stubs.complete("q", lease.partition, [i.id for i in lease.items])
        stubs.produce("q", [b"after"])
        assert [i.payload for i in stored(stubs, "q")] == acked[2:] + [b"after"]


def test_a_server_process_fails_and_recovers_by_switch_and_a_refused_produce_stores_nothing(
    data_dir: str, fault_switch: Path
) -> None:
    proc = ProcessServer(data_dir)  # inherits QUERATOR_FAULT_FILE from this process
    proc.start()
    try:
        stubs = connect(proc.address)
        stubs.create("q", requested_partitions=2)
        acked = [f"p{i}".encode() for i in range(30)]
        for start in range(0, 30, 10):
            stubs.produce("q", acked[start : start + 10])
        fault_switch.write_text("io-error")
        code, message = status_of(lambda: stubs.produce("q", [b"refused"]))
        assert code == UNAVAILABLE and "input/output error" in message.lower(), (code, message)
        stubs.channel.close()
        proc.kill9()
        fault_switch.unlink()
        proc.start()
        stubs = connect(proc.address)
        try:
            assert sorted(i.payload for i in stored(stubs, "q")) == sorted(acked)
            stubs.produce("q", [b"after"])
            assert stats_total(stubs, "q") == (31, 0)
        finally:
            stubs.channel.close()
    finally:
        proc.stop()


# -- a real full file system ----------------------------------------------------------------


@contextlib.contextmanager
def tmpfs(mount_point: Path, size: str) -> Iterator[Path]:
    """A tmpfs of ``size`` mounted at ``mount_point`` while the block runs. Mounting needs
    root: where it is refused the test is skipped, except in CI (CI=true, where the tests
    run as root), where it fails: these tests must never silently vanish there."""
    mount_point.mkdir()
    mounted = subprocess.run(
        ["mount", "-t", "tmpfs", "-o", f"size={size},mode=0700", "querator-test", str(mount_point)],
        capture_output=True,
        text=True,
        check=False,
    )
    if mounted.returncode != 0:
        message = f"cannot mount a tmpfs here (it takes root): {mounted.stderr.strip()}"
        if os.environ.get("CI", "").lower() == "true":
            pytest.fail(message, pytrace=False)
        pytest.skip(message)
    try:
        yield mount_point
    finally:
        subprocess.run(["umount", "-l", str(mount_point)], capture_output=True, check=False)


@pytest.fixture
def small_tmpfs(tmp_path: Path) -> Iterator[Path]:
    """A 4 MiB tmpfs mounted for this test."""
    with tmpfs(tmp_path / "small-fs", "4m") as mount_point:
        yield mount_point


def test_a_real_full_file_system_refuses_writes_loses_nothing_and_recovers_when_space_returns(
    small_tmpfs: Path,
) -> None:
    proc = ProcessServer(str(small_tmpfs / "data"))
    proc.start()
    acked: list[bytes] = []
    try:
        stubs = connect(proc.address)
        stubs.create("q")
        refused: tuple[grpc.StatusCode, str] | None = None
        for batch in range(400):  # 400 x 10 x 8 KiB = 32 MB, far more than 4 MiB
            payloads = [f"{batch}-{i}-".encode() + bytes(10_000) for i in range(10)]
            code, message = status_of(lambda payloads=payloads: stubs.produce("q", payloads))  # type: ignore[misc]
            if code != OK:
                refused = (code, message)
                break
            acked += payloads
        assert refused is not None, "the file system never filled up"
        assert refused[0] in (UNAVAILABLE, EXHAUSTED), refused
        assert len(acked) > 50
        # Everything acknowledged is there, also while the disk is full.
        assert sorted(i.payload for i in stored(stubs, "q")) == sorted(acked)

        subprocess.run(["mount", "-o", "remount,size=64m", str(small_tmpfs)], check=True)
        more = [b"after-" + bytes(8192) for _ in range(10)]
        stubs.produce("q", more)  # space is back: writes work at once
        acked += more
        stubs.channel.close()

        proc.kill9()
        proc.start()
        stubs = connect(proc.address)
        try:
            assert sorted(i.payload for i in stored(stubs, "q")) == sorted(acked)
            assert stats_total(stubs, "q") == (len(acked), 0)
        finally:
            stubs.channel.close()
        # Last, so the checks above run whatever the wording: the caller is told why.
        assert "space" in refused[1].lower() or "full" in refused[1].lower(), (
            f"a full file system is reported as {refused[1]!r}"
        )
    finally:
        proc.stop()


# A full file system under load: calls by (rpc, outcome) and their timing, from threads.


@dataclass
class _Call:
    rpc: str
    queue: str
    started: float
    ended: float
    code: grpc.StatusCode
    message: str
    items: int = 0  # produced, leased or completed
    faulty: int = 0  # GetQueueStats: partitions listed faulty
    ready: int = 0  # GetQueueStats: ready items
    failures: tuple[str, ...] = ()


@dataclass
class _Load:
    """Producers, consumers and a stats reader on two queues, until told to stop."""

    stubs: Stubs
    queues: dict[str, int]  # name -> partitions
    stop_producing: threading.Event = field(default_factory=threading.Event)
    stop_consuming: threading.Event = field(default_factory=threading.Event)
    calls: list[_Call] = field(default_factory=list)
    acked: set[bytes] = field(default_factory=set)
    delivered: list[bytes] = field(default_factory=list)
    # Leased, not yet completed: (queue, partition) -> {id: payload}.
    pending: dict[tuple[str, int], dict[str, bytes]] = field(default_factory=dict)
    lock: threading.Lock = field(default_factory=threading.Lock)

    def call(self, rpc: str, queue: str, fn: Callable[..., Any], *args: Any, **kwargs: Any) -> tuple[_Call, Any]:
        started = time.monotonic()
        try:
            result, code, message = fn(*args, **kwargs), OK, ""
        except grpc.RpcError as exc:
            result, code, message = None, exc.code(), exc.details() or ""
        record = _Call(rpc, queue, started, time.monotonic(), code, message)
        with self.lock:
            self.calls.append(record)
        return record, result

    def produce(self, queue: str) -> None:
        for n in range(5000):  # bounded: far more than the file system holds
            if self.stop_producing.is_set():
                return
            payloads = [f"{queue}:{n}:{i}:".encode() + bytes(1000) for i in range(20)]
            record, _ = self.call("Produce", queue, self.stubs.produce, queue, payloads)
            record.items = len(payloads)
            if record.code == OK:
                with self.lock:
                    self.acked.update(payloads)
            else:
                time.sleep(0.02)  # a client's backoff

    def consume(self, queue: str) -> None:
        for _ in range(20_000):
            if self.stop_consuming.is_set():
                return
            self.complete_pending(queue)
            request = queue_pb2.LeaseRequest(queue_name=queue, batch_size=10, request_timeout=SHORT_WAIT)
            record, reply = self.call("Lease", queue, self.stubs.queue.Lease, request, timeout=10)
            if reply is not None and reply.items:
                record.items = len(reply.items)
                with self.lock:
                    self.delivered.extend(i.payload for i in reply.items)
                    self.pending.setdefault((queue, reply.partition), {}).update(
                        (i.id, i.payload) for i in reply.items
                    )
            time.sleep(0.05)  # slower than the producers: items pile up

    def complete_pending(self, queue: str) -> None:
        for (name, partition), held in list(self.pending.items()):
            if name != queue or not held:
                continue
            ids = list(held)
            record, _ = self.call("Complete", queue, self.stubs.complete, queue, partition, ids)
            if record.code == OK:
                record.items = len(ids)
                with self.lock:
                    for item_id in ids:
                        held.pop(item_id, None)

    def read_stats(self) -> None:
        for _ in range(10_000):
            if self.stop_consuming.is_set():
                return
            for queue in self.queues:
                record, reply = self.call("GetQueueStats", queue, self.stubs.stats, queue)
                if reply is not None:
                    record.faulty = sum(1 for p in reply.partitions if p.faulty)
                    record.ready = sum(p.total - p.total_leased for p in reply.partitions)
                    record.failures = tuple(p.failure for p in reply.partitions if p.faulty)
            time.sleep(0.05)


def _first(calls: list[_Call], rpc: str, queue: str, refused: bool) -> _Call | None:
    return next((c for c in calls if c.rpc == rpc and c.queue == queue and (c.code != OK) == refused), None)


def _says_full(message: str) -> bool:
    return "no space left on device" in message.lower() or "storage is full" in message.lower()


def test_a_full_file_system_under_load_is_an_outage_every_caller_sees_and_that_heals_by_itself(
    tmp_path: Path,
) -> None:
    """Producers fill a real 12 MiB file system while consumers and a stats reader run.
    While it is full, every call is an error that says so or a real answer (never an
    empty Lease while items are ready), every partition is reported faulty (stats,
    metrics, health) until space returns, and then all heals with no restart; every
    acknowledged item is delivered exactly once (leases do not run out here)."""
    with tmpfs(tmp_path / "fs", "12m") as mount:
        filler = mount / "filler"  # deleted to give space back
        filler.write_bytes(b"\xff" * (3 << 20))
        metrics_port = free_port()
        proc = ProcessServer(str(mount / "data"), extra_args=["--metrics-address", f"127.0.0.1:{metrics_port}"])
        proc.start()
        try:
            _full_file_system_under_load(proc, filler, metrics_port)
        finally:
            proc.stop()


def _full_file_system_under_load(proc: ProcessServer, filler: Path, metrics_port: int) -> None:
    stubs = connect(proc.address)
    # "grouped" shares a commit group's environment; "own" (past 32 partitions) has its own.
    queues = {"grouped": 4, "own": 40}
    for name, partitions in queues.items():
        stubs.create(name, requested_partitions=partitions, lease_timeout=LONG_LEASE)
    load = _Load(stubs, queues)
    threads = [threading.Thread(target=load.produce, args=(q,)) for q in queues]
    threads += [threading.Thread(target=load.consume, args=(q,)) for q in queues]
    threads.append(threading.Thread(target=load.read_stats))
    for thread in threads:
        thread.start()
    try:
        deadline = time.monotonic() + 90
        while not all(_first(load.calls, "Produce", q, True) for q in queues) and time.monotonic() < deadline:
            time.sleep(0.05)
        full = {q: _first(list(load.calls), "Produce", q, True) for q in queues}
        assert all(full.values()), f"the file system never filled up: {full}"
        time.sleep(3.0)  # the outage, under load
        # While it lasts, every partition is faulty for the metrics and the health check too.
        scrape = urllib.request.urlopen(f"http://127.0.0.1:{metrics_port}/metrics", timeout=10).read().decode()
        health = _health(proc.address, "querator.partitions")
        freed = time.monotonic()
        filler.unlink()  # space returns
        recovered = 0.0
        for _ in range(400):
            with load.lock:
                recent = [c for c in load.calls if c.rpc == "GetQueueStats" and c.started > freed]
            if {c.queue for c in recent if c.code == OK and not c.faulty} == set(queues):
                recovered = time.monotonic()
                break
            time.sleep(0.05)
        assert recovered, "the partitions were still faulty 20 s after space returned"
        load.stop_producing.set()  # before the 3 MiB fill up again
        for queue in queues:  # writes work at once
            for n in range(5):
                payloads = [f"{queue}:after:{n}:{i}".encode() for i in range(20)]
                stubs.produce(queue, payloads)
                load.acked.update(payloads)
        assert _health(proc.address, "querator.partitions") == health_pb2.HealthCheckResponse.SERVING
        time.sleep(0.5)
    finally:
        load.stop_producing.set()
        load.stop_consuming.set()
        for thread in threads:
            thread.join(30)
    calls = load.calls

    # Every call during the outage (sent after its queue's first refusal, answered before
    # space returned): an error that says the storage is full, or a real answer.
    outage = [c for c in calls if c.started > full[c.queue].ended and c.ended < freed]  # type: ignore[union-attr]
    outcomes: dict[str, dict[str, int]] = {}
    for c in outage:
        kind = "ok" if c.code == OK else c.code.name
        if c.rpc == "Lease" and c.code == OK:
            kind = "ok, items" if c.items else "ok, EMPTY"
        outcomes.setdefault(c.rpc, {}).setdefault(kind, 0)
        outcomes[c.rpc][kind] += 1
    summary = (
        f"acknowledged {len(load.acked)} items; outage {freed - min(f.ended for f in full.values()):.1f} s, "  # type: ignore[union-attr]
        f"recovered {recovered - freed:.2f} s after space returned; calls during the outage: {outcomes}"
    )
    print(summary)
    unclear = [c for c in outage if c.code != OK and (c.code not in (UNAVAILABLE, EXHAUSTED) or not _says_full(c.message))]
    assert not unclear, f"{summary}; errors that do not say the disk is full: {unclear[:3]}"
    hidden = [c for c in outage if c.rpc == "Lease" and c.code == OK and not c.items]
    assert not hidden, f"{summary}; Lease answered OK with no items while items were ready: {hidden[:3]}"
    stats = [c for c in outage if c.rpc == "GetQueueStats"]
    assert stats and all(c.ready > 0 for c in stats), "the queues ran dry: the Leases above prove nothing"
    unseen = [c for c in stats if c.faulty != queues[c.queue] or not all(_says_full(f) for f in c.failures)]
    assert not unseen, f"{summary}; stats that did not show every partition faulty with why: {unseen[:3]}"
    gauge = [f'querator_queue_partitions_faulty{{queue="{q}"}} {float(n)}' for q, n in queues.items()]
    assert [line for line in gauge if line not in scrape] == [], "the metrics did not count the faulty partitions"
    assert health == health_pb2.HealthCheckResponse.NOT_SERVING

    # Nothing acknowledged is lost, across a crash too: drain after kill -9 and restart.
    stubs.channel.close()
    proc.kill9()
    proc.start()
    load.stubs = stubs = connect(proc.address)
    try:
        for queue in queues:
            load.complete_pending(queue)
        assert not any(load.pending.values()), "completions of held leases failed after recovery"
        for queue in queues:
            for _ in range(2000):
                reply = stubs.lease(queue, batch_size=100, request_timeout={"nanos": 1_000_000})
                if not reply.items:
                    break
                load.delivered.extend(i.payload for i in reply.items)
                stubs.complete(queue, reply.partition, [i.id for i in reply.items])
            assert stats_total(stubs, queue) == (0, 0)
    finally:
        stubs.channel.close()
    delivered = Counter(load.delivered)
    lost = load.acked - set(delivered)
    unexpected = set(delivered) - load.acked
    duplicates = {p: n for p, n in delivered.items() if n > 1}
    assert (len(lost), len(unexpected), len(duplicates)) == (0, 0, 0), summary


# -- start-up refuses a data directory it cannot trust ----------------------------------------


@pytest.fixture(scope="module")
def template(tmp_path_factory: pytest.TempPathFactory) -> str:
    """A data directory with two queues of 300 items, some leased: "q" (uid 1) in commit
    group 0, and "wide" (uid 2), too wide for a group, in an environment of its own."""
    data = str(tmp_path_factory.mktemp("template") / "data")
    with _served(data) as stubs:
        stubs.create("q", requested_partitions=2, lease_timeout=LONG_LEASE)
        stubs.create("wide", requested_partitions=40, lease_timeout=LONG_LEASE)
        for name in ("q", "wide"):
            for batch in range(3):
                stubs.produce(name, [f"{batch}-{i}".encode() + bytes(1000) for i in range(100)])
            stubs.lease(name, batch_size=10)
    return data


def _garbage(path: str, size: int, *, keep: int = 0) -> None:
    """Overwrite ``path`` from byte ``keep`` on with ``size`` fixed pseudo-random bytes."""
    noise = random.Random(20240611).randbytes(size)
    with open(path, "r+b" if keep else "wb") as f:
        f.seek(keep)
        f.write(noise)


def _truncate(path: str, size: int) -> None:
    os.truncate(path, size)


def _write(path: str, text: str = "not ours") -> None:
    with open(path, "w", encoding="utf-8") as f:
        f.write(text)


QUEUE_FILE = os.path.join("queues", "2", "data.mdb")
GROUP_FILE = os.path.join("groups", "0", "data.mdb")
CATALOG_FILE = os.path.join("catalog", "data.mdb")


def _drop_databases(path: str, prefix: bytes) -> None:
    env = lmdb.open(path, max_dbs=64)
    try:
        with env.begin(write=True) as txn:
            names = [bytes(k) for k, _ in txn.cursor() if bytes(k).startswith(prefix)]
            for name in names:
                txn.drop(env.open_db(name, txn=txn), delete=True)
    finally:
        env.close()


def _file_damage(kind: str, file: str) -> dict[str, tuple[Callable[[str], None], str]]:
    """The ways to damage one LMDB file (a queue's or a group's)."""
    folder = os.path.dirname(file)
    return {
        f"{kind}-garbage": (lambda d: _garbage(os.path.join(d, file), 65536), file),
        f"{kind}-emptied": (lambda d: _truncate(os.path.join(d, file), 0), file),
        f"{kind}-truncated": (lambda d: _truncate(os.path.join(d, file), 3 * 4096), file),
        f"{kind}-pages-corrupt": (
            lambda d: _garbage(os.path.join(d, file), os.path.getsize(os.path.join(d, file)) - 8192, keep=8192),
            file,
        ),
        f"{kind}-file-removed": (lambda d: os.remove(os.path.join(d, file)), file),
        f"{kind}-dir-removed": (lambda d: shutil.rmtree(os.path.join(d, folder)), file),
        f"foreign-in-{kind}-dir": (
            lambda d: _write(os.path.join(d, folder, "data.mdb.old")),
            os.path.join(folder, "data.mdb.old"),
        ),
    }


# name -> (how to damage the data directory, the path the message must name): start-up
# refuses these, since nothing of the directory can be trusted.
DAMAGE: dict[str, tuple[Callable[[str], None], str]] = {
    "catalog-garbage": (lambda d: _garbage(os.path.join(d, CATALOG_FILE), 65536), CATALOG_FILE),
    "catalog-emptied": (lambda d: _truncate(os.path.join(d, CATALOG_FILE), 0), CATALOG_FILE),
    "catalog-removed": (lambda d: shutil.rmtree(os.path.join(d, "catalog")), CATALOG_FILE),
    "foreign-in-queue-dir": _file_damage("queue", QUEUE_FILE)["foreign-in-queue-dir"],
    "foreign-in-group-dir": _file_damage("group", GROUP_FILE)["foreign-in-group-dir"],
    "foreign-top": (lambda d: _write(os.path.join(d, "notes.txt")), "notes.txt"),
    "foreign-in-queues": (lambda d: _write(os.path.join(d, "queues", "backup")), os.path.join("queues", "backup")),
    "foreign-in-groups": (lambda d: _write(os.path.join(d, "groups", "old")), os.path.join("groups", "old")),
    "foreign-in-catalog": (lambda d: _write(os.path.join(d, "catalog", "x.json")), os.path.join("catalog", "x.json")),
}

# name -> (how to damage one queue's storage, the queue that fails, the other one that
# serves, the folder that must stay untouched): the server starts and serves the rest.
QUEUE_DAMAGE: dict[str, tuple[Callable[[str], None], str, str, str]] = {
    **{
        name: (mutate, "wide", "q", os.path.dirname(QUEUE_FILE))
        for name, (mutate, _) in _file_damage("queue", QUEUE_FILE).items()
        if not name.startswith("foreign")
    },
    **{
        name: (mutate, "q", "wide", os.path.dirname(GROUP_FILE))
        for name, (mutate, _) in _file_damage("group", GROUP_FILE).items()
        if not name.startswith("foreign")
    },
    "group-lost-a-queue": (
        lambda d: _drop_databases(os.path.join(d, "groups", "0"), b"q1."), "q", "wide", os.path.dirname(GROUP_FILE)
    ),
}


def _snapshot(root: str) -> dict[str, int]:
    out: dict[str, int] = {}
    for dirpath, _dirs, files in os.walk(root):
        for name in files:
            if name != "lock.mdb":
                path = os.path.join(dirpath, name)
                out[os.path.relpath(path, root)] = os.path.getsize(path)
    return out


@pytest.mark.parametrize("damage", sorted(DAMAGE))
def test_start_up_refuses_a_damaged_or_foreign_data_dir_naming_the_file(
    template: str, tmp_path: Path, damage: str
) -> None:
    data = str(tmp_path / "data")
    shutil.copytree(template, data)
    mutate, named = DAMAGE[damage]
    mutate(data)
    before = _snapshot(data)
    env = dict(os.environ, QUERATOR_LOG_LEVEL="warning")
    env.pop(FAULT_FILE_ENV, None)
    result = subprocess.run(
        [sys.executable, "-m", "querator_server.cli", "--address", f"127.0.0.1:{free_port()}", "--data-dir", data],
        capture_output=True,
        text=True,
        timeout=60,
        env=env,
        check=False,
    )
    assert result.returncode == 1, (result.returncode, result.stderr[-2000:])
    assert os.path.join(data, named) in result.stderr, result.stderr[-2000:]
    assert "Traceback" not in result.stderr, result.stderr[-2000:]
    assert "refusing to start" in result.stderr
    assert _snapshot(data) == before, "a refused start-up changed the data directory"


@pytest.mark.parametrize("damage", sorted(QUEUE_DAMAGE))
def test_a_queue_that_cannot_load_fails_alone(template: str, tmp_path: Path, damage: str) -> None:
    """The server starts; the damaged queue is shown failed and answers UNAVAILABLE with
    why; the other queue serves; nothing of the damaged storage is changed."""
    data = str(tmp_path / "data")
    shutil.copytree(template, data)
    mutate, failed, healthy, folder = QUEUE_DAMAGE[damage]
    mutate(data)
    before = _snapshot(os.path.join(data, folder)) if os.path.isdir(os.path.join(data, folder)) else None
    metrics = f"127.0.0.1:{free_port()}"
    proc = ProcessServer(data, extra_args=["--metrics-address", metrics])
    proc.start()
    stubs = connect(proc.address)
    try:
        info = stubs.queues.GetQueue(queues_pb2.GetQueueRequest(queue_name=failed), timeout=10).queue
        assert info.state == queues_pb2.QUEUE_STATE_FAILED
        assert info.failure and data not in info.failure, info.failure  # why, without the server's paths
        with querator.Client(proc.address) as client:
            assert client.get_queue(failed).failure == info.failure
            assert client.get_queue(healthy).failure == ""
        listed = {q.queue_name: q.state for q in stubs.queues.ListQueues(queues_pb2.ListQueuesRequest(), timeout=10).queues}
        assert listed == {failed: queues_pb2.QUEUE_STATE_FAILED, healthy: queues_pb2.QUEUE_STATE_SERVING}
        for call in (
            lambda: stubs.produce(failed, [b"x"]),
            lambda: stubs.lease(failed, 1),
            lambda: stubs.stats(failed),
            lambda: stubs.list_items(failed),
            lambda: stubs.queues.UpdateQueue(
                queues_pb2.UpdateQueueRequest(
                    queue=queues_pb2.QueueInfo(queue_name=failed, max_attempts=3),
                    update_mask=field_mask_pb2.FieldMask(paths=["max_attempts"]),
                ),
                timeout=10,
            ),
        ):
            code, message = status_of(call)
            assert code == UNAVAILABLE and "has failed" in message and info.failure[:40] in message, (code, message)
        assert stats_total(stubs, healthy) == (300, 10)
        stubs.produce(healthy, [b"more"])
        assert stats_total(stubs, healthy) == (301, 10)
        assert _metric(metrics, "querator_queues_failed") == 1
        assert _metric(metrics, "querator_queues") == 2  # the failed queue is still one of the server's
        assert "queue_failed" in proc.stderr_text()
        # Deleting it needs force (what it holds is unknown); then the name is free again.
        code, _ = status_of(lambda: stubs.queues.DeleteQueue(queues_pb2.DeleteQueueRequest(queue_name=failed), timeout=10))
        assert code == grpc.StatusCode.FAILED_PRECONDITION
        if before is not None:
            assert _snapshot(os.path.join(data, folder)) == before, "the damaged storage was changed"
        stubs.queues.DeleteQueue(queues_pb2.DeleteQueueRequest(queue_name=failed, force=True), timeout=10)
        stubs.create(failed)
        stubs.produce(failed, [b"new"])
        assert stats_total(stubs, failed) == (1, 0)
        assert _metric(metrics, "querator_queues_failed") == 0
        assert _metric(metrics, "querator_queues") == 2
        assert proc.terminate() == 0
    finally:
        stubs.channel.close()
        proc.stop()


def _metric(address: str, name: str) -> float:
    with urllib.request.urlopen(f"http://{address}/metrics", timeout=10) as response:
        for line in response.read().decode().splitlines():
            if line.startswith(name + " "):
                return float(line.split()[1])
    raise AssertionError(f"no {name} in /metrics")


def test_start_up_accepts_lost_found_and_removes_queue_dirs_the_catalog_does_not_know(
    template: str, tmp_path: Path
) -> None:
    """An interrupted delete, or a backup taken while a queue was created (docs: Restore)."""
    data = str(tmp_path / "data")
    shutil.copytree(template, data)
    os.mkdir(os.path.join(data, "lost+found"))
    with _served(data) as stubs:
        stubs.create("gone")  # uid 3
        stubs.queues.DeleteQueue(queues_pb2.DeleteQueueRequest(queue_name="gone"), timeout=10)
    # A crash after the catalog forgot "gone" but before its storage was removed, and
    # queues the backed-up catalog never saw: directories, a whole group, and databases
    # inside a group that the catalog does know.
    shutil.copytree(os.path.join(data, "queues", "2"), os.path.join(data, "queues", "3"))
    shutil.copytree(os.path.join(data, "queues", "2"), os.path.join(data, "queues", "9"))
    shutil.copytree(os.path.join(data, "groups", "0"), os.path.join(data, "groups", "4"))
    env = lmdb.open(os.path.join(data, "groups", "0"), max_dbs=64)
    with env.begin(write=True) as txn:
        for name in (b"q3.p0", b"q9.p0", b"q9.dedup"):
            txn.put(b"x", b"y", db=env.open_db(name, txn=txn))
    env.close()
    with _served(data) as stubs:
        assert sorted(os.listdir(os.path.join(data, "queues"))) == ["2"]
        assert sorted(os.listdir(os.path.join(data, "groups"))) == ["0"]
        for name in ("q", "wide"):
            assert stats_total(stubs, name) == (300, 10)
            assert len(stored(stubs, name)) == 300
    # (Read once the server is gone: LMDB must not open an environment twice in one process.)
    env = lmdb.open(os.path.join(data, "groups", "0"), max_dbs=64, readonly=True, lock=False)
    with env.begin() as txn:
        assert {bytes(k).split(b".")[0] for k, _ in txn.cursor()} == {b"q1"}
    env.close()


def test_a_queue_whose_storage_keeps_failing_is_marked_failed_and_the_rest_serve(tmp_path: Path) -> None:
    """Failing writes to one queue's own environment: calls fail UNAVAILABLE ("retry
    later") while it might recover; past --fail-queue-after of nothing but failures the
    queue is failed (no more retries in a loop), the other queue serves throughout, and
    a restart on repaired storage serves it again with everything acknowledged. A full
    disk never marks a queue failed: it clears up once space is freed."""
    data = str(tmp_path / "data")
    fault = tmp_path / "fault"
    metrics = f"127.0.0.1:{free_port()}"
    proc = ProcessServer(
        data, extra_args=["--fail-queue-after", "1", "--metrics-address", metrics], env={FAULT_FILE_ENV: str(fault)}
    )
    proc.start()
    stubs = connect(proc.address)
    try:
        stubs.create("wide", requested_partitions=40)  # uid 1, queues/1: an environment of its own
        stubs.create("q")
        stubs.produce("wide", [b"kept"])
        # A full disk for longer than --fail-queue-after: refused, never failed.
        fault.write_text(f"{'no-space'} {os.path.join('queues', '1')}")
        give_up = time.monotonic() + 2.5
        while time.monotonic() < give_up:
            code, message = status_of(lambda: stubs.produce("wide", [b"x"]))
            assert code == UNAVAILABLE and "space" in message.lower(), (code, message)
            stubs.produce("q", [b"fine"])
            time.sleep(0.1)
        fault.unlink()
        stubs.produce("wide", [b"after-full"])
        # Failing writes: retryable at first, then the queue is marked failed.
        fault.write_text(f"io-error {os.path.join('queues', '1')}")
        seen: list[str] = []
        give_up = time.monotonic() + 30
        while time.monotonic() < give_up:
            code, message = status_of(lambda: stubs.produce("wide", [b"x"]))
            assert code == UNAVAILABLE, (code, message)
            seen.append(message)
            stubs.produce("q", [b"fine"])  # the other queue serves all along
            if "has failed" in message:
                break
            time.sleep(0.1)
        assert "has failed" in seen[-1] and "retry later" in seen[0], seen[:2] + seen[-1:]
        info = stubs.queues.GetQueue(queues_pb2.GetQueueRequest(queue_name="wide"), timeout=10).queue
        assert info.state == queues_pb2.QUEUE_STATE_FAILED and "failed on every cycle" in info.failure, info.failure
        assert _metric(metrics, "querator_queues_failed") == 1
        fault.unlink()
        time.sleep(0.5)
        # Failed stays failed (no retries in a loop) until the server starts again.
        code, message = status_of(lambda: stubs.produce("wide", [b"x"]))
        assert code == UNAVAILABLE and "has failed" in message
        assert proc.terminate() == 0
        stubs.channel.close()
        proc.start()
        stubs = connect(proc.address)
        info = stubs.queues.GetQueue(queues_pb2.GetQueueRequest(queue_name="wide"), timeout=10).queue
        assert info.state == queues_pb2.QUEUE_STATE_SERVING and not info.failure
        assert sorted(i.payload for i in stored(stubs, "wide")) == [b"after-full", b"kept"]
        stubs.produce("wide", [b"again"])
    finally:
        stubs.channel.close()
        proc.stop()


# -- a dead-letter queue that stays broken ----------------------------------------------


def _events(text: str, event: str) -> list[dict[str, object]]:
    lines = (json.loads(line) for line in text.splitlines() if line.startswith("{"))
    return [line for line in lines if line.get("event") == event]


def _wait_logged(proc: ProcessServer, event: str) -> None:
    """Until the server has logged ``event`` (30 s at most: the caller checks it came)."""
    give_up = time.monotonic() + 30
    while not _events(proc.stderr_text(), event) and time.monotonic() < give_up:
        time.sleep(0.1)


def test_a_broken_dead_letter_queue_is_retried_every_second_but_logged_once_with_a_count(tmp_path: Path) -> None:
    """Dead letters aimed at a DLQ whose writes fail are retried on their cadence; the
    first failure is logged, the retries after it within the minute are not (each line
    says how many failed since the last), and the success after them is logged once
    with how many retries failed."""
    data = str(tmp_path / "data")
    fault = tmp_path / "fault"
    proc = ProcessServer(data, extra_args=["--log-level", "info", "--log-json"], env={FAULT_FILE_ENV: str(fault)})
    proc.start()
    stubs = connect(proc.address)
    try:
        stubs.create("dlq", requested_partitions=40)  # uid 1, queues/1: an environment of its own
        stubs.create("q", dead_queue="dlq", lease_timeout=LONG_LEASE)
        stubs.produce("q", [b"doomed"])
        lease = stubs.lease("q", batch_size=1)
        fault.write_text(f"no-space {os.path.join('queues', '1')}")
        stubs.queue.Retry(
            queue_pb2.RetryRequest(queue_name="q", partition=lease.partition, items=[queue_pb2.RetryItem(id=lease.items[0].id, dead=True)]),
            timeout=10,
        )
        _wait_logged(proc, "dead_letter_failed")
        first = _events(proc.stderr_text(), "dead_letter_failed")
        assert len(first) == 1, proc.stderr_text()[-2000:]
        assert first[0]["queue"] == "q" and first[0]["dead_queue"] == "dlq" and first[0]["failures"] == 1, first
        time.sleep(5)  # about five more retries, one a second
        assert len(_events(proc.stderr_text(), "dead_letter_failed")) == 1, proc.stderr_text()[-2000:]
        assert stats_total(stubs, "dlq") == (0, 0)

        fault.unlink()
        _wait_logged(proc, "dead_letter_recovered")
        recovered = _events(proc.stderr_text(), "dead_letter_recovered")
        assert len(recovered) == 1, proc.stderr_text()[-2000:]
        assert recovered[0]["queue"] == "q" and recovered[0]["dead_queue"] == "dlq", recovered
        failures = recovered[0]["failures"]
        assert isinstance(failures, int) and failures >= 4, recovered  # retries that failed, one line for them
        assert stats_total(stubs, "dlq") == (1, 0) and stats_total(stubs, "q") == (0, 0)
        assert proc.terminate() == 0
    finally:
        stubs.channel.close()
        proc.stop()


def test_a_redrive_into_a_broken_queue_is_retried_but_logged_once_with_a_count(tmp_path: Path) -> None:
    """Items a redrive took out of a dead-letter queue wait in its outbox while their
    target cannot store them: retried every second, logged on the first failure and on
    the success after them, and delivered once the target works again."""
    data = str(tmp_path / "data")
    fault = tmp_path / "fault"
    proc = ProcessServer(data, extra_args=["--log-level", "info", "--log-json"], env={FAULT_FILE_ENV: str(fault)})
    proc.start()
    stubs = connect(proc.address)
    try:
        stubs.create("q", requested_partitions=40, lease_timeout=LONG_LEASE)  # uid 1, queues/1: its own environment
        stubs.create("dlq")
        stubs.queues.UpdateQueue(
            queues_pb2.UpdateQueueRequest(
                queue=queues_pb2.QueueInfo(queue_name="q", dead_queue="dlq"),
                update_mask=field_mask_pb2.FieldMask(paths=["dead_queue"]),
            ),
            timeout=10,
        )
        stubs.produce("q", [b"revived"])
        lease = stubs.lease("q", batch_size=1)
        stubs.queue.Retry(
            queue_pb2.RetryRequest(queue_name="q", partition=lease.partition, items=[queue_pb2.RetryItem(id=lease.items[0].id, dead=True)]),
            timeout=10,
        )
        give_up = time.monotonic() + 30
        while stats_total(stubs, "dlq") != (1, 0) and time.monotonic() < give_up:
            time.sleep(0.1)
        assert stats_total(stubs, "dlq") == (1, 0)
        fault.write_text(f"no-space {os.path.join('queues', '1')}")
        code, _ = status_of(lambda: stubs.storage.RedriveItems(storage_pb2.RedriveItemsRequest(queue_name="dlq"), timeout=2))
        assert code == grpc.StatusCode.DEADLINE_EXCEEDED  # taken out of dlq, not yet stored in q
        _wait_logged(proc, "redrive_failed")
        time.sleep(5)  # about five more retries, one a second
        failed = _events(proc.stderr_text(), "redrive_failed")
        assert len(failed) == 1 and failed[0]["queue"] == "dlq" and failed[0]["failures"] == 1, proc.stderr_text()[-2000:]

        fault.unlink()
        _wait_logged(proc, "redrive_recovered")
        recovered = _events(proc.stderr_text(), "redrive_recovered")
        assert len(recovered) == 1 and recovered[0]["queue"] == "dlq", proc.stderr_text()[-2000:]
        assert isinstance(recovered[0]["failures"], int) and recovered[0]["failures"] >= 4, recovered
        assert stats_total(stubs, "q") == (1, 0) and stats_total(stubs, "dlq") == (0, 0)
        assert proc.terminate() == 0
    finally:
        stubs.channel.close()
        proc.stop()


def test_repeated_failure_reports_the_first_then_once_per_interval_with_the_count() -> None:
    now = [0.0]
    failure = RepeatedFailure(60.0, clock=lambda: now[0])
    reported = []
    for _ in range(150):  # one failure a second for 150 s
        reported.append(failure.failed())
        now[0] += 1.0
    lines = [(second, n) for second, n in enumerate(reported) if n]
    assert lines == [(0, 1), (60, 60), (120, 60)]
    assert failure.failures == 150


def test_a_fault_file_caught_empty_while_rewritten_names_no_fault(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Rewriting the fault file truncates it first. A stalled commit polls the file, and
    one that read it empty took that for ``no-space``: its calls failed with a full disk
    nobody had asked for (seen in CI as test_isolation's lifecycle test failing on
    'No space left on device (injected fault)')."""
    fault = tmp_path / "fault"
    monkeypatch.setenv(FAULT_FILE_ENV, str(fault))
    fault.write_text("")
    assert write_fault("queues/1") == ""
    fault.write_text("stall")
    met: list[str] = []
    commit = threading.Thread(target=lambda: met.append(write_fault("queues/1")))
    commit.start()
    time.sleep(0.1)  # stalled: polling the file every 10 ms
    fault.write_text("")  # caught between truncating and writing, for many polls
    time.sleep(0.1)
    fault.unlink()
    commit.join(timeout=10)
    assert met == [""]
