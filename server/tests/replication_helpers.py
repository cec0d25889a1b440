"""Replicated queues in tests: in one process, a primary actor on real LMDB whose
change sets go, encoded and decoded, to copies on real LMDB, a randomized workload of
client calls that exercises every kind of write a cycle makes, and a shard whose copies
talk through real Peer servers; on node processes (cluster_helpers.Cluster), where a
queue's copies are and its items' ways in and out."""

from __future__ import annotations

import asyncio
import json
import os
import random
import time
from collections import Counter
from collections.abc import AsyncIterator, Awaitable, Callable, Iterator
from contextlib import asynccontextmanager
from dataclasses import dataclass, field
from typing import Any

import grpc
import pytest
from cluster_helpers import Cluster, Etcd, Node
from google.protobuf.wrappers_pb2 import BytesValue

from querator.v1 import cluster_pb2, cluster_pb2_grpc, queue_pb2, storage_pb2
from querator_server.actor import (
    CompleteRequest,
    DeleteItemsRequest,
    ExtendRequest,
    ImportItemsRequest,
    LeaseRequest,
    LeaseResult,
    LogicalQueue,
    ProduceRequest,
    RetryRequest,
)
from querator_server.actor.replication import Replication
from querator_server.clock import now_us
from querator_server.cluster.catalog import Member
from querator_server.cluster.etcd import Etcd as EtcdClient
from querator_server.cluster.etcd import Txn
from querator_server.cluster.forwarding import Peers
from querator_server.cluster.give_back import SERVICE, GiveBacks
from querator_server.cluster.shard_record import ShardRecord
from querator_server.errors import QueratorError
from querator_server.grpc_api.peer_service import PeerService
from querator_server.model import ImportedItem, NewItem, QueueConfig, RetryOrder
from querator_server.storage import QueueStore
from querator_server.storage.change_set import ChangeSet, Position
from querator_server.storage.commit_group import CommitGroup
from querator_server.storage.group_layout import open_group_env, queue_prefix
from querator_server.storage.lane import StorageLane
from querator_server.storage.replica_copy import ReplicaCopy
from querator_server.storage.replica_state import ReplicaState

from conftest import wait_until

# A shard uid as the cluster hands them out: never one of a data dir's own.
SHARD_UID = (1 << 40) + 5
MS = 1_000


def shard_config(name: str = "q", uid: int = SHARD_UID, partitions: int = 2, dead_queue: str = "dlq") -> QueueConfig:
    """Short timeouts, so that a few seconds of load see leases run out, items expire
    and dead-letter, and idempotency and lease keys be forgotten."""
    return QueueConfig(
        name=name,
        uid=uid,
        partitions=partitions,
        dead_queue=dead_queue,
        lease_timeout_us=250 * MS,
        expire_timeout_us=1_500 * MS,
        max_attempts=3,
        dedup_window_us=600 * MS,
        lease_key_ttl_us=600 * MS,
    )


@dataclass
class Home:
    """Where a queue's store lives: a directory of its own, or a commit group."""

    lane: StorageLane
    group: CommitGroup | None = None

    async def open(self, path: str, uid: int, partitions: int) -> QueueStore:
        group = self.group
        if group is None:
            return await asyncio.get_running_loop().run_in_executor(self.lane, lambda: QueueStore(path, partitions))
        store = await group.job(lambda: QueueStore(group.path, partitions, shared=group.env, prefix=queue_prefix(uid)))
        group.members += 1
        return store

    async def job(self, fn: Callable[[], Any]) -> Any:
        if self.group is not None:
            return await self.group.job(fn)
        return await asyncio.get_running_loop().run_in_executor(self.lane, fn)

    async def close(self) -> None:
        if self.group is not None:
            await self.group.close()


def make_home(root: str, name: str, grouped: bool) -> Home:
    lane = StorageLane(f"test-{name}")
    if not grouped:
        return Home(lane)
    path = os.path.join(root, name)
    return Home(lane, CommitGroup(open_group_env(path, map_size=1 << 26, sync=True), path, lane))


async def apply_to(home: Home, state: ReplicaState, change: ChangeSet) -> Position:
    """Apply ``change`` to a copy durably: in a transaction of its own, or in its commit
    group's next commit."""
    if home.group is None:
        position: Position = await home.job(lambda: state.apply_now(change))
        return position
    await home.group.job(lambda: state.prepare(change))
    applied, durable = await home.group.run(lambda txn: state.apply(txn, change))
    await durable
    if applied:
        state.committed(change)
    return state.position()


