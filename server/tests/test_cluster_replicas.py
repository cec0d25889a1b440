"""Replicated queues' control plane through real etcd and three node processes: the
--replicas default, QueueInfo.replicas and min_in_sync, the shard record and its
uid, placement, and the refusals."""

from __future__ import annotations

import json
import time
from collections.abc import Iterator

import grpc
import pytest
from cluster_helpers import Cluster
from google.protobuf import field_mask_pb2

from querator.v1 import queues_pb2
from querator_server.cluster.shard_record import SHARD_UID_BASE


@pytest.fixture(scope="module")
def cluster(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Cluster]:
    with Cluster(str(tmp_path_factory.mktemp("replicas")), args=["--replicas", "2"], metrics=True) as c:
        yield c


def _etcd(cluster: Cluster, key: str) -> dict | None:
    from aetcd import rpc  # type: ignore[import-untyped]

    with cluster.etcd.channel() as channel:
        reply = rpc.KVStub(channel).Range(rpc.RangeRequest(key=f"/{cluster.prefix}/{key}".encode()), timeout=5)
    return json.loads(reply.kvs[0].value) if reply.kvs else None


def _update(node, name: str, **fields: int) -> queues_pb2.QueueInfo:
    request = queues_pb2.UpdateQueueRequest(
        queue=queues_pb2.QueueInfo(queue_name=name, **fields), update_mask=field_mask_pb2.FieldMask(paths=list(fields))
    )
    return node.stubs.queues.UpdateQueue(request, timeout=10).queue


def test_a_queue_gets_the_servers_replicas_one_shard_record_and_a_cluster_wide_uid(cluster: Cluster) -> None:
    n1, n2, n3 = cluster.nodes
    info = n1.stubs.create("copied", requested_partitions=3)
    assert (info.replicas, info.min_in_sync) == (2, 1)  # --replicas 2; the minimum by rule: R - 1
    entry = _etcd(cluster, "queues/copied")
    assert entry is not None and (entry["replicas"], entry["min_isr"]) == (2, 1)
    uid = entry["shard"]
    assert uid >= SHARD_UID_BASE
    record = _etcd(cluster, f"shards/{uid}")
    assert record is not None
    assert record["queue"] == "copied" and record["epoch"] == 1 and record["min_isr"] == 1
    assert len(set(record["replicas"])) == 2 and record["primary"] == record["replicas"][0]
    assert sorted(node for node, _ in record["isr"]) == sorted(record["replicas"])  # claimed since: reordered
    # Every partition is served by the primary, under the shard's uid: ids name it.
    assert {h[0] for h in entry["homes"]} == {record["primary"]}
    produced = n3.stubs.produce("copied", [b"a", b"b"])
    assert produced.partition in range(3)
    leased = n2.stubs.lease("copied", 10)
    assert sorted(i.payload for i in leased.items) == [b"a", b"b"]
    assert all(i.id.startswith(f"{uid:x}.") for i in leased.items), [i.id for i in leased.items]
    assert n2.stubs.queues.GetQueue(queues_pb2.GetQueueRequest(queue_name="copied"), timeout=5).queue.replicas == 2

    # Deleting the queue deletes its shard record in the same transaction.
    n2.stubs.complete("copied", leased.partition, [i.id for i in leased.items])
    n2.stubs.queues.DeleteQueue(queues_pb2.DeleteQueueRequest(queue_name="copied"), timeout=10)
    assert _etcd(cluster, "queues/copied") is None and _etcd(cluster, f"shards/{uid}") is None


def test_one_copy_asked_for_is_todays_queue_exactly(cluster: Cluster) -> None:
    n1 = cluster.nodes[0]
    info = n1.stubs.create("single-copy", requested_partitions=3, replicas=1)
    assert (info.replicas, info.min_in_sync) == (0, 0)
    entry = _etcd(cluster, "queues/single-copy")
    assert entry is not None and set(entry) == {"settings", "homes", "key_partitions"}
    assert {h[0] for h in entry["homes"]} == {"n1", "n2", "n3"}


