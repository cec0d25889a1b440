"""Ordered groups in storage: the record's group block, old data, and kill -9 at the
writes groups add (a grouped produce, a head's completion moving the next item up)."""

from __future__ import annotations

import random
import threading
import time
from collections import defaultdict
from pathlib import Path

import grpc
import lmdb

from querator.v1 import queue_pb2
from querator_server.storage.record import (
    Item,
    group_of,
    grouped,
    read_state,
    with_lease,
    with_lease_key,
    without_lease,
)

from conftest import ProcessServer, Stubs, ThreadServer, dur


def test_a_group_key_round_trips_with_the_history_and_through_lease_rewrites() -> None:
    item = Item(
        payload=b"p",
        kind="k",
        message_id="7.0.1",
        dead_reason=2,
        last_error="ValueError",
        last_error_at=5,
        group_key="order-\u00e9",
    )
    raw = item.encode()
    assert Item.decode(raw) == item
    assert grouped(raw) and group_of(raw) == "order-\u00e9" == read_state(raw).group_key
    leased = with_lease(raw, read_state(raw), attempts=3, deadline=9, leased_at=4)
    keyed = with_lease_key(leased, attempts=4, deadline=10, leased_at=5, lease_key="lk")
    back = without_lease(keyed, read_state(keyed), attempts=2)
    for rewritten in (leased, keyed, back):
        decoded = Item.decode(rewritten)
        assert (decoded.group_key, decoded.dead_reason, decoded.last_error, decoded.payload) == ("order-\u00e9", 2, "ValueError", b"p")
        assert group_of(rewritten) == "order-\u00e9"
    # A fresh grouped item: a history block holding only the group.
    fresh = Item(payload=b"x", group_key="g").encode()
    assert Item.decode(fresh) == Item(payload=b"x", group_key="g") and Item.decode(fresh).dead_reason == 0
    # Records of no group: no block, no group, written as before.
    plain = Item(payload=b"x", message_id="7.0.2").encode()
    assert not grouped(plain) and group_of(plain) == "" and read_state(plain).group_key == ""
    assert not grouped(Item(payload=b"x").encode())


def _stamp(path: Path, version: bytes) -> None:
    env = lmdb.open(str(path), max_dbs=4)
    with env.begin(write=True) as txn:
        txn.put(b"format", version, db=env.open_db(b"meta", txn=txn))
    env.close()


def test_a_format_5_data_directory_serves_as_it_was_and_takes_groups(tmp_path: Path) -> None:
    """Data of the format before groups (no group keys anywhere) opens and serves
    unchanged; grouped items then go into the same partitions beside the old ones."""
    data = tmp_path / "data"
    server = ThreadServer(str(data))
    try:
        with grpc.insecure_channel(server.address) as channel:
            stubs = Stubs(channel)
            stubs.create("old", requested_partitions=2, lease_timeout=dur(60))
            stubs.produce("old", [b"old-1", b"old-2"])
            leased = stubs.lease("old", batch_size=1)
    finally:
        server.stop()
    _stamp(data / "catalog", b"querator-catalog-5")
    server = ThreadServer(str(data))
    try:
        with grpc.insecure_channel(server.address) as channel:
            stubs = Stubs(channel)
            stats = stubs.stats("old")
            assert sum(p.total for p in stats.partitions) == 2 and sum(p.groups_in_flight for p in stats.partitions) == 0
            stubs.complete("old", leased.partition, [leased.items[0].id])
            request = queue_pb2.ProduceRequest(
                queue_name="old", items=[queue_pb2.ProduceItem(group_key="A", payload=p) for p in (b"A1", b"A2")]
            )
            stubs.queue.Produce(request, timeout=10)
            got = sorted(i.payload for i in stubs.lease("old", batch_size=10).items)
            got += sorted(i.payload for i in stubs.lease("old", batch_size=10, request_timeout=dur(0.2)).items)
            assert sorted(got) == [b"A1", b"old-2"]
    finally:
        server.stop()


class _Ledger:
    def __init__(self) -> None:
        self.produced: dict[str, list[int]] = defaultdict(list)  # acknowledged, per group
        self.delivered: dict[str, list[int]] = defaultdict(list)
        self.completed: dict[str, set[int]] = defaultdict(set)  # acknowledged
        self.lock = threading.Lock()