@dataclass
class Mirror(Replication):
    """A ``Replication`` that applies every change set to copies before it returns,
    one at a time in the order handed, and checks after each that every copy's digest
    is the primary's as it was when the change was handed over (whenever the primary
    still stood at that change: it may have committed the next already)."""

    copies: list[tuple[Home, ReplicaState]]
    primary: Callable[[], ReplicaState | None] = lambda: None
    changes: int = 0
    compared: int = 0
    roles: set[str] = field(default_factory=set)
    # (key tag, deleted) of the partitions' writes: what kinds of records changed.
    tags: set[tuple[bytes, bool]] = field(default_factory=set)
    # Raise on this change (lsn) and after: 0: never.
    fail_from: int = 0
    _order: asyncio.Lock = field(default_factory=asyncio.Lock)

    async def replicated(self, change: ChangeSet) -> None:
        if self.fail_from and change.lsn >= self.fail_from:
            raise QueratorError(f"replica unreachable (test: from change {self.fail_from})")
        primary = self.primary()
        seen = primary.digest() if primary is not None else None
        data = change.encode()
        copy = ChangeSet.decode(data)
        assert copy == change
        async with self._order:
            self.changes += 1
            self.roles.update(role for role, _, _ in change.ops)
            self.tags.update((key[:1], value is None) for role, key, value in change.ops if role[:1] == "p")
            for home, state in self.copies:
                assert await apply_to(home, state, copy) == change.position
            if seen is not None and seen[0] == change.position:
                for _home, state in self.copies:
                    assert state.digest() == seen, f"copy differs from the primary after change {change.lsn}"
                self.compared += 1


@dataclass
class Tally:
    ok: int = 0
    failed: int = 0
    dead_lettered: int = 0
    kinds: set[str] = field(default_factory=set)


async def _call(actor: LogicalQueue, request: Any, tally: Tally) -> Any:
    try:
        result = await actor.submit(request)
    except QueratorError:
        tally.failed += 1
        return None
    tally.ok += 1
    tally.kinds.add(type(request).__name__)
    return result


async def client(actor: LogicalQueue, rng: random.Random, calls: int, until: float, tally: Tally) -> None:
    """``calls`` random calls (or until ``until``, monotonic): produce (bare, with
    idempotency keys, scheduled, payload-only), import (with source ids, some leased),
    lease (with and without lease keys), complete, retry (now, later, dead), extend,
    delete, and leases left to run out."""
    held: list[tuple[int, str]] = []
    for _ in range(calls):
        if time.monotonic() > until:
            return
        roll = rng.random()
        now = now_us()
        if roll < 0.25:
            items = []
            for _ in range(rng.randint(1, 4)):
                key = f"k{rng.randrange(40)}" if rng.random() < 0.4 else ""
                at = now + rng.randint(120, 400) * MS if rng.random() < 0.2 else 0
                meta = {"m": str(rng.randrange(9))} if rng.random() < 0.2 else {}
                items.append(NewItem(payload=rng.randbytes(rng.randint(0, 40)), idempotency_key=key, enqueue_at_us=at, metadata=meta))
            await _call(actor, ProduceRequest(items=items), tally)
        elif roll < 0.30:
            await _call(actor, ProduceRequest(items=[], payloads=[rng.randbytes(8) for _ in range(rng.randint(1, 20))]), tally)
        elif roll < 0.32:
            imported = [
                ImportedItem(payload=b"imported", source_id=f"s{rng.randrange(1000)}", is_leased=rng.random() < 0.3, attempts=1)
                for _ in range(rng.randint(1, 3))
            ]
            await _call(actor, ImportItemsRequest(partition=rng.randrange(2), items=imported), tally)
        elif roll < 0.55:
            key = f"L{rng.randrange(10)}" if rng.random() < 0.3 else ""
            lease = LeaseRequest(batch_size=rng.randint(1, 5), client_id="", wait_until_us=0, lease_key=key)
            result = await _call(actor, lease, tally)
            if isinstance(result, LeaseResult):
                held.extend((result.partition, item_id) for item_id in result.ids)
        elif held:
            rng.shuffle(held)
            p = held[0][0]
            mine = [item_id for q, item_id in held[:3] if q == p]
            held = [entry for entry in held if entry[1] not in mine]
            if roll < 0.75:
                await _call(actor, CompleteRequest(partition=p, ids=mine), tally)
            elif roll < 0.85:
                orders = [RetryOrder(i, retry_at_us=now + 150 * MS if rng.random() < 0.3 else 0, dead=rng.random() < 0.2) for i in mine]
                await _call(actor, RetryRequest(partition=p, orders=orders), tally)
            elif roll < 0.91:
                await _call(actor, ExtendRequest(partition=p, ids=mine, lease_timeout_us=300 * MS), tally)
                held.extend((p, i) for i in mine)
            elif roll < 0.93:
                await _call(actor, DeleteItemsRequest(partition=p, ids=mine), tally)
            # else: dropped, to run out
        if rng.random() < 0.05:
            await asyncio.sleep(0.02)