def test_three_copies_default_to_two_in_sync_and_a_minimum_can_be_asked_for(cluster: Cluster) -> None:
    n1 = cluster.nodes[0]
    assert (lambda i: (i.replicas, i.min_in_sync))(n1.stubs.create("three", replicas=3)) == (3, 2)
    record = _etcd(cluster, f"shards/{_etcd(cluster, 'queues/three')['shard']}")  # type: ignore[index]
    assert record is not None and sorted(record["replicas"]) == ["n1", "n2", "n3"] and record["min_isr"] == 2
    info = n1.stubs.create("three-strict", replicas=3, min_in_sync=3)
    assert (info.replicas, info.min_in_sync) == (3, 3)


def test_primaries_go_to_the_nodes_serving_the_fewest(cluster: Cluster) -> None:
    n1 = cluster.nodes[0]
    before = _primaries(cluster)
    for i in range(3):
        n1.stubs.create(f"spread-{i}")
    after = _primaries(cluster)
    added = {node: after.get(node, 0) - before.get(node, 0) for node in after}
    assert max(after.values()) - min(after.values()) <= 1, (before, after)
    assert sum(added.values()) == 3


def _primaries(cluster: Cluster) -> dict[str, int]:
    from aetcd import rpc  # type: ignore[import-untyped]

    prefix = f"/{cluster.prefix}/shards/".encode()
    with cluster.etcd.channel() as channel:
        reply = rpc.KVStub(channel).Range(rpc.RangeRequest(key=prefix, range_end=prefix[:-1] + b"0"), timeout=5)
    out = {"n1": 0, "n2": 0, "n3": 0}
    for kv in reply.kvs:
        out[json.loads(kv.value)["primary"]] += 1
    return out


@pytest.mark.parametrize(
    ("settings", "code", "text"),
    [
        ({"replicas": 4}, grpc.StatusCode.FAILED_PRECONDITION, "needs 4 live nodes for its replicas, the cluster has 3 live"),
        ({"replicas": 2, "min_in_sync": 3}, grpc.StatusCode.INVALID_ARGUMENT, "queue.min_in_sync: must be at most replicas (2)"),
        ({"replicas": 8}, grpc.StatusCode.INVALID_ARGUMENT, "queue.replicas: must be between 1 and 7"),
        ({"replicas": -1}, grpc.StatusCode.INVALID_ARGUMENT, "queue.replicas"),
        ({"replicas": 1, "min_in_sync": 2}, grpc.StatusCode.INVALID_ARGUMENT, "queue.min_in_sync: must be at most replicas (1)"),
    ],
)
def test_replicas_the_cluster_cannot_keep_are_refused_naming_the_field(
    cluster: Cluster, settings: dict[str, int], code: grpc.StatusCode, text: str
) -> None:
    with pytest.raises(grpc.RpcError) as caught:
        cluster.nodes[1].stubs.create("refused", **settings)
    assert caught.value.code() == code and text in (caught.value.details() or ""), caught.value.details()
    assert _etcd(cluster, "queues/refused") is None


def test_update_never_lowers_replicas(cluster: Cluster) -> None:
    n1 = cluster.nodes[0]
    n1.stubs.create("kept-copies", replicas=2)
    with pytest.raises(grpc.RpcError) as caught:
        _update(n1, "kept-copies", replicas=1)
    assert caught.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert "queue.replicas: cannot be lowered (from 2 to 1)" in (caught.value.details() or "")
    assert _update(n1, "kept-copies", max_attempts=3).replicas == 2  # other settings change as before


