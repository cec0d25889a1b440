"""The on-disk format version: what this server reads, upgrades and refuses."""

from __future__ import annotations

import json
import os
import time
from pathlib import Path

import grpc
import lmdb
import pytest

from querator.v1 import queue_pb2
from querator_server.storage import Item, QueueStore
from querator_server.storage.local_catalog import Catalog, CatalogError
from querator_server.storage.record import expiry_key, item_key, read_state, with_lease, without_lease

from conftest import Stubs, ThreadServer

CURRENT = b"querator-catalog-7"


def _stamp(path: Path, version: bytes) -> None:
    env = lmdb.open(str(path), max_dbs=4)
    with env.begin(write=True) as txn:
        txn.put(b"format", version, db=env.open_db(b"meta", txn=txn))
    env.close()


def _format(path: Path) -> bytes | None:
    env = lmdb.open(str(path), max_dbs=4, readonly=True)
    with env.begin() as txn:
        found = txn.get(b"format", db=env.open_db(b"meta", txn=txn, create=False))
    env.close()
    return found


@pytest.mark.parametrize(
    "older",
    [
        b"querator-catalog-1",
        b"querator-catalog-2",
        b"querator-catalog-3",
        b"querator-catalog-4",
        b"querator-catalog-5",
        b"querator-catalog-6",
    ],
)
def test_an_older_catalog_is_read_and_stamped_with_the_current_format(tmp_path: Path, older: bytes) -> None:
    path = tmp_path / "catalog"
    Catalog(str(path)).env.close()
    _stamp(path, older)
    catalog = Catalog(str(path))
    assert catalog.load() == []
    catalog.env.close()
    assert _format(path) == CURRENT  # an older server now refuses it


def test_an_unknown_catalog_format_is_refused_by_name(tmp_path: Path) -> None:
    path = tmp_path / "catalog"
    Catalog(str(path)).env.close()
    _stamp(path, b"querator-catalog-9")
    with pytest.raises(CatalogError, match="unknown catalog format b'querator-catalog-9'"):
        Catalog(str(path))


def test_items_indexed_one_by_one_as_format_1_stored_them_still_expire(tmp_path: Path) -> None:
    store = QueueStore(str(tmp_path / "q"), 1, map_size=1 << 22, sync=False)
    try:
        deadline = 1_800_000_000_000_000

        def store_as_format_1(txn: lmdb.Transaction[bytes]) -> None:
            for seq in (1, 2, 3):
                txn.put(item_key(seq), Item(b"%d" % seq, expire_deadline=deadline).encode(), db=store.db(0))
                txn.put(expiry_key(deadline, item_key(seq)), b"", db=store.db(0))

        store.write(store_as_format_1)
        entries, next_deadline = store.write(lambda txn: store.expired(txn, 0, deadline, 10))
        assert [(key, item.payload) for key, item in entries] == [(item_key(seq), b"%d" % seq) for seq in (1, 2, 3)]
        assert next_deadline == 0
    finally:
        store.close()


def _as_format_2(data_dir: Path) -> None:
    """Make a data directory look as a server of catalog format 2 left it: the format
    stamp, and queue settings without the "group" that format 3 added."""
    env = lmdb.open(str(data_dir / "catalog"), max_dbs=4)
    with env.begin(write=True) as txn:
        txn.put(b"format", b"querator-catalog-2", db=env.open_db(b"meta", txn=txn))
        queues = env.open_db(b"queues", txn=txn)
        for key, raw in list(txn.cursor(db=queues)):
            settings = json.loads(raw)
            assert settings.pop("group") == -1
            txn.put(key, json.dumps(settings).encode(), db=queues)
    env.close()


def test_a_format_2_data_directory_keeps_its_queues_where_they_are_and_groups_new_ones(tmp_path: Path) -> None:
    data = tmp_path / "data"
    server = ThreadServer(str(data), commit_groups=False)
    try:
        with grpc.insecure_channel(server.address) as channel:
            stubs = Stubs(channel)
            stubs.create("old", requested_partitions=2)
            stubs.produce("old", [f"old {i}".encode() for i in range(10)])
            leased = stubs.lease("old", batch_size=3)
    finally:
        server.stop()
    _as_format_2(data)

    server = ThreadServer(str(data))
    try:
        with grpc.insecure_channel(server.address) as channel:
            stubs = Stubs(channel)
            stubs.create("new")
            stubs.produce("new", [b"new"])
            stubs.complete("old", leased.partition, [item.id for item in leased.items])
            totals = [(p.total, p.total_leased) for p in stubs.stats("old").partitions]
            assert sum(t for t, _ in totals) == 7 and sum(leased for _, leased in totals) == 0
    finally:
        server.stop()
    assert sorted(os.listdir(data / "queues")) == ["1"] and sorted(os.listdir(data / "groups")) == ["0"]
    assert _format(data / "catalog") == CURRENT