# -- A shard whose copies talk through real Peer servers, its record in a real etcd ------
# (test_replica_shipping.py, test_failover_rebuilt_copy.py)

#: The peers' shared secret, and the replica lag, of those tests' nodes.
PEER_SECRET = b"s" * 32
LAG_S = 1.0


@pytest.fixture(scope="module")
def etcd(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Etcd]:
    """A real etcd for the test module (each test keeps to a key prefix of its own)."""
    with Etcd(str(tmp_path_factory.mktemp("etcd"))) as server:
        yield server


class Writer:
    """Who changes the shard record through a ShardTable: a node and the create revision
    of its membership key."""

    def __init__(self, node: str, create_revision: int) -> None:
        self.node = node
        self.create_revision = create_revision


async def poll_until(check: Callable[[], Any], timeout: float, what: str) -> None:
    """Wait for ``check()`` to hold, polling; AssertionError naming ``what`` after ``timeout`` s."""
    deadline = time.monotonic() + timeout
    while not check():
        if time.monotonic() > deadline:
            raise AssertionError(f"not within {timeout} s: {what}")
        await asyncio.sleep(0.02)


async def register_members(client: EtcdClient, prefix: bytes, nodes: list[str]) -> dict[str, int]:
    """Each node's membership key under ``prefix``; the create revision of each, by node."""
    revisions = {}
    for node in nodes:
        key = prefix + b"members/" + node.encode()
        await client.txn(Txn().put(key, b"{}"))
        _, kv = await client.get(key)
        assert kv is not None
        revisions[node] = kv.create_revision
    return revisions


def shard_key(prefix: bytes) -> bytes:
    return prefix + b"shards/" + str(SHARD_UID).encode()


async def stored_record(client: EtcdClient, prefix: bytes) -> ShardRecord:
    """The shard record of SHARD_UID as etcd holds it."""
    _, kv = await client.get(shard_key(prefix))
    assert kv is not None
    return ShardRecord.decode(SHARD_UID, kv.value, kv.mod_revision, kv.create_revision)


async def put_record(client: EtcdClient, prefix: bytes, record: ShardRecord) -> ShardRecord:
    """Store ``record`` as SHARD_UID's and return it as stored (with its revisions)."""
    await client.txn(Txn().put(shard_key(prefix), record.encode()))
    return await stored_record(client, prefix)


async def new_shard(client: EtcdClient, prefix: bytes, nodes: list[str], min_isr: int = 1) -> tuple[ShardRecord, dict[str, int]]:
    """``nodes`` registered as members, and SHARD_UID's record (queue "q") on them, as
    stored; the create revision of each node's membership key."""
    revisions = await register_members(client, prefix, nodes)
    return await put_record(client, prefix, ShardRecord.new(SHARD_UID, "q", nodes, min_isr)), revisions


async def open_copy(path: str, lane: StorageLane) -> ReplicaCopy:
    """SHARD_UID's copy (queue "q", 2 partitions) on real LMDB in ``path``, on ``lane``."""
    os.makedirs(path, exist_ok=True)
    store = await lane.run(lambda: QueueStore(path, 2))
    state = await lane.run(lambda: ReplicaState(store, None, SHARD_UID))
    return ReplicaCopy("q", state, lane, None)


def secret_peers(node: str, members: dict[str, Member] | None = None) -> Peers:
    """``node``'s peer calls to the nodes in ``members`` (as it fills), with the
    cluster's shared secret (PEER_SECRET) for the callers' proof."""
    known: dict[str, Member] = {} if members is None else members
    peers = Peers(node, lambda: known)
    peers.set_secret(PEER_SECRET)
    return peers


PeerCall = Callable[[str, bytes, Any], Awaitable[tuple[grpc.StatusCode, str]]]


@asynccontextmanager
async def peer_caller(address: str) -> AsyncIterator[PeerCall]:
    """``call(method, data, metadata)``: the Peer call ``method`` sent raw to the node at
    ``address``, and its status code and details."""
    async with grpc.aio.insecure_channel(address) as channel:

        async def call(method: str, data: bytes, metadata: Any) -> tuple[grpc.StatusCode, str]:
            stub = channel.unary_unary(
                f"/{SERVICE}/{method}",
                request_serializer=BytesValue.SerializeToString,
                response_deserializer=BytesValue.FromString,
            )
            try:
                await stub(BytesValue(value=data), metadata=metadata, timeout=5)
            except grpc.aio.AioRpcError as exc:
                return exc.code(), exc.details() or ""
            return grpc.StatusCode.OK, ""

        yield call