def test_a_replicated_queue_grows_partitions_on_its_primary(cluster: Cluster) -> None:
    n1, n2, _ = cluster.nodes
    n1.stubs.create("growing", requested_partitions=2)
    assert _update(n2, "growing", requested_partitions=4).requested_partitions == 4
    entry = _etcd(cluster, "queues/growing")
    assert entry is not None and len({h[0] for h in entry["homes"]}) == 1
    assert [h[1] for h in entry["homes"]] == [0, 1, 2, 3]
    # The primary applies the change within its watch latency (an admin call waits for
    # its own node only).
    from conftest import wait_until

    wait_until(lambda: [s.partition for s in n1.stubs.stats("growing").partitions] == [0, 1, 2, 3], 10)


def test_cluster_info_reports_the_primary_copies_in_sync_set_and_epoch(cluster: Cluster) -> None:
    n1, n2, n3 = cluster.nodes
    n2.stubs.create("shown", requested_partitions=2, replicas=3)
    record = _etcd(cluster, f"shards/{_etcd(cluster, 'queues/shown')['shard']}")  # type: ignore[index]
    assert record is not None
    (placement,) = [q for q in n3.info().queues if q.queue_name == "shown"]
    assert placement.primary == record["primary"] and list(placement.homes) == [record["primary"]] * 2
    assert list(placement.replicas) == record["replicas"] and sorted(placement.in_sync) == sorted(record["replicas"])
    assert (placement.epoch, placement.min_in_sync, placement.key_partitions) == (1, 2, 2)
    n1.stubs.create("shown-single", replicas=1)
    (single,) = [q for q in n3.info().queues if q.queue_name == "shown-single"]
    assert (list(single.replicas), list(single.in_sync), single.epoch, single.primary) == ([], [], 0, "")


def test_cluster_status_prints_each_replicated_queues_primary_epoch_and_in_sync_set(cluster: Cluster) -> None:
    from test_cluster_operator import querator

    n1 = cluster.nodes[0]
    n1.stubs.create("status-shown", replicas=3)
    record = _etcd(cluster, f"shards/{_etcd(cluster, 'queues/status-shown')['shard']}")  # type: ignore[index]
    assert record is not None
    shown = querator("--address", n1.address, "cluster", "status")
    assert shown.returncode == 0, shown.stderr
    lines = shown.stdout.splitlines()
    header = next(i for i, line in enumerate(lines) if line.startswith("QUEUE ") and "PRIMARY" in line)
    assert lines[header].split() == ["QUEUE", "PRIMARY", "EPOCH", "REPLICAS", "IN_SYNC", "MIN_IN_SYNC", "MOVING"]
    row = next(line.split() for line in lines[header + 1 :] if line.startswith("status-shown "))
    copies = ",".join(record["replicas"])
    assert row == ["status-shown", record["primary"], "1", copies, copies, "2", "-"]
    as_json = json.loads(querator("--address", n1.address, "cluster", "status", "--json").stdout)
    (listed,) = [q for q in as_json["replicated"] if q["queue"] == "status-shown"]
    assert listed == {
        "queue": "status-shown",
        "primary": record["primary"],
        "epoch": 1,
        "replicas": record["replicas"],
        "in_sync": record["replicas"],
        "min_in_sync": 2,
        "failover_blocked": "",
        "moving_from": "",
        "moving_to": "",
    }


def _scrape(node, queue: str) -> dict[str, float]:  # type: ignore[no-untyped-def]
    import urllib.request

    with urllib.request.urlopen(f"http://{node.metrics_address}/metrics", timeout=5) as reply:
        text = reply.read().decode()
    out: dict[str, float] = {}
    for line in text.splitlines():
        if line.startswith("querator_replication_") and f'queue="{queue}"' in line:
            out[line.split("{")[0]] = float(line.rsplit(" ", 1)[1])
    return out


