"""A data directory belongs to one cluster and one node id; a node id to one process.

Real etcd and real node processes (cluster_helpers.py): a data directory restarted
against a fresh etcd or under a mistyped prefix refuses to start, as does a second
process under a node id bound to another data directory; a process whose node id
another process took over while it was paused exits and acknowledges nothing more; a
non-empty local queue the catalog no longer matches is set aside, never dropped, and
listed and removed by an operator; a backup restored under the same id on a new path
works; a healthy restart logs no warning.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import threading
import time

import grpc
import lmdb
import pytest
from aetcd import rpc  # type: ignore[import-untyped]
from cluster_helpers import Cluster, Etcd, Node

from querator.cli._app import main as cli
from querator.v1 import queue_pb2, queues_pb2

from conftest import wait_until

EXIT_SUPERSEDED = 3


def _refused(node: Node, timeout: float = 60) -> str:
    """Start ``node`` expecting it to exit non-zero before it serves; its stderr."""
    with pytest.raises(AssertionError, match=r"exited with [1-9]") as failed:
        node.start(timeout)
    return str(failed.value)


def _total(node: Node, queue: str) -> int:
    return sum(p.total for p in node.stubs.stats(queue).partitions)


def _live(observer: Node) -> set[str]:
    try:
        return {m.node_id for m in observer.info(timeout=5).members if m.live}
    except grpc.RpcError:
        return set()


def _etcd_delete(cluster: Cluster, key: str) -> None:
    channel = grpc.insecure_channel(cluster.etcd.endpoint)
    try:
        rpc.KVStub(channel).DeleteRange(rpc.DeleteRangeRequest(key=f"/{cluster.prefix}/{key}".encode()), timeout=5)
    finally:
        channel.close()


def _produce_on(node: Node, queue: str, count: int, tag: str) -> list[bytes]:
    """Produce ``count`` items stored on ``node`` itself (one at a time, through it)."""
    homes = list(next(q for q in node.info().queues if q.queue_name == queue).homes)
    stored: list[bytes] = []
    n = 0
    while len(stored) < count:
        payload = f"{tag}-{n}".encode()
        n += 1
        reply = node.stubs.produce(queue, [payload])
        assert homes[reply.partition] == node.node_id  # a node with a partition keeps what it is sent
        stored.append(payload)
    return stored


def _backup(src: str, dest: str) -> None:
    subprocess.run(
        [sys.executable, "-m", "querator_server.backup", src, dest], check=True, capture_output=True, timeout=60
    )


def _warnings(text: str) -> list[str]:
    lines = []
    for line in text.splitlines():
        try:
            level = json.loads(line).get("level")
        except ValueError:
            continue
        if level in ("warning", "error", "critical"):
            lines.append(line)
    return lines


# -- a data directory and its cluster --------------------------------------------------------


def test_a_mistyped_prefix_is_refused_and_the_items_survive(tmp_path) -> None:
    with Cluster(str(tmp_path), size=1) as cluster:
        (n1,) = cluster.nodes
        n1.stubs.create("orders", requested_partitions=2)
        n1.stubs.produce("orders", [f"o{i}".encode() for i in range(20)])
        n1.stop()
        typo = Node("n1", n1.data_dir, f"etcd://{cluster.etcd.endpoint}/{cluster.prefix}x")
        started = False
        try:
            try:
                typo.start()
                started = True
                # What an operator does next on what looks like an empty cluster.
                typo.stubs.create("orders", requested_partitions=2)
                time.sleep(1)
            except AssertionError as exc:
                message = str(exc)
        finally:
            typo.stop()
        n1.start()
        assert _total(n1, "orders") == 20
        assert not started, "the node started under another prefix"
        assert f"belongs to the cluster at prefix '/{cluster.prefix}/'" in message
        assert "mistyped?" in message


def test_a_data_dir_against_a_fresh_etcd_is_refused(tmp_path) -> None:
    with Cluster(str(tmp_path), size=1) as cluster:
        (n1,) = cluster.nodes
        n1.stubs.create("orders", requested_partitions=2)
        n1.stubs.produce("orders", [f"o{i}".encode() for i in range(20)])
        n1.stop()
        fresh = Etcd(str(tmp_path / "etcd-fresh"))
        fresh.start()
        again = Node("n1", n1.data_dir, f"etcd://{fresh.endpoint}/{cluster.prefix}")
        try:
            message = _refused(again)
        finally:
            again.stop()
            fresh.stop()
        assert "holds no cluster at all (a fresh etcd, or another one)" in message
        n1.start()  # and against its own etcd it serves its items as before
        assert _total(n1, "orders") == 20


def test_an_old_data_dir_is_adopted_once(tmp_path) -> None:
    with Cluster(str(tmp_path), size=1, args=["--log-level", "info"]) as cluster:
        (n1,) = cluster.nodes
        n1.stubs.create("orders", requested_partitions=2)
        n1.stubs.produce("orders", [b"a", b"b"])
        n1.stop()
        # A data directory from before identities: no record in it, no binding in etcd.
        env = lmdb.open(os.path.join(n1.data_dir, "catalog"), max_dbs=8)
        with env.begin(write=True) as txn:
            assert txn.delete(b"cluster_identity", db=env.open_db(b"meta", txn=txn))
        env.close()
        _etcd_delete(cluster, "bindings/n1")
        n1.start()
        wait_until(lambda: "cluster_identity_adopted" in n1.stderr_text(), timeout=10)
        assert _total(n1, "orders") == 2
        n1.stop()
        n1.start()
        assert _total(n1, "orders") == 2
        assert "cluster_identity_adopted" not in n1.stderr_text()
        assert "cluster_identity_recorded" not in n1.stderr_text()


def test_a_healthy_restart_logs_no_warning(tmp_path) -> None:
    with Cluster(str(tmp_path), size=2) as cluster:
        n1, n2 = cluster.nodes
        n1.stubs.create("orders", requested_partitions=4)
        n2.stubs.produce("orders", [b"a", b"b"])
        n2.stop()
        n2.start()
        wait_until(lambda: _live(n1) == {"n1", "n2"}, timeout=20, interval=0.2)
        time.sleep(2 * cluster.ttl / 3 + 0.5)  # a few membership renewals
        assert _warnings(n2.stderr_text()) == []
        assert _total(n2, "orders") == 2


# -- a node id and its data directory ------------------------------------------------------


def test_a_second_process_with_the_same_node_id_and_another_data_dir_is_refused(tmp_path) -> None:
    with Cluster(str(tmp_path), size=2, ttl=3) as cluster:
        n1, n2 = cluster.nodes
        n1.stubs.create("orders", requested_partitions=4)
        acked = _produce_on(n2, "orders", 7, "n2") + _produce_on(n1, "orders", 3, "n1")
        n2.signal(signal.SIGSTOP)
        impostor = Node("n2", str(tmp_path / "other"), cluster.url)
        try:
            wait_until(lambda: "n2" not in _live(n1), timeout=20, interval=0.2)
            message = _refused(impostor)
        finally:
            impostor.stop()
            n2.signal(signal.SIGCONT)
        assert "node id 'n2' is bound to data directory" in message
        assert "never joined the cluster" in message
        # The original comes back, registers again and serves every item.
        wait_until(lambda: _live(n1) == {"n1", "n2"}, timeout=20, interval=0.2)
        assert n2.proc is not None and n2.proc.poll() is None
        assert _total(n1, "orders") == len(acked) == 10


def test_an_empty_data_dir_under_a_node_id_that_homes_partitions_is_refused(tmp_path) -> None:
    with Cluster(str(tmp_path), size=2, ttl=3) as cluster:
        n1, n2 = cluster.nodes
        n1.stubs.create("orders", requested_partitions=4)
        acked = _produce_on(n2, "orders", 7, "n2")
        n2.stop()
        _etcd_delete(cluster, "bindings/n2")  # a cluster from before bindings
        empty = Node("n2", str(tmp_path / "empty"), cluster.url)
        try:
            message = _refused(empty)
        finally:
            empty.stop()
        assert "node id 'n2' homes 2 partition(s) in the cluster" in message
        n2.start()
        assert _total(n1, "orders") == len(acked)


def test_a_paused_node_whose_id_was_taken_over_exits_and_never_acknowledges_again(tmp_path) -> None:
    with Cluster(str(tmp_path), size=2, ttl=3) as cluster:
        n1, n2 = cluster.nodes
        n1.stubs.create("orders", requested_partitions=4)
        acked = _produce_on(n2, "orders", 7, "n2") + _produce_on(n1, "orders", 3, "n1")
        n2.signal(signal.SIGSTOP)
        outcome: list[str] = []

        def produce_to_the_paused_one() -> None:
            try:
                request = queue_pb2.ProduceRequest(queue_name="orders", items=[queue_pb2.ProduceItem(payload=b"late")])
                n2.stubs.queue.Produce(request, timeout=60)
                outcome.append("OK")
            except grpc.RpcError as exc:
                outcome.append(exc.code().name)

        caller = threading.Thread(target=produce_to_the_paused_one)
        restored = Node("n2", str(tmp_path / "n2-restored"), cluster.url)
        try:
            wait_until(lambda: "n2" not in _live(n1), timeout=20, interval=0.2)
            caller.start()  # waits in the paused node's socket
            # The paused node's data directory, restored elsewhere under the same id.
            _backup(n2.data_dir, restored.data_dir)
            restored.start()
            wait_until(
                lambda: any(m.node_id == "n2" and m.address == restored.address for m in n1.info().members if m.live),
                timeout=20,
                interval=0.2,
            )
        finally:
            n2.signal(signal.SIGCONT)
        try:
            assert n2.proc is not None
            code = n2.proc.wait(30)
            caller.join(30)
            assert code == EXIT_SUPERSEDED, n2.stderr_text()
            assert outcome and outcome[0] != "OK", outcome
            assert "cluster_node_id_taken_over" in n2.stderr_text()
            # The process now serving n2 has every acknowledged item.
            assert _total(n1, "orders") == len(acked)
            assert _total(restored, "orders") == len(acked)
        finally:
            restored.stop()


def test_a_backup_restored_under_the_same_id_on_a_new_path_serves(tmp_path) -> None:
    with Cluster(str(tmp_path), size=2, ttl=3) as cluster:
        n1, n2 = cluster.nodes
        n1.stubs.create("orders", requested_partitions=4)
        acked = _produce_on(n2, "orders", 7, "n2")
        n2.stop()
        restored = Node("n2", str(tmp_path / "elsewhere" / "n2"), cluster.url)
        try:
            _backup(n2.data_dir, restored.data_dir)
            restored.start()
            wait_until(lambda: _live(n1) == {"n1", "n2"}, timeout=20, interval=0.2)
            assert _total(n1, "orders") == len(acked)
            assert _warnings(restored.stderr_text()) == []
        finally:
            restored.stop()


# -- a local queue the catalog no longer matches ---------------------------------------------


def _cli(capsys: pytest.CaptureFixture[str], node: Node, *args: str) -> tuple[int, str, str]:
    capsys.readouterr()
    code = cli(["--address", node.address, "--json", *args])
    out, err = capsys.readouterr()
    return code, out, err


def test_a_non_empty_queue_of_another_generation_is_set_aside_listed_and_removable(
    tmp_path, capsys: pytest.CaptureFixture[str]
) -> None:
    with Cluster(str(tmp_path), size=2, ttl=3) as cluster:
        n1, n2 = cluster.nodes
        n1.stubs.create("reborn", requested_partitions=4)
        old = _produce_on(n2, "reborn", 20, "old")
        n2.stop()
        # While n2 is away the queue is deleted and made again under the same name.
        n1.stubs.queues.DeleteQueue(queues_pb2.DeleteQueueRequest(queue_name="reborn", force=True), timeout=15)
        n1.stubs.create("reborn", requested_partitions=2)
        n2.start()
        wait_until(lambda: _live(n1) == {"n1", "n2"}, timeout=20, interval=0.2)
        wait_until(lambda: "queue_set_aside" in n2.stderr_text(), timeout=10)
        line = next(json.loads(x) for x in n2.stderr_text().splitlines() if "queue_set_aside" in x)
        assert line["level"] == "error" and line["items"] == len(old) and line["queue"] == "reborn"
        assert _total(n1, "reborn") == 0  # the new queue shows none of the old items

        code, out, _ = _cli(capsys, n1, "cluster", "set-aside", "list")
        assert code == 0
        listed = json.loads(out)["queues"]
        assert [(q["node_id"], q["queue_name"], q["items"]) for q in listed] == [("n2", "reborn", 20)]
        aside_id = listed[0]["set_aside_id"]
        # Kept across a restart of its node.
        n2.stop()
        n2.start()
        code, out, _ = _cli(capsys, n1, "cluster", "set-aside", "list", "--node", "n2")
        assert [q["set_aside_id"] for q in json.loads(out)["queues"]] == [aside_id]

        code, out, _ = _cli(capsys, n1, "cluster", "set-aside", "remove", "n2", aside_id)
        assert code == 0 and json.loads(out)["removed"]["items"] == 20
        code, out, _ = _cli(capsys, n1, "cluster", "set-aside", "list")
        assert json.loads(out)["queues"] == []
        code, _, err = _cli(capsys, n1, "cluster", "set-aside", "remove", "n2", aside_id)
        assert code == 1 and "NOT_FOUND" in err


def test_set_aside_calls_need_an_admin_key_for_every_queue_and_a_single_server_answers(tmp_path) -> None:
    from querator.v1 import cluster_pb2, cluster_pb2_grpc, keys_pb2, keys_pb2_grpc

    from conftest import ThreadServer

    bootstrap = "b" * 20 + "ootstrap-token-for-the-set-aside-test"
    srv = ThreadServer(str(tmp_path / "single"), auth=True, admin_token=bootstrap)
    channel = grpc.insecure_channel(srv.address)
    try:
        as_admin = [("authorization", f"Bearer {bootstrap}")]
        keys = keys_pb2_grpc.KeysServiceStub(channel)
        scoped = keys.CreateKey(
            keys_pb2.CreateKeyRequest(role=keys_pb2.ROLE_ADMIN, queues=["jobs*"]), metadata=as_admin, timeout=10
        ).token
        stub = cluster_pb2_grpc.ClusterServiceStub(channel)
        with pytest.raises(grpc.RpcError) as denied:
            stub.ListSetAsideQueues(
                cluster_pb2.ListSetAsideQueuesRequest(), metadata=[("authorization", f"Bearer {scoped}")], timeout=10
            )
        assert denied.value.code() == grpc.StatusCode.PERMISSION_DENIED
        listed = stub.ListSetAsideQueues(cluster_pb2.ListSetAsideQueuesRequest(), metadata=as_admin, timeout=10)
        assert list(listed.queues) == [] and list(listed.unanswered_nodes) == []
        with pytest.raises(grpc.RpcError) as missing:
            stub.RemoveSetAsideQueue(cluster_pb2.RemoveSetAsideQueueRequest(), metadata=as_admin, timeout=10)
        assert missing.value.code() == grpc.StatusCode.INVALID_ARGUMENT
        assert "set_aside_id" in (missing.value.details() or "")
        with pytest.raises(grpc.RpcError) as unknown:
            stub.RemoveSetAsideQueue(
                cluster_pb2.RemoveSetAsideQueueRequest(set_aside_id="jobs@1"), metadata=as_admin, timeout=10
            )
        assert unknown.value.code() == grpc.StatusCode.NOT_FOUND
        # The SDK's clients, sync and async.
        import asyncio

        import querator

        with querator.Client(srv.address, bearer_token=bootstrap) as client:
            assert client.list_set_aside_queues() == querator.SetAsideQueues([], [])
            with pytest.raises(querator.errors.NotFound):
                client.remove_set_aside_queue("", "jobs@1")

        async def listed_async() -> querator.SetAsideQueues:
            async with querator.AsyncClient(srv.address, bearer_token=bootstrap) as client:
                return await client.list_set_aside_queues()

        assert asyncio.run(listed_async()) == querator.SetAsideQueues([], [])
    finally:
        channel.close()
        srv.stop()
