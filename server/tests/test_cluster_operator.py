"""The operator's path through a real etcd and real nodes: a quiet healthy start,
``querator cluster status`` and ``querator cluster retire``, and retiring only ids the
cluster knows."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import grpc
import pytest
from cluster_helpers import Cluster, Node

from querator.v1 import cluster_pb2, cluster_pb2_grpc, queues_pb2

from conftest import wait_until

BIN = Path(sys.executable).parent


@pytest.fixture(scope="module")
def cluster(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Cluster]:
    with Cluster(str(tmp_path_factory.mktemp("operator")), args=["--log-level", "info"]) as c:
        yield c


def querator(*args: str, stdin: str | None = None) -> subprocess.CompletedProcess[str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("QUERATOR_")}
    return subprocess.run(
        [str(BIN / "querator"), *args],
        input=stdin,
        stdin=None if stdin is not None else subprocess.DEVNULL,
        capture_output=True,
        text=True,
        timeout=60,
        env=env,
        check=False,
    )


def _levels(text: str) -> list[tuple[str, str]]:
    """(level, event) of every JSON log line."""
    out = []
    for line in text.splitlines():
        try:
            record = json.loads(line)
        except json.JSONDecodeError:
            out.append(("unparsed", line))
            continue
        out.append((record.get("level", ""), record.get("event", "")))
    return out


def test_a_healthy_start_logs_no_warning(cluster: Cluster) -> None:
    # Past the first renewals (three per TTL): a node that holds its membership says so
    # at info level; a warning on every healthy start would teach operators to ignore them.
    time.sleep(cluster.ttl)
    for node in cluster.nodes:
        levels = _levels(node.stderr_text())
        assert ("info", "cluster_joined") in levels, node.stderr_text()
        loud = [(level, event) for level, event in levels if level not in ("debug", "info")]
        assert not loud, f"{node.node_id} logged {loud} on a healthy start:\n{node.stderr_text()}"


def test_retiring_an_id_the_cluster_never_knew_is_refused_and_bans_nothing(cluster: Cluster) -> None:
    n1 = cluster.nodes[0]
    stub = cluster_pb2_grpc.ClusterServiceStub(n1.channel)
    with pytest.raises(grpc.RpcError) as error:
        stub.RetireNodeDiscardingData(cluster_pb2.RetireNodeDiscardingDataRequest(node_id="n9-typo"), timeout=10)
    assert error.value.code() == grpc.StatusCode.NOT_FOUND
    assert "node_id" in (error.value.details() or "") and "n9-typo" in (error.value.details() or "")
    # Nothing was banned: a node of that id may still join.
    late = Node("n9-typo", os.path.join(cluster.root, "n9"), cluster.url, cluster.ttl)
    try:
        late.start()
        wait_until(lambda: "n9-typo" in cluster.live(n1), timeout=10)
    finally:
        late.stop()
    wait_until(lambda: "n9-typo" not in cluster.live(n1), timeout=10)


def test_cluster_status_shows_members_partitions_and_revision(cluster: Cluster) -> None:
    n1, n2, n3 = cluster.nodes
    n1.stubs.create("status-q", requested_partitions=6)
    shown = querator("--address", n2.address, "cluster", "status")
    assert shown.returncode == 0, shown.stdout + shown.stderr
    lines = shown.stdout.splitlines()
    revision = n2.info().revision
    assert lines[0].startswith("cluster: 3 of 3 nodes live, catalog revision ")
    assert int(lines[0].split("catalog revision ")[1].split(",")[0]) <= revision
    assert lines[1].split() == ["NODE", "ADDRESS", "LIVE", "FENCED", "PARTITIONS", "FAULTY"]
    rows = {line.split()[0]: line.split() for line in lines[2:5]}
    for node in (n1, n2, n3):
        assert rows[node.node_id][1:4] == [node.address, "yes", "no"]
    assert sum(int(r[4]) for r in rows.values()) >= 6  # other tests' queues count too
    assert all(r[5] == "0" for r in rows.values())

    as_json = querator("--address", n1.address, "cluster", "status", "--json")
    assert as_json.returncode == 0, as_json.stderr
    report = json.loads(as_json.stdout)
    assert report["healthy"] and report["clustered"] and report["node_id"] == "n1"
    assert [m["node_id"] for m in report["members"]] == ["n1", "n2", "n3"]
    assert all(m["live"] and not m["fenced"] and not m["check_error"] for m in report["members"])
    homes = [q for q in n1.info().queues if q.queue_name == "status-q"][0].homes
    assert {m["node_id"]: m["partitions"] for m in report["members"]} == {
        n: sum(list(q.homes).count(n) for q in n1.info().queues) for n in ("n1", "n2", "n3")
    }
    assert set(homes) == {"n1", "n2", "n3"}


def test_a_dead_node_shows_in_status_and_retire_asks_then_recreates_its_partitions(
    cluster: Cluster, tmp_path: Path
) -> None:
    n1, n2, _ = cluster.nodes
    # A node of its own, so the module's three stay up for the other tests.
    doomed = Node("n4", str(tmp_path / "n4"), cluster.url, cluster.ttl)
    doomed.start()
    try:
        wait_until(lambda: "n4" in cluster.live(n1), timeout=10)
        n1.stubs.create("doomed-q", requested_partitions=4)
        homes = list([q for q in n1.info().queues if q.queue_name == "doomed-q"][0].homes)
        assert "n4" in homes
        doomed.kill9()
        wait_until(lambda: "n4" not in cluster.live(n1), timeout=20, interval=0.2)

        status = querator("--address", n1.address, "cluster", "status")
        assert status.returncode == 3, status.stdout + status.stderr
        row = next(line.split() for line in status.stdout.splitlines() if line.startswith("n4 "))
        assert row[1:4] == ["-", "no", "-"] and int(row[5]) == int(row[4]) > 0
        faulty = [line for line in status.stdout.splitlines() if line.startswith("doomed-q ")]
        assert len(faulty) == homes.count("n4")
        assert all("node 'n4'" in line and "docs/cluster.md" in line for line in faulty)
        assert "node n4 is not live" in status.stderr and "died for good" in status.stderr

        # No terminal to ask on and no --yes: refused, nothing retired.
        unconfirmed = querator("--address", n1.address, "cluster", "retire", "n4", "--discard-data")
        assert unconfirmed.returncode == 2, unconfirmed.stderr
        assert "DISCARDS THE ITEMS" in unconfirmed.stderr and "--yes" in unconfirmed.stderr
        assert "n4" in {h for q in n1.info().queues for h in q.homes}
        without_flag = querator("--address", n1.address, "cluster", "retire", "n4", "--yes")
        assert without_flag.returncode == 2 and "--discard-data" in without_flag.stderr

        retired = querator("--address", n2.address, "cluster", "retire", "n4", "--discard-data", "--yes")
        assert retired.returncode == 0, retired.stderr
        count = homes.count("n4")
        assert retired.stdout.startswith(f"retired node n4: {count} partition{'s' if count > 1 else ''} recreated")
        assert "restore it on a new host under the same --node-id" in retired.stderr
        wait_until(lambda: "n4" not in {h for q in n1.info().queues for h in q.homes}, timeout=10)
        healthy = querator("--address", n1.address, "cluster", "status", "--json")
        assert healthy.returncode == 0, healthy.stdout
        assert "n4" not in [m["node_id"] for m in json.loads(healthy.stdout)["members"]]

        unknown = querator("--address", n1.address, "cluster", "retire", "n4-typo", "--discard-data", "--yes")
        assert unknown.returncode == 1 and "NOT_FOUND" in unknown.stderr, unknown.stderr
    finally:
        doomed.stop()


def test_a_dead_nodes_data_dir_restored_elsewhere_under_its_id_serves_every_item(
    cluster: Cluster, tmp_path: Path
) -> None:
    """docs/cluster.md, "A node that died for good", way 1: nothing is lost."""
    import shutil

    n1 = cluster.nodes[0]
    lost = Node("n5", str(tmp_path / "old-host"), cluster.url, cluster.ttl)
    lost.start()
    try:
        wait_until(lambda: "n5" in cluster.live(n1), timeout=10)
        n1.stubs.create("moved-host", requested_partitions=4)
        homes = list([q for q in n1.info().queues if q.queue_name == "moved-host"][0].homes)
        here = homes.index("n5")
        payloads = [f"m-{i}".encode() for i in range(40)]
        for start in range(0, len(payloads), 10):
            lost.stubs.produce("moved-host", payloads[start : start + 10])  # n5 keeps them on its partition
        on_n5 = lost.stubs.stats("moved-host").partitions[here].total
        assert on_n5 == len(payloads)
        old_address = lost.address
        lost.kill9()
        shutil.copytree(tmp_path / "old-host", tmp_path / "new-host")
    finally:
        lost.stop()
    moved = Node("n5", str(tmp_path / "new-host"), cluster.url, cluster.ttl)  # a new port: a new host
    try:
        moved.start()
        wait_until(
            lambda: any(m.node_id == "n5" and m.live and m.address == moved.address for m in n1.info().members),
            timeout=20,
        )
        assert moved.address != old_address
        got: list[bytes] = []
        for _ in range(40):
            reply = n1.stubs.lease("moved-host", 50, timeout=10)
            got += [item.payload for item in reply.items]
            if reply.items:
                n1.stubs.complete("moved-host", reply.partition, [item.id for item in reply.items])
            if len(got) >= len(payloads):
                break
        assert sorted(got) == sorted(payloads)
        # n5 leaves for good with nothing: the module's other tests see three nodes again.
        n1.stubs.queues.DeleteQueue(queues_pb2.DeleteQueueRequest(queue_name="moved-host", force=True), timeout=15)
    finally:
        moved.stop()


def test_status_says_which_live_node_did_not_answer(cluster: Cluster, tmp_path: Path) -> None:
    """A node that holds its membership but that the others cannot reach (its advertised
    address goes through a proxy we cut): live, fenced unknown, and the status says so."""
    from cluster_helpers import Proxy

    n1 = cluster.nodes[0]
    node = Node("n6", str(tmp_path / "n6"), cluster.url, cluster.ttl)
    proxy = Proxy(node.address)
    node.args = ["--advertise", proxy.address]
    try:
        node.start()
        wait_until(lambda: "n6" in cluster.live(n1), timeout=10)
        assert querator("--address", n1.address, "cluster", "status").returncode == 0
        proxy.cut()
        status = querator("--address", n1.address, "cluster", "status", "--json")
        assert status.returncode == 3, status.stdout + status.stderr
        (n6,) = [m for m in json.loads(status.stdout)["members"] if m["node_id"] == "n6"]
        assert n6["live"] and not n6["fenced"] and n6["check_error"].startswith("UNAVAILABLE"), n6
        table = querator("--address", n1.address, "cluster", "status")
        row = next(line.split() for line in table.stdout.splitlines() if line.startswith("n6 "))
        assert row[1:4] == [proxy.address, "yes", "?"]
        assert "node n6 did not answer" in table.stderr
    finally:
        node.stop()
        proxy.close()
    wait_until(lambda: "n6" not in cluster.live(n1), timeout=10)


def test_status_shows_fenced_nodes_while_etcd_is_paused(cluster: Cluster) -> None:
    """Last in the module: every node loses its standing while etcd is paused."""
    n1 = cluster.nodes[0]
    cluster.etcd.pause()
    try:
        wait_until(lambda: not n1.info().admin_writable, timeout=20, interval=0.2)
        for node in cluster.nodes[1:]:
            wait_until(lambda node=node: not node.info().admin_writable, timeout=20, interval=0.2)
        status = querator("--address", n1.address, "cluster", "status", "--json")
        report = json.loads(status.stdout)
        assert status.returncode == 3
        assert {m["node_id"]: m["fenced"] for m in report["members"]} == {"n1": True, "n2": True, "n3": True}
        assert "node n2 is fenced" in report["problems"]
    finally:
        cluster.etcd.resume()
    wait_until(lambda: querator("--address", n1.address, "cluster", "status").returncode == 0, timeout=30, interval=0.5)