def _elect(cluster: Cluster, queue: str, primary: str) -> None:
    """An election through the shard record's compare-and-swap (as a failover makes
    it), written under ``primary``'s own membership."""
    import asyncio
    from dataclasses import dataclass

    from querator_server.cluster.etcd import Etcd
    from querator_server.cluster.shard_table import ShardTable

    @dataclass
    class Writer:
        node: str
        create_revision: int

    async def run() -> None:
        client = Etcd([cluster.etcd.endpoint])
        try:
            prefix = f"/{cluster.prefix}/".encode()
            _, member = await client.get(prefix + b"members/" + primary.encode())
            assert member is not None
            table = ShardTable(client, prefix, Writer(primary, member.create_revision))
            record = await table.fetch(_etcd(cluster, f"queues/{queue}")["shard"])  # type: ignore[index]
            assert record is not None
            await table.elect(record, primary, [e for e in record.isr if e[0] == primary])
        finally:
            await client.close()

    asyncio.run(run())


def test_metrics_give_each_copys_epoch_in_sync_size_role_and_the_elections_seen(cluster: Cluster) -> None:
    from conftest import wait_until

    n1 = cluster.nodes[0]
    n1.stubs.create("measured", replicas=3, min_in_sync=2)
    record = _etcd(cluster, f"shards/{_etcd(cluster, 'queues/measured')['shard']}")  # type: ignore[index]
    assert record is not None
    old, new = record["primary"], record["replicas"][1]
    record_uid = _etcd(cluster, "queues/measured")["shard"]  # type: ignore[index]
    by_id = {n.node_id: n for n in cluster.nodes}
    wait_until(lambda: all(_scrape(n, "measured") for n in cluster.nodes), 10)
    for node in cluster.nodes:
        assert _scrape(node, "measured") == {
            "querator_replication_epoch": 1,
            "querator_replication_in_sync": 3,
            "querator_replication_min_in_sync": 2,
            "querator_replication_primary": 1 if node.node_id == old else 0,
            "querator_replication_elections_total": 0,
        }
    # Every copy claimed its entry (its incarnation): the one elected serves at once.
    wait_until(lambda: all(i for _, i in _etcd(cluster, f"shards/{record_uid}")["isr"]), 15)  # type: ignore[index]
    _elect(cluster, "measured", new)

    def settled() -> bool:
        # The new primary adds the other copies back as they catch up: compare with the
        # record as it is at each look.
        now = _etcd(cluster, f"shards/{_etcd(cluster, 'queues/measured')['shard']}")  # type: ignore[index]
        assert now is not None and now["epoch"] == 2 and now["primary"] == new
        return all(
            _scrape(n, "measured")
            == {
                "querator_replication_epoch": 2,
                "querator_replication_in_sync": len(now["isr"]),
                "querator_replication_min_in_sync": 2,
                "querator_replication_primary": 1 if n.node_id == new else 0,
                "querator_replication_elections_total": 1,
            }
            for n in cluster.nodes
        )

    wait_until(settled, 15)
    assert _scrape(by_id[old], "measured")["querator_replication_primary"] == 0


def _claimed(cluster: Cluster, queue: str) -> bool:
    record = _etcd(cluster, f"shards/{_etcd(cluster, f'queues/{queue}')['shard']}")  # type: ignore[index]
    return record is not None and all(i for _, i in record["isr"])


def test_move_hands_the_primary_over_to_an_in_sync_copy_and_loses_nothing(cluster: Cluster) -> None:
    from test_cluster_operator import querator

    from conftest import wait_until

    n1 = cluster.nodes[0]
    n1.stubs.create("handed-over", replicas=3, requested_partitions=2)
    wait_until(lambda: _claimed(cluster, "handed-over"), 15)
    payloads = [f"item-{i}".encode() for i in range(6)]
    n1.stubs.produce("handed-over", payloads)
    (before,) = [q for q in n1.info().queues if q.queue_name == "handed-over"]
    target = before.replicas[1]
    moved = querator("--address", n1.address, "cluster", "move", "handed-over", target)
    assert moved.returncode == 0, moved.stderr
    assert moved.stdout.startswith(f"queue handed-over: primary {target}, epoch 2"), moved.stdout
    for node in cluster.nodes:  # every node routes to the new primary within its watch latency
        wait_until(lambda node=node: [q for q in node.info().queues if q.queue_name == "handed-over"][0].primary == target, 10)
    (after,) = [q for q in n1.info().queues if q.queue_name == "handed-over"]
    assert (after.epoch, list(after.homes)) == (2, [target, target])
    assert before.primary in after.replicas  # the old primary stays a copy
    got: list[bytes] = []
    for _ in range(20):
        got += [i.payload for i in n1.stubs.lease("handed-over", 10).items]
        if len(got) >= len(payloads):
            break
    assert sorted(got) == sorted(payloads)
    # Moving to the primary it has changes nothing.
    again = querator("--address", n1.address, "cluster", "move", "handed-over", target, "--json")
    assert again.returncode == 0 and json.loads(again.stdout)["epoch"] == 2, again.stdout


