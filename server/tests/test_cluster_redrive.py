"""RedriveItems on a cluster, through real etcd and real node processes on loopback.

The module's cluster starts with n1..n3; the dead-letter queue of the paged test is
made there (a partition on each of the three), then n4 joins, homing none of it, and
the redrive is sent to n4. The last test kills a node and starts it again.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from collections import Counter
from collections.abc import Iterator

import grpc
import pytest
from cluster_helpers import Cluster, Node
from google.protobuf import field_mask_pb2

from querator.v1 import queue_pb2, queues_pb2, storage_pb2

from conftest import dur, wait_until

RETRY_DEAD = queue_pb2.DEAD_REASON_RETRY_DEAD
MAX_ATTEMPTS = queue_pb2.DEAD_REASON_MAX_ATTEMPTS


@pytest.fixture(scope="module")
def cluster(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Cluster]:
    c = Cluster(str(tmp_path_factory.mktemp("redrive")))
    try:
        c.start()
        n1 = c.nodes[0]
        # Made before n4 joins: these two have partitions on n1..n3 only.
        n1.stubs.create("dlq", requested_partitions=1)
        n1.stubs.create("sick", requested_partitions=3, dead_queue="dlq", max_attempts=1)
        n4 = Node("n4", os.path.join(c.root, "n4"), c.url, c.ttl)
        c.nodes.append(n4)
        n4.start()
        wait_until(lambda: c.live(n1) == {"n1", "n2", "n3", "n4"}, timeout=20)
        yield c
    finally:
        c.stop()


def homes(node: Node, name: str) -> list[str]:
    return list(next(q for q in node.info().queues if q.queue_name == name).homes)


def per_node(node: Node, name: str) -> Counter[str]:
    """Items of queue ``name`` on each node (every partition's home is live)."""
    where = homes(node, name)
    stats = node.stubs.stats(name)
    assert len(stats.partitions) == len(where)
    counts: Counter[str] = Counter()
    for s in stats.partitions:
        counts[where[s.partition]] += s.total
    return counts


def kill(node: Node, name: str, count: int, *, dead: bool = True) -> None:
    """Lease ``count`` items of ``name`` and give each up (Retry, dead or not: with
    max_attempts=1 either way it is a dead letter, for a different reason)."""
    done = 0
    deadline = time.monotonic() + 60
    while done < count:
        assert time.monotonic() < deadline, f"only {done} of {count} items died"
        leased = node.stubs.lease(name, batch_size=count - done, request_timeout=dur(0.5))
        if leased.items:
            retry = [queue_pb2.RetryItem(id=i.id, dead=dead) for i in leased.items]
            node.stubs.queue.Retry(queue_pb2.RetryRequest(queue_name=name, partition=leased.partition, items=retry), timeout=10)
            done += len(leased.items)


def produce_on_every_home(cluster: Cluster, name: str, count: int, kind: str = "") -> dict[bytes, str]:
    """``count`` items into each home's partitions of ``name`` (produced through that
    node, which keeps them on its own partitions); message ids by payload."""
    made: dict[bytes, str] = {}
    owners = set(homes(cluster.nodes[0], name))
    for node in cluster.nodes:
        if node.node_id not in owners:
            continue
        items = [queue_pb2.ProduceItem(payload=f"{name}-{node.node_id}-{kind}-{i}".encode(), kind=kind) for i in range(count)]
        reply = node.stubs.queue.Produce(queue_pb2.ProduceRequest(queue_name=name, items=items), timeout=10)
        assert homes(node, name)[reply.partition] == node.node_id
        made.update(zip((i.payload for i in items), reply.ids, strict=True))
    return made


def redrive(node: Node, name: str, **kw: object) -> storage_pb2.RedriveItemsResponse:
    request = storage_pb2.RedriveItemsRequest(queue_name=name, **kw)  # type: ignore[arg-type]
    return node.stubs.storage.RedriveItems(request, timeout=30)


def cli(node: Node, *args: str) -> subprocess.CompletedProcess[str]:
    env = dict(os.environ, QUERATOR_ADDRESS=node.address)
    return subprocess.run(
        [sys.executable, "-m", "querator.cli", *args], env=env, capture_output=True, text=True, timeout=60
    )


def drain(node: Node, name: str, expect: int) -> list[queue_pb2.LeaseItem]:
    got: list[queue_pb2.LeaseItem] = []
    deadline = time.monotonic() + 60
    while len(got) < expect and time.monotonic() < deadline:
        got.extend(node.stubs.lease(name, 100, timeout=10, request_timeout=dur(1)).items)
    return got


def test_a_dead_letter_queue_on_three_nodes_is_redriven_in_pages_from_a_node_homing_none_of_it(cluster: Cluster) -> None:
    n1, n2, n3, n4 = cluster.nodes
    assert sorted(homes(n4, "dlq")) == sorted(homes(n4, "sick")) == ["n1", "n2", "n3"]
    made = produce_on_every_home(cluster, "sick", 20)
    kill(n2, "sick", 60)
    wait_until(lambda: per_node(n4, "dlq") == {"n1": 20, "n2": 20, "n3": 20}, timeout=30)

    moved: list[str] = []
    pages = 0
    token = ""
    # 7 a page: pages end within a node and across nodes; each page goes to another node.
    while True:
        via = cluster.nodes[(3 + pages) % 4]  # n4 first, then n1, n2, ...
        answer = redrive(via, "dlq", max_items=7, page_token=token)
        assert answer.moved == len(answer.message_ids) <= 7 and answer.skipped == 0
        moved += answer.message_ids
        pages += 1
        token = answer.next_page_token
        if not token:
            break
        assert answer.moved == 7
    assert pages == 9  # 60 items, 7 a page
    assert sorted(moved) == sorted(made.values())  # every item once, none twice
    assert sum(per_node(n4, "dlq").values()) == 0
    # Each back in its source queue's partition on the node it died on, leasable again.
    assert per_node(n4, "sick") == {"n1": 20, "n2": 20, "n3": 20}
    leased = drain(n4, "sick", 60)
    assert sorted(i.message_id for i in leased) == sorted(made.values())
    assert all(i.attempts == 1 and not i.dead_reason for i in leased)
    assert redrive(n3, "dlq").moved == 0


def test_filters_and_an_explicit_target_work_across_nodes(cluster: Cluster) -> None:
    n1, n2, n3, n4 = cluster.nodes
    n1.stubs.create("dlq-f")
    n1.stubs.create("sick-f", requested_partitions=4, dead_queue="dlq-f", max_attempts=1)
    nodes = sorted(homes(n1, "dlq-f"))
    assert nodes == ["n1", "n2", "n3", "n4"]
    # Each node's "a" items die retried dead, its "b" ones by max_attempts.
    kinds = {"a": produce_on_every_home(cluster, "sick-f", 3, "a")}
    kill(n1, "sick-f", 12, dead=True)
    kinds["b"] = produce_on_every_home(cluster, "sick-f", 3, "b")
    kill(n1, "sick-f", 12, dead=False)
    wait_until(lambda: sum(per_node(n1, "dlq-f").values()) == 24, timeout=30)

    none = redrive(n2, "dlq-f", kind="c")
    assert (none.moved, none.skipped, none.next_page_token) == (0, 0, "")
    a_only = redrive(n2, "dlq-f", kind="a", dead_reason=RETRY_DEAD)
    assert sorted(a_only.message_ids) == sorted(kinds["a"].values())
    assert redrive(n3, "dlq-f", kind="a", dead_reason=MAX_ATTEMPTS).moved == 0
    assert Counter(per_node(n1, "sick-f")) == Counter({n: 3 for n in nodes})

    # An explicit target: "dest" has one partition, so three nodes of dlq-f lack one.
    n1.stubs.create("dest")
    (dest_home,) = homes(n1, "dest")
    with pytest.raises(grpc.RpcError) as refused:
        redrive(n4, "dlq-f", target_queue="dest")
    assert refused.value.code() == grpc.StatusCode.FAILED_PRECONDITION
    details = refused.value.details() or ""
    assert all(n in details for n in nodes if n != dest_home) and "Add partitions to 'dest'" in details
    assert sum(per_node(n1, "dlq-f").values()) == 12  # nothing moved
    # The fix the error names: partitions added to dest until every node has one.
    info = queues_pb2.QueueInfo(queue_name="dest", requested_partitions=4)
    n2.stubs.queues.UpdateQueue(
        queues_pb2.UpdateQueueRequest(queue=info, update_mask=field_mask_pb2.FieldMask(paths=["requested_partitions"])),
        timeout=15,
    )
    wait_until(lambda: sorted(homes(n4, "dest")) == nodes, timeout=10)
    moved = redrive(n4, "dlq-f", target_queue="dest", max_items=5)
    rest = redrive(n3, "dlq-f", target_queue="dest", page_token=moved.next_page_token)
    assert sorted([*moved.message_ids, *rest.message_ids]) == sorted(kinds["b"].values())
    assert per_node(n1, "dest") == Counter({n: 3 for n in nodes})  # each stayed on its node
    assert sorted(i.message_id for i in drain(n2, "dest", 12)) == sorted(kinds["b"].values())


def test_a_bad_redrive_page_token_or_argument_is_refused_whichever_node_gets_it(cluster: Cluster) -> None:
    n1, n2, _, n4 = cluster.nodes
    n1.stubs.create("dlq-x", requested_partitions=2)
    for fields, field in [
        ({"queue_name": "dlq-x", "page_token": "bm90LWEtdG9rZW4"}, "page_token"),
        ({"queue_name": "dlq-x", "max_items": 1001}, "max_items"),
        ({"queue_name": "dlq-x", "target_queue": "dlq-x"}, "target_queue"),
        ({"queue_name": "dlq-x", "dead_reason": 99}, "dead_reason"),
    ]:
        for node in (n2, n4):
            with pytest.raises(grpc.RpcError) as error:
                node.stubs.storage.RedriveItems(storage_pb2.RedriveItemsRequest(**fields), timeout=10)  # type: ignore[arg-type]
            assert error.value.code() == grpc.StatusCode.INVALID_ARGUMENT
            assert field in (error.value.details() or "")
    with pytest.raises(grpc.RpcError) as missing:
        redrive(n2, "no-such-queue")
    assert missing.value.code() == grpc.StatusCode.NOT_FOUND


def test_the_cli_redrives_a_cluster_queue(cluster: Cluster) -> None:
    n1, _, _, n4 = cluster.nodes
    n1.stubs.create("dlq-cli")
    n1.stubs.create("sick-cli", requested_partitions=4, dead_queue="dlq-cli", max_attempts=1)
    made = produce_on_every_home(cluster, "sick-cli", 5)
    kill(n1, "sick-cli", 20)
    wait_until(lambda: sum(per_node(n1, "dlq-cli").values()) == 20, timeout=30)
    run = cli(n4, "dlq", "redrive", "dlq-cli", "--json")
    assert run.returncode == 0, run.stderr
    answer = json.loads(run.stdout)
    assert (answer["moved"], answer["skipped"]) == (20, 0)
    assert sorted(answer["message_ids"]) == sorted(made.values())
    assert per_node(n1, "sick-cli") == Counter({n: 5 for n in ("n1", "n2", "n3", "n4")})


def test_a_node_down_is_passed_over_then_named_and_its_items_move_once_it_is_back(cluster: Cluster) -> None:
    n1, n2, n3, n4 = cluster.nodes
    n1.stubs.create("dlq-d")
    n1.stubs.create("sick-d", requested_partitions=4, dead_queue="dlq-d", max_attempts=1)
    n1.stubs.create("sick-d2", requested_partitions=4, dead_queue="dlq-d", max_attempts=1)
    made = produce_on_every_home(cluster, "sick-d", 4)
    kill(n1, "sick-d", 16)
    wait_until(lambda: per_node(n1, "dlq-d") == Counter({n: 4 for n in ("n1", "n2", "n3", "n4")}), timeout=30)
    # Lists, not sets: an item id names a node's local queue, so two nodes may issue the same.
    on_n2 = sorted(m for p, m in made.items() if b"-n2-" in p)
    elsewhere = sorted(m for p, m in made.items() if b"-n2-" not in p)

    n2.kill9()
    try:
        wait_until(lambda: "n2" not in cluster.live(n1), timeout=20)
        # The live nodes' items move and are reported; n2's wait.
        first = redrive(n4, "dlq-d")
        assert sorted(first.message_ids) == elsewhere
        assert first.next_page_token
        # Nothing else to move: the call that meets only the down node names it.
        with pytest.raises(grpc.RpcError) as down:
            redrive(n3, "dlq-d", page_token=first.next_page_token)
        assert down.value.code() == grpc.StatusCode.UNAVAILABLE
        assert "n2" in (down.value.details() or "") and "send the same request again" in (down.value.details() or "")
        # The CLI pages through: it reports what its calls moved, then the error.
        more: list[str] = []
        for node in (n1, n3, n4):
            more += node.stubs.produce("sick-d2", [f"more-{node.node_id}-{i}".encode() for i in range(2)]).ids
        kill(n1, "sick-d2", 6)
        wait_until(lambda: sum(s.total for s in n1.stubs.stats("dlq-d").partitions) == 6, timeout=30)
        run = cli(n4, "dlq", "redrive", "dlq-d", "--json")
        assert run.returncode == 1 and "UNAVAILABLE" in run.stderr and "n2" in run.stderr
        assert sorted(json.loads(run.stdout)["message_ids"]) == sorted(more)
    finally:
        n2.start()
    wait_until(lambda: "n2" in cluster.live(n1), timeout=30)
    rest = redrive(n1, "dlq-d", page_token=first.next_page_token)
    assert (sorted(rest.message_ids), rest.next_page_token) == (on_n2, "")
    assert sum(per_node(n1, "dlq-d").values()) == 0
    assert sorted(i.message_id for i in drain(n4, "sick-d", 16)) == sorted(made.values())
    assert sorted(i.message_id for i in drain(n4, "sick-d2", 6)) == sorted(more)


def _dead_letters_on_every_node(cluster: Cluster, suffix: str) -> tuple[str, dict[str, list[str]]]:
    """A dead-letter queue holding 3 dead letters on each of n1..n4: its name, and the
    message ids of each node's."""
    n1 = cluster.nodes[0]
    dlq, sick = f"dlq-{suffix}", f"sick-{suffix}"
    n1.stubs.create(dlq)
    n1.stubs.create(sick, requested_partitions=4, dead_queue=dlq, max_attempts=1)
    made = produce_on_every_home(cluster, sick, 3)
    kill(n1, sick, 12)
    wait_until(lambda: per_node(n1, dlq) == Counter({n: 3 for n in ("n1", "n2", "n3", "n4")}), timeout=30)
    by_node = {n.node_id: sorted(m for p, m in made.items() if f"-{n.node_id}-".encode() in p) for n in cluster.nodes}
    return dlq, by_node


def _finish(cluster: Cluster, dlq: str, first: storage_pb2.RedriveItemsResponse, paused: str) -> None:
    """Once the paused node is back, the first answer's token moves its items: each
    dead letter moved and reported once."""
    n1, _, n3, n4 = cluster.nodes
    wait_until(lambda: paused in cluster.live(n1), timeout=30)
    reported = list(first.message_ids)
    token = first.next_page_token
    for _ in range(10):  # bounded: one or two calls are enough
        answer = redrive(n3, dlq, page_token=token)
        reported += answer.message_ids
        token = answer.next_page_token
        if not token:
            break
    assert not token
    assert sum(per_node(n1, dlq).values()) == 0
    sick = dlq.replace("dlq-", "sick-")
    assert sorted(i.message_id for i in drain(n4, sick, 12)) == sorted(reported)


def test_a_paused_node_is_passed_over_and_the_call_answers_in_time_what_the_others_moved(cluster: Cluster) -> None:
    n1, n2, n3, n4 = cluster.nodes
    dlq, by_node = _dead_letters_on_every_node(cluster, "p")
    n2.signal(signal.SIGSTOP)
    try:
        started = time.monotonic()
        # n1 answers, n2 does not: it is passed over as a node that is down would be,
        # the others' items move, and the token visits n2 last.
        first = n4.stubs.storage.RedriveItems(storage_pb2.RedriveItemsRequest(queue_name=dlq), timeout=6)
        assert time.monotonic() - started < 6
        assert sorted(first.message_ids) == sorted(by_node["n1"] + by_node["n3"] + by_node["n4"])
        assert first.next_page_token
    finally:
        n2.signal(signal.SIGCONT)
    _finish(cluster, dlq, first, "n2")


def test_a_paused_first_node_does_not_hold_a_call_without_a_deadline(cluster: Cluster) -> None:
    n1, n2, n3, n4 = cluster.nodes
    dlq, by_node = _dead_letters_on_every_node(cluster, "first")
    n1.signal(signal.SIGSTOP)
    try:
        # No deadline: the paused n1, first in id order, is passed over, not waited on.
        call = n4.stubs.storage.RedriveItems.future(storage_pb2.RedriveItemsRequest(queue_name=dlq))
        try:
            first = call.result(timeout=60)
        finally:
            call.cancel()
        assert sorted(first.message_ids) == sorted(by_node["n2"] + by_node["n3"] + by_node["n4"])
        assert first.next_page_token
    finally:
        n1.signal(signal.SIGCONT)
    _finish(cluster, dlq, first, "n1")


def test_a_redrive_on_every_node_keeps_to_what_the_callers_key_may_see(tmp_path) -> None:
    from querator.v1 import keys_pb2, keys_pb2_grpc

    token = "cluster-admin-token-for-the-redrive-test-" + "y" * 20
    admin = [("authorization", f"Bearer {token}")]
    auth = Cluster(str(tmp_path / "auth"), size=2, env={"QUERATOR_AUTH": "true", "QUERATOR_ADMIN_TOKEN": token})
    try:
        auth.start()
        n1, n2 = auth.nodes

        def create(name: str, **settings: object) -> None:
            info = queues_pb2.QueueInfo(queue_name=name, **settings)  # type: ignore[arg-type]
            n1.stubs.queues.CreateQueue(queues_pb2.CreateQueueRequest(queue=info), timeout=15, metadata=admin)

        create("dlq-auth")
        create("open", requested_partitions=2, dead_queue="dlq-auth", max_attempts=1)
        create("hidden", requested_partitions=2, dead_queue="dlq-auth", max_attempts=1)
        made: dict[str, list[str]] = {"open": [], "hidden": []}
        for name in made:
            for node in auth.nodes:  # each node stores on its own partition of the queue
                request = queue_pb2.ProduceRequest(queue_name=name, payloads=[b"x", b"y"])
                made[name] += node.stubs.queue.Produce(request, timeout=10, metadata=admin).ids
            dead = 0
            deadline = time.monotonic() + 30
            while dead < 4 and time.monotonic() < deadline:
                lease = queue_pb2.LeaseRequest(queue_name=name, batch_size=4, request_timeout=dur(0.5))
                leased = n1.stubs.queue.Lease(lease, timeout=10, metadata=admin)
                retry = queue_pb2.RetryRequest(
                    queue_name=name, partition=leased.partition, items=[queue_pb2.RetryItem(id=i.id, dead=True) for i in leased.items]
                )
                if leased.items:
                    n1.stubs.queue.Retry(retry, timeout=10, metadata=admin)
                dead += len(leased.items)
            assert dead == 4
        made_key = keys_pb2_grpc.KeysServiceStub(n1.channel).CreateKey(
            keys_pb2.CreateKeyRequest(role=keys_pb2.ROLE_ADMIN, queues=["dlq-auth", "open"]), timeout=15, metadata=admin
        )
        limited = [("authorization", f"Bearer {made_key.token}")]
        ask = storage_pb2.RedriveItemsRequest(queue_name="dlq-auth")

        def redrives_with_the_key() -> bool:  # once both nodes know the key
            try:
                n2.stubs.storage.RedriveItems(storage_pb2.RedriveItemsRequest(queue_name="dlq-auth", kind="none"), timeout=10, metadata=limited)
                return True
            except grpc.RpcError as exc:
                assert exc.code() == grpc.StatusCode.UNAUTHENTICATED, exc
                return False

        wait_until(redrives_with_the_key, timeout=15)
        with pytest.raises(grpc.RpcError) as no_key:
            n2.stubs.storage.RedriveItems(ask, timeout=10)
        assert no_key.value.code() == grpc.StatusCode.UNAUTHENTICATED
        with pytest.raises(grpc.RpcError) as denied:
            n2.stubs.storage.RedriveItems(
                storage_pb2.RedriveItemsRequest(queue_name="dlq-auth", target_queue="hidden"), timeout=10, metadata=limited
            )
        assert denied.value.code() == grpc.StatusCode.PERMISSION_DENIED
        # Each node moves back the items of the queue the key may see; the others stay.
        answer = n2.stubs.storage.RedriveItems(ask, timeout=10, metadata=limited)
        assert sorted(answer.message_ids) == sorted(made["open"]) and answer.skipped == 4
        everything = n1.stubs.storage.RedriveItems(ask, timeout=10, metadata=admin)
        assert sorted(everything.message_ids) == sorted(made["hidden"]) and everything.skipped == 0
    finally:
        auth.stop()