# Records as a server of catalog format 3 wrote them (no history block): a leased item
# with every string, and a fresh payload-only one. Kept as bytes, not re-encoded, so a
# change of the record layout that misreads them fails here.
FORMAT_3_RICH = bytes.fromhex(
    "010300000000401e18240a0600008098281765060000c7b11b240a0600000000000000000000401e18240a060006"
    "0000000400000004000000040000000200000009000000372e302e3166726566206a736f6e6b696e646b317b226b"
    "223a2276227d7061796c6f6164"
)
FORMAT_3_PLAIN = bytes.fromhex(
    "020000000000401e18240a0600008098281765060000000000000000000000000000000000000000000000000000"
    "000000000000000000000000000000000000000000000062617265"
)


def test_records_of_format_3_read_as_they_were_written() -> None:
    rich = Item.decode(FORMAT_3_RICH)
    assert rich == Item(
        payload=b"payload",
        encoding="json",
        kind="kind",
        reference="ref ",
        source_id="7.0.1f",
        created_at=1_700_000_000_000_000,
        expire_deadline=1_800_000_000_000_000,
        enqueue_at=0,
        attempts=3,
        is_leased=True,
        lease_deadline=1_700_000_060_000_000,
        leased_at=1_700_000_000_000_000,
        lease_key="k1",
        metadata={"k": "v"},
    )
    assert rich.message_id == "" and rich.dead_reason == 0
    plain = Item.decode(FORMAT_3_PLAIN)
    assert (plain.payload, plain.expiry_run, plain.message_id) == (b"bare", True, "")
    # A record without history is still written byte for byte as format 3 wrote it.
    assert plain.encode() == FORMAT_3_PLAIN and rich.encode() == FORMAT_3_RICH


def test_a_format_3_data_directory_serves_its_items_and_their_new_fields(tmp_path: Path) -> None:
    """A data directory as a server of format 3 left it (records without history):
    its items lease, re-queue (gaining a history) and list; the stamp becomes current."""
    data = tmp_path / "data"
    server = ThreadServer(str(data))
    try:
        with grpc.insecure_channel(server.address) as channel:
            stubs = Stubs(channel)
            stubs.create("old", requested_partitions=1)
            ids = list(stubs.produce("old", [b"a", b"b"]).ids)
    finally:
        server.stop()
    _stamp(data / "catalog", b"querator-catalog-3")

    server = ThreadServer(str(data))
    try:
        with grpc.insecure_channel(server.address) as channel:
            stubs = Stubs(channel)
            leased = stubs.lease("old", batch_size=2)
            assert [(i.id, i.message_id, i.payload) for i in leased.items] == [(ids[0], ids[0], b"a"), (ids[1], ids[1], b"b")]
            stubs.queue.Retry(
                queue_pb2.RetryRequest(queue_name="old", partition=0, items=[queue_pb2.RetryItem(id=ids[0])]), timeout=10
            )
            (requeued,) = [i for i in stubs.list_items("old") if i.payload == b"a"]
            assert requeued.id != ids[0] and requeued.message_id == ids[0]
    finally:
        server.stop()
    assert _format(data / "catalog") == CURRENT


# Records as a server of catalog format 4 wrote them (a history block, no last error):
# a dead letter in its dead-letter queue, and an item re-queued twice (an expiry run's).
# Made by that server's encoder and kept as bytes, as FORMAT_3_* are.
FORMAT_4_DEAD = bytes.fromhex(
    "040000000000401e18240a0600ff5f73cc0c44840300000000000000000000000000000000000000000000000006"
    "0000000000000000000000050000000000000000000000372e302e3166656d61696c010021141e240a06000500"
    "000006000000372e302e31617061796c6f6164"
)
FORMAT_4_REQUEUED = bytes.fromhex(
    "060200000000401e18240a06000080982817650600000000000000000000000000000000000000000000000000"
    "0000000000000000000000000000000000000000000000000000000000000000000000000006000000372e302e"
    "3162616761696e"
)