@pytest.mark.parametrize(
    ("queue", "node", "code", "text"),
    [
        ("one-copy-moved", "n1", grpc.StatusCode.FAILED_PRECONDITION, "keeps one copy of each partition"),
        ("two-copies-moved", "", grpc.StatusCode.INVALID_ARGUMENT, "node_id"),
        ("two-copies-moved", "elsewhere", grpc.StatusCode.FAILED_PRECONDITION, "node 'elsewhere' is not live"),
        ("no-such-queue", "n1", grpc.StatusCode.NOT_FOUND, "does not exist"),
    ],
)
def test_a_move_the_cluster_cannot_make_is_refused(
    cluster: Cluster, queue: str, node: str, code: grpc.StatusCode, text: str
) -> None:
    from querator.v1 import cluster_pb2, cluster_pb2_grpc

    n1 = cluster.nodes[0]
    if queue == "one-copy-moved" and not any(q.queue_name == queue for q in n1.info().queues):
        n1.stubs.create(queue, replicas=1)
    if queue == "two-copies-moved" and not any(q.queue_name == queue for q in n1.info().queues):
        n1.stubs.create(queue, replicas=2)
    stub = cluster_pb2_grpc.ClusterServiceStub(n1.channel)
    with pytest.raises(grpc.RpcError) as caught:
        stub.MoveQueue(cluster_pb2.MoveQueueRequest(queue_name=queue, node_id=node), timeout=10)
    assert caught.value.code() == code and text in (caught.value.details() or ""), caught.value.details()


def test_drain_moves_every_primary_off_a_node(cluster: Cluster) -> None:
    from test_cluster_operator import querator

    from conftest import wait_until

    n1 = cluster.nodes[0]
    for i in range(3):
        n1.stubs.create(f"drained-{i}", replicas=2)
    for i in range(3):
        wait_until(lambda i=i: _claimed(cluster, f"drained-{i}"), 15)
    primaries = {q.queue_name: q.primary for q in n1.info().queues if q.queue_name.startswith("drained-")}
    victim = max(set(primaries.values()), key=list(primaries.values()).count)
    mine = sorted(name for name, p in primaries.items() if p == victim)
    shown = querator("--address", n1.address, "cluster", "drain", victim, "--json")
    report = json.loads(shown.stdout)
    assert set(mine) <= set(report["moved"]), report
    assert all(": " in why for why in report["kept"]), report
    assert shown.returncode == (3 if report["kept"] else 0)
    wait_until(lambda: all(q.primary != victim for q in n1.info().queues if q.queue_name in report["moved"]), 10)
    for name in mine:
        assert n1.stubs.produce(name, [b"after the drain"]).ids