async def start_peer_server(node: str, peers: Peers, host: Any, port: int = 0) -> tuple[grpc.aio.Server, int]:
    """``node``'s Peer service for the copies ``host`` holds, on 127.0.0.1:``port``
    (0: a free one); returns the started server and its port. Give-backs fail the test."""

    async def never(*_: Any) -> Any:
        raise AssertionError("no give-backs here")

    server = grpc.aio.server()
    server.add_generic_rpc_handlers((PeerService(GiveBacks(node, never, peers), never, host).handler(),))
    port = server.add_insecure_port(f"127.0.0.1:{port}")
    await server.start()
    return server, port


# -- Replicated queues on node processes, a real etcd (test_replica_*.py) ------------------


def shard_of(cluster: Cluster, queue: str) -> dict[str, Any]:
    """The shard record of ``queue`` as etcd holds it (JSON: primary, isr, epoch...)."""
    from aetcd import rpc  # type: ignore[import-untyped]

    with cluster.etcd.channel() as channel:
        kv = rpc.KVStub(channel)
        entry = kv.Range(rpc.RangeRequest(key=f"/{cluster.prefix}/queues/{queue}".encode()), timeout=5).kvs[0]
        uid = json.loads(entry.value)["shard"]
        shard = kv.Range(rpc.RangeRequest(key=f"/{cluster.prefix}/shards/{uid}".encode()), timeout=5).kvs[0]
    record: dict[str, Any] = json.loads(shard.value)
    return record


def claimed(cluster: Cluster, queue: str) -> bool:
    """Every in-sync entry of ``queue`` names its copy's incarnation (the copy is in step)."""
    return all(incarnation for _, incarnation in shard_of(cluster, queue)["isr"])


def placement(node: Node, queue: str) -> cluster_pb2.QueuePlacement:
    """Where ``queue``'s copies are, as ``node``'s ClusterInfo says."""
    found = next((q for q in node.info().queues if q.queue_name == queue), None)
    assert found is not None, f"{queue} is not in ClusterInfo"
    return found


def move_primary(cluster: Cluster, queue: str, to: str) -> None:
    """Make ``to`` (a node holding a copy) ``queue``'s primary, unless it is already."""
    n1 = cluster.nodes[0]
    if placement(n1, queue).primary != to:
        cluster_pb2_grpc.ClusterServiceStub(n1.channel).MoveQueue(
            cluster_pb2.MoveQueueRequest(queue_name=queue, node_id=to), timeout=20
        )
        wait_until(lambda: placement(n1, queue).primary == to, 10)


def total(node: Node, queue: str) -> int:
    return sum(p.total for p in node.stubs.stats(queue).partitions)


def dead_letter(node: Node, queue: str, count: int) -> Counter[bytes]:
    """Lease ``count`` items of ``queue`` and retry each as dead (20 s at most); their
    payloads, counted."""
    dead: Counter[bytes] = Counter()
    deadline = time.monotonic() + 20
    while sum(dead.values()) < count and time.monotonic() < deadline:
        leased = node.stubs.lease(queue, 10, request_timeout={"nanos": 200_000_000})
        if leased.items:
            items = [queue_pb2.RetryItem(id=i.id, dead=True) for i in leased.items]
            node.stubs.queue.Retry(queue_pb2.RetryRequest(queue_name=queue, partition=leased.partition, items=items), timeout=5)
            dead.update(i.payload for i in leased.items)
    return dead


def redrive(node: Node, queue: str, target: str = "", max_items: int = 0) -> tuple[list[str], int]:
    """RedriveItems of ``queue`` through ``node``, page after page (10 at most): the
    message ids moved, and how many were skipped."""
    moved: list[str] = []
    skipped = 0
    token = ""
    for _ in range(10):
        answer = node.stubs.storage.RedriveItems(
            storage_pb2.RedriveItemsRequest(queue_name=queue, target_queue=target, max_items=max_items, page_token=token),
            timeout=20,
        )
        moved += answer.message_ids
        skipped += answer.skipped
        token = answer.next_page_token
        if not token:
            break
    return moved, skipped


def lease_back(node: Node, queue: str, count: int) -> Counter[bytes]:
    """Lease and complete ``queue``'s items until ``count`` came (20 s at most; the
    queue UNAVAILABLE meanwhile is tried again); their payloads, counted."""
    back: Counter[bytes] = Counter()
    deadline = time.monotonic() + 20
    while sum(back.values()) < count and time.monotonic() < deadline:
        try:
            leased = node.stubs.lease(queue, 10, request_timeout={"nanos": 200_000_000})
        except grpc.RpcError as exc:
            assert exc.code() == grpc.StatusCode.UNAVAILABLE, exc.details()
            continue
        back.update(i.payload for i in leased.items)
        if leased.items:
            node.stubs.complete(queue, leased.partition, [i.id for i in leased.items])
    return back