def test_records_of_format_4_read_as_they_were_written_with_no_error() -> None:
    dead = Item.decode(FORMAT_4_DEAD)
    assert dead == Item(
        payload=b"payload",
        kind="email",
        source_id="7.0.1f",
        created_at=1_700_000_000_000_000,
        expire_deadline=253_402_300_799_999_999,
        message_id="7.0.1a",
        dead_reason=1,
        dead_at=1_700_000_100_000_000,
        dead_attempts=5,
    )
    assert (dead.last_error, dead.last_error_at) == ("", 0)
    requeued = Item.decode(FORMAT_4_REQUEUED)
    assert (requeued.payload, requeued.attempts, requeued.message_id, requeued.expiry_run) == (b"again", 2, "7.0.1b", True)
    assert requeued.last_error == ""
    # A record without an error is still written byte for byte as format 4 wrote it.
    assert dead.encode() == FORMAT_4_DEAD and requeued.encode() == FORMAT_4_REQUEUED


def test_a_last_error_round_trips_through_the_record_and_lease_rewrites() -> None:
    item = Item(payload=b"p", kind="k", message_id="7.0.1", last_error="ValueError: \u00e9\n  at f", last_error_at=1_700_000_000_000_001)
    raw = item.encode()
    assert Item.decode(raw) == item
    state = read_state(raw)
    leased = with_lease(raw, state, attempts=3, deadline=5, leased_at=4)
    assert Item.decode(leased).last_error == item.last_error and Item.decode(leased).payload == b"p"
    # Giving a lease back keeps the history and the error (it used to drop the history
    # flag, so the block was then read as the start of the payload).
    ready = Item.decode(without_lease(leased, read_state(leased), attempts=2))
    assert (ready.payload, ready.message_id, ready.last_error, ready.attempts) == (b"p", "7.0.1", item.last_error, 2)


def test_a_format_4_data_directory_serves_its_dead_letters_and_takes_errors(tmp_path: Path) -> None:
    """A data directory as a server of format 4 left it (histories without errors):
    its dead letters and re-queued items list and lease with no error, a Retry gives
    them one, and the stamp becomes current. Its records are the ones format 4 wrote:
    records without an error encode byte for byte as before (test above)."""
    data = tmp_path / "data"
    server = ThreadServer(str(data))
    try:
        with grpc.insecure_channel(server.address) as channel:
            stubs = Stubs(channel)
            stubs.create("dlq", requested_partitions=1)
            stubs.create("old", requested_partitions=1, dead_queue="dlq")
            stubs.produce("old", [b"dies", b"comes back"])
            leased = {i.payload: i.id for i in stubs.lease("old", batch_size=2).items}
            items = [queue_pb2.RetryItem(id=leased[b"dies"], dead=True), queue_pb2.RetryItem(id=leased[b"comes back"])]
            stubs.queue.Retry(queue_pb2.RetryRequest(queue_name="old", partition=0, items=items), timeout=10)
            deadline = time.monotonic() + 10
            while not stubs.list_items("dlq") and time.monotonic() < deadline:
                time.sleep(0.02)
    finally:
        server.stop()
    _stamp(data / "catalog", b"querator-catalog-4")

    server = ThreadServer(str(data))
    try:
        with grpc.insecure_channel(server.address) as channel:
            stubs = Stubs(channel)
            (letter,) = stubs.list_items("dlq")
            assert (letter.payload, letter.dead_reason, letter.last_error) == (b"dies", 3, "")
            assert not letter.HasField("last_error_at")
            (back,) = stubs.lease("old", batch_size=1).items
            assert (back.payload, back.last_error) == (b"comes back", "")
            failed = queue_pb2.RetryItem(id=back.id, error="ValueError: now it says why")
            stubs.queue.Retry(queue_pb2.RetryRequest(queue_name="old", partition=0, items=[failed]), timeout=10)
            (listed,) = stubs.list_items("old")
            assert (listed.message_id, listed.last_error) == (back.message_id, "ValueError: now it says why")
    finally:
        server.stop()
    assert _format(data / "catalog") == CURRENT