def test_update_changes_min_in_sync_in_the_entry_and_the_shard_record(cluster: Cluster) -> None:
    n1, n2, _ = cluster.nodes
    n1.stubs.create("stricter", replicas=3)
    n1.stubs.create("single-copy-min", replicas=1)
    assert _update(n2, "stricter", min_in_sync=3).min_in_sync == 3
    uid = _etcd(cluster, "queues/stricter")["shard"]  # type: ignore[index]
    assert _etcd(cluster, "queues/stricter")["min_isr"] == 3  # type: ignore[index]
    assert _etcd(cluster, f"shards/{uid}")["min_isr"] == 3  # type: ignore[index]
    (placement,) = [q for q in n2.info().queues if q.queue_name == "stricter"]
    assert placement.min_in_sync == 3
    for name, value, text in (
        ("stricter", 4, "queue.min_in_sync: must be between 1 and replicas (3), got 4"),
        ("single-copy-min", 1, "queue.min_in_sync: applies to a replicated queue"),
    ):
        with pytest.raises(grpc.RpcError) as caught:
            _update(n1, name, min_in_sync=value)
        assert caught.value.code() == grpc.StatusCode.INVALID_ARGUMENT
        assert text in (caught.value.details() or ""), caught.value.details()


def test_a_pause_reaches_the_primarys_copy(cluster: Cluster) -> None:
    from conftest import dur, wait_until

    n1, n2, _ = cluster.nodes
    n1.stubs.create("paused-copy", replicas=2)
    wait_until(lambda: _claimed(cluster, "paused-copy"), 15)
    n1.stubs.produce("paused-copy", [b"a"])
    n2.stubs.queues.PauseQueue(queues_pb2.PauseQueueRequest(queue_name="paused-copy"), timeout=10)
    time.sleep(0.5)  # every node's watch has the change by then (a paused queue hands out nothing)
    for node in cluster.nodes:
        assert node.stubs.lease("paused-copy", 10, request_timeout=dur(0)).items == []
    n2.stubs.queues.ResumeQueue(queues_pb2.ResumeQueueRequest(queue_name="paused-copy"), timeout=10)
    wait_until(lambda: [i.payload for i in n1.stubs.lease("paused-copy", 10, request_timeout=dur(0)).items] == [b"a"], 10)


def test_a_primary_stopped_by_sigterm_hands_its_queues_over_first_and_nothing_is_lost(cluster: Cluster) -> None:
    """Last in this module: it stops a node (started again at the end)."""
    import signal
    import time

    from conftest import wait_until

    n1 = cluster.nodes[0]
    n1.stubs.create("stopping", replicas=2, requested_partitions=2)
    wait_until(lambda: _claimed(cluster, "stopping"), 15)
    payloads = [f"kept-{i}".encode() for i in range(5)]
    n1.stubs.produce("stopping", payloads)
    (placement,) = [q for q in n1.info().queues if q.queue_name == "stopping"]
    by_id = {n.node_id: n for n in cluster.nodes}
    old = by_id[placement.primary]
    new = next(n for n in placement.replicas if n != old.node_id)
    watcher = by_id[new]
    started = time.monotonic()
    old.signal(signal.SIGTERM)
    wait_until(lambda: [q for q in watcher.info().queues if q.queue_name == "stopping"][0].primary == new, 10)
    switched = time.monotonic() - started
    deadline = time.monotonic() + 10
    while True:  # the new primary serves once it has taken the queue up
        try:
            watcher.stubs.produce("stopping", [b"after"])
            break
        except grpc.RpcError as exc:
            assert exc.code() == grpc.StatusCode.UNAVAILABLE and time.monotonic() < deadline, exc.details()
            time.sleep(0.05)
    serving = time.monotonic() - started
    assert old.proc is not None and old.proc.wait(20) == 0
    record = _etcd(cluster, f"shards/{_etcd(cluster, 'queues/stopping')['shard']}")  # type: ignore[index]
    assert record is not None and record["epoch"] == 2 and [n for n, _ in record["isr"]] == [new]
    got: list[bytes] = []
    for _ in range(20):
        got += [i.payload for i in watcher.stubs.lease("stopping", 10).items]
        if len(got) >= len(payloads) + 1:
            break
    assert sorted(got) == sorted([*payloads, b"after"])
    print(f"hand-over: primary switched {switched:.2f} s, serving {serving:.2f} s after SIGTERM")
    old.start()