def _worker(address: str, ledger: _Ledger, stop: threading.Event, seed: int) -> None:
    rng = random.Random(seed)
    channel = grpc.insecure_channel(address)
    stubs = Stubs(channel)
    try:
        while not stop.is_set():
            key = f"w{seed}-g{rng.randrange(4)}"  # each worker produces its own groups, in order
            with ledger.lock:
                n = ledger.produced[key][-1] + 1 if ledger.produced[key] else 0
            batch = [n + i for i in range(rng.randint(1, 5))]
            try:
                request = queue_pb2.ProduceRequest(
                    queue_name="crash", items=[queue_pb2.ProduceItem(group_key=key, payload=f"{key}/{i}".encode()) for i in batch]
                )
                stubs.queue.Produce(request, timeout=5)
                with ledger.lock:
                    ledger.produced[key].extend(batch)
                got = stubs.lease("crash", batch_size=10, request_timeout=dur(0.05), timeout=5)
                with ledger.lock:
                    for item in got.items:
                        k, i = item.payload.decode().split("/")
                        ledger.delivered[k].append(int(i))
                if got.items:
                    stubs.complete("crash", got.partition, [item.id for item in got.items])
                    with ledger.lock:
                        for item in got.items:
                            k, i = item.payload.decode().split("/")
                            ledger.completed[k].add(int(i))
            except grpc.RpcError:
                return  # the server was killed
    finally:
        channel.close()


def test_kill9_at_grouped_produce_and_release_keeps_each_group_whole_and_in_order(data_dir: str) -> None:
    """Workers produce grouped items, lease and complete them (each completion moves the
    group's next item up) while the server is killed -9, five times. After each restart
    every acknowledged item is there once, each group hands out one item at a time in
    produce order, and the counts match."""
    proc = ProcessServer(data_dir)
    proc.start()
    try:
        with grpc.insecure_channel(proc.address) as channel:
            Stubs(channel).create("crash", requested_partitions=2, lease_timeout=dur(60))
        ledger = _Ledger()
        for round_ in range(5):
            stop = threading.Event()
            workers = [threading.Thread(target=_worker, args=(proc.address, ledger, stop, round_ * 10 + i)) for i in range(2)]
            for w in workers:
                w.start()
            time.sleep(random.Random(round_).uniform(0.3, 1.2))
            proc.kill9()
            stop.set()
            for w in workers:
                w.join(15)
                assert not w.is_alive()
            proc.start()
            with grpc.insecure_channel(proc.address) as channel:
                stubs = Stubs(channel)
                stats = stubs.stats("crash").partitions
                # Leases held before the crash: give them back by letting them run out
                # would take a minute; complete what storage still holds leased instead.
                for p in range(2):
                    listed = stubs.list_items("crash", partition=p)
                    held = [i for i in listed if i.is_leased]
                    assert len({i.group_key for i in held}) == len(held), "a group had two items in flight"
                    assert sum(1 for i in held if i.group_key) == stats[p].groups_in_flight
                    if held:
                        stubs.complete("crash", p, [i.id for i in held])
                        with ledger.lock:
                            for i in held:
                                k, n = i.payload.decode().split("/")
                                ledger.completed[k].add(int(n))
                                # Leased before the kill (its reply maybe lost with the
                                # worker): delivered, if the worker never saw it.
                                if int(n) not in ledger.delivered[k]:
                                    ledger.delivered[k].append(int(n))
        # Drain what is left: every group's items come in produce order.
        with grpc.insecure_channel(proc.address) as channel:
            stubs = Stubs(channel)
            deadline = time.monotonic() + 60
            while time.monotonic() < deadline:
                got = stubs.lease("crash", batch_size=50, request_timeout=dur(0.3), timeout=5)
                if not got.items:
                    if sum(p.total for p in stubs.stats("crash").partitions) == 0:
                        break
                    continue
                for item in got.items:
                    k, i = item.payload.decode().split("/")
                    ledger.delivered[k].append(int(i))
                    ledger.completed[k].add(int(i))
                stubs.complete("crash", got.partition, [item.id for item in got.items])
            assert sum(p.total for p in stubs.stats("crash").partitions) == 0
    finally:
        proc.stop()
    assert sum(map(len, ledger.produced.values())) >= 20  # the loop really ran
    for key, produced in ledger.produced.items():
        # Every acknowledged item was delivered; an unacknowledged produce that landed
        # adds items past the acknowledged ones, never between them.
        delivered = ledger.delivered[key]
        assert set(produced) <= set(delivered), key
        first_time = list(dict.fromkeys(delivered))
        assert first_time == sorted(first_time), f"{key} out of order: {first_time}"
