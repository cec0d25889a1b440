"""API keys (UNAUTHENTICATED / PERMISSION_DENIED before any queue lookup) and TLS."""

from __future__ import annotations

import queue
import subprocess
import time
from collections.abc import Iterator
from pathlib import Path

import grpc
import pytest
from security_helpers import BOOTSTRAP, Authed, new_key, status_of

from querator.v1 import keys_pb2, queue_pb2, queue_pb2_grpc, queues_pb2, storage_pb2

from conftest import Stubs, ThreadServer, wait_until


@pytest.fixture
def auth_server(data_dir: str) -> Iterator[ThreadServer]:
    srv = ThreadServer(data_dir, auth=True, admin_token=BOOTSTRAP)
    yield srv
    srv.stop()


@pytest.fixture
def channel(auth_server: ThreadServer) -> Iterator[grpc.Channel]:
    ch = grpc.insecure_channel(auth_server.address)
    yield ch
    ch.close()


def test_calls_without_a_valid_key_are_unauthenticated(channel: grpc.Channel) -> None:
    anonymous = Stubs(channel)
    assert status_of(lambda: anonymous.create("q")) == grpc.StatusCode.UNAUTHENTICATED
    assert status_of(lambda: anonymous.produce("q", [b"x"])) == grpc.StatusCode.UNAUTHENTICATED
    bogus = Authed(channel, "qk_0123456789abcdef_" + "A" * 43)
    assert status_of(lambda: bogus.stats("q")) == grpc.StatusCode.UNAUTHENTICATED
    # Health and reflection stay open for load balancers and grpcurl.
    from grpc_health.v1 import health_pb2, health_pb2_grpc

    health = health_pb2_grpc.HealthStub(channel)
    assert health.Check(health_pb2.HealthCheckRequest(service=""), timeout=5).status == 1


def test_roles_and_queue_patterns(channel: grpc.Channel) -> None:
    admin = Authed(channel, BOOTSTRAP)
    admin.create("orders-eu")
    admin.create("billing")
    producer = Authed(channel, new_key(admin, keys_pb2.ROLE_PRODUCER, "orders*"))
    consumer = Authed(channel, new_key(admin, keys_pb2.ROLE_CONSUMER, "orders*"))

    producer.produce("orders-eu", [b"a"])
    assert status_of(lambda: producer.produce("billing", [b"x"])) == grpc.StatusCode.PERMISSION_DENIED
    assert status_of(lambda: producer.lease("orders-eu")) == grpc.StatusCode.PERMISSION_DENIED
    assert status_of(lambda: producer.create("orders-new")) == grpc.StatusCode.PERMISSION_DENIED

    leased = consumer.lease("orders-eu", batch_size=5)
    assert [i.payload for i in leased.items] == [b"a"]
    consumer.complete("orders-eu", leased.partition, [leased.items[0].id])
    assert status_of(lambda: consumer.produce("orders-eu", [b"x"])) == grpc.StatusCode.PERMISSION_DENIED
    assert status_of(lambda: consumer.list_items("orders-eu")) == grpc.StatusCode.PERMISSION_DENIED
    assert consumer.stats("orders-eu").queue_name == "orders-eu"
    # Listing shows only the queues the key matches.
    listed = consumer.queues.ListQueues(queues_pb2.ListQueuesRequest(), timeout=5)
    assert [q.queue_name for q in listed.queues] == ["orders-eu"]
    # Only an admin key for "*" manages keys.
    assert status_of(lambda: consumer.keys.ListKeys(keys_pb2.ListKeysRequest(), timeout=5)) == (
        grpc.StatusCode.PERMISSION_DENIED
    )


def test_authorization_comes_before_the_queue_lookup(channel: grpc.Channel) -> None:
    admin = Authed(channel, BOOTSTRAP)
    admin.create("orders-1")
    outsider = Authed(channel, new_key(admin, keys_pb2.ROLE_ADMIN, "team-a*"))
    # Existing and missing queues outside the key's patterns answer the same.
    for name in ("orders-1", "orders-missing"):
        assert status_of(lambda n=name: outsider.stats(n)) == grpc.StatusCode.PERMISSION_DENIED
        assert status_of(lambda n=name: outsider.produce(n, [b"x"])) == grpc.StatusCode.PERMISSION_DENIED
    # Naming a dead_queue outside the patterns is refused too.
    assert status_of(lambda: outsider.create("team-a-jobs", dead_queue="orders-1")) == grpc.StatusCode.PERMISSION_DENIED
    outsider.create("team-a-jobs")
    assert status_of(
        lambda: outsider.storage.ListItems(storage_pb2.ListItemsRequest(queue_name="orders-1"), timeout=5)
    ) == grpc.StatusCode.PERMISSION_DENIED


def test_every_message_of_a_stream_is_checked_against_the_key(channel: grpc.Channel) -> None:
    admin = Authed(channel, BOOTSTRAP)
    admin.create("orders-eu")
    admin.create("billing")
    token = new_key(admin, keys_pb2.ROLE_PRODUCER, "orders*")
    stub = queue_pb2_grpc.QueueServiceStub(channel)

    def message(queue: str) -> queue_pb2.ProduceStreamRequest:
        request = queue_pb2.ProduceRequest(queue_name=queue, items=[queue_pb2.ProduceItem(payload=b"x")])
        return queue_pb2.ProduceStreamRequest(request=request)

    sent = [message("orders-eu"), message("billing"), message("orders-eu")]
    answers = list(stub.ProduceStream(iter(sent), metadata=[("authorization", f"Bearer {token}")], timeout=10))
    assert [a.WhichOneof("result") for a in answers] == ["response", "error", "response"]
    assert answers[1].error.code == grpc.StatusCode.PERMISSION_DENIED.value[0]
    assert "may not touch this queue" in answers[1].error.message
    assert admin.stats("orders-eu").partitions[0].total == 2 and admin.stats("billing").partitions[0].total == 0


def test_a_key_refused_a_queue_keeps_its_stream_for_the_queues_it_may_touch(channel: grpc.Channel) -> None:
    admin = Authed(channel, BOOTSTRAP)
    admin.create("orders-eu")
    admin.create("billing")
    admin.produce("orders-eu", [b"a"])
    admin.produce("billing", [b"b"])
    token = new_key(admin, keys_pb2.ROLE_CONSUMER, "orders*")
    stub = queue_pb2_grpc.QueueServiceStub(channel)

    def lease(queue: str) -> queue_pb2.LeaseStreamRequest:
        return queue_pb2.LeaseStreamRequest(request=queue_pb2.LeaseRequest(queue_name=queue, batch_size=1))

    messages = _Messages()
    try:
        call = stub.LeaseStream(iter(messages), metadata=[("authorization", f"Bearer {token}")], timeout=30)
        messages.send(lease("billing"))
        refused = next(call)
        assert refused.error.code == grpc.StatusCode.PERMISSION_DENIED.value[0]
        messages.send(lease("orders-eu"))  # the same stream, still open
        served = next(call)
        assert [item.payload for item in served.response.items] == [b"a"]
    finally:
        messages.close()
    assert list(call) == []  # ended OK once the client stopped sending
    assert admin.stats("billing").partitions[0].total == 1


@pytest.mark.parametrize(
    ("method", "role", "words"),
    [
        ("LeaseStream", keys_pb2.ROLE_PRODUCER, "(producer) may not consume"),
        ("ProduceStream", keys_pb2.ROLE_CONSUMER, "(consumer) may not produce"),
    ],
)
def test_a_stream_whose_keys_role_may_never_do_its_action_ends_at_once(
    channel: grpc.Channel, method: str, role: int, words: str
) -> None:
    admin = Authed(channel, BOOTSTRAP)
    admin.create("orders")
    token = new_key(admin, role, "orders")
    key_id = token.split("_")[1]
    stub = queue_pb2_grpc.QueueServiceStub(channel)
    auth = [("authorization", f"Bearer {token}")]
    lease = queue_pb2.LeaseRequest(queue_name="orders", batch_size=1)
    produce = queue_pb2.ProduceRequest(queue_name="orders", items=[queue_pb2.ProduceItem(payload=b"x")])
    if method == "LeaseStream":
        first: object = queue_pb2.LeaseStreamRequest(request=lease)
        unary = lambda: stub.Lease(lease, metadata=auth, timeout=5)  # noqa: E731
    else:
        first = queue_pb2.ProduceStreamRequest(request=produce)
        unary = lambda: stub.Produce(produce, metadata=auth, timeout=5)  # noqa: E731
    messages = _Messages()
    started = time.monotonic()
    try:
        call = getattr(stub, method)(iter(messages), metadata=auth, timeout=30)
        messages.send(first)  # one message, and the stream is never half-closed
        with pytest.raises(grpc.RpcError) as err:
            next(call)  # the call's end, not an answer to the message
        assert err.value.code() == grpc.StatusCode.PERMISSION_DENIED
        assert time.monotonic() - started < 20  # ended by the server, not by the 30 s deadline
    finally:
        messages.close()
    # The unary call's code and words.
    assert err.value.details() == f"key {key_id} {words}"
    assert _refusal(unary) == (grpc.StatusCode.PERMISSION_DENIED, err.value.details())
    assert admin.stats("orders").partitions[0].total == 0


@pytest.mark.parametrize("method", ["ProduceStream", "LeaseStream"])
def test_a_stream_refused_for_its_role_ends_before_any_message(channel: grpc.Channel, method: str) -> None:
    admin = Authed(channel, BOOTSTRAP)
    role = keys_pb2.ROLE_PRODUCER if method == "LeaseStream" else keys_pb2.ROLE_CONSUMER
    token = new_key(admin, role, "*")
    stub = queue_pb2_grpc.QueueServiceStub(channel)
    messages = _Messages()  # sends nothing and never ends by itself
    try:
        call = getattr(stub, method)(iter(messages), metadata=[("authorization", f"Bearer {token}")], timeout=30)
        with pytest.raises(grpc.RpcError) as err:
            next(call)
        assert err.value.code() == grpc.StatusCode.PERMISSION_DENIED
    finally:
        messages.close()


def test_admin_keys_and_the_bootstrap_token_open_both_streams(channel: grpc.Channel) -> None:
    admin = Authed(channel, BOOTSTRAP)
    admin.create("orders")
    stub = queue_pb2_grpc.QueueServiceStub(channel)
    produce = queue_pb2.ProduceRequest(queue_name="orders", items=[queue_pb2.ProduceItem(payload=b"x")])
    lease = queue_pb2.LeaseRequest(queue_name="orders", batch_size=1)
    for token in (BOOTSTRAP, new_key(admin, keys_pb2.ROLE_ADMIN, "orders")):
        auth = [("authorization", f"Bearer {token}")]
        produced = list(stub.ProduceStream(iter([queue_pb2.ProduceStreamRequest(request=produce)]), metadata=auth, timeout=10))
        assert produced[0].WhichOneof("result") == "response"
        leased = list(stub.LeaseStream(iter([queue_pb2.LeaseStreamRequest(request=lease)]), metadata=auth, timeout=10))
        assert [item.payload for item in leased[0].response.items] == [b"x"]


def _refusal(call: object) -> tuple[grpc.StatusCode, str]:
    with pytest.raises(grpc.RpcError) as err:
        call()  # type: ignore[operator]
    return err.value.code(), str(err.value.details())


def test_answers_and_errors_name_no_queue_outside_the_keys_patterns(channel: grpc.Channel) -> None:
    root = Authed(channel, BOOTSTRAP)
    root.create("a-dlq")
    root.create("b-dlq")
    root.create("b1", dead_queue="a-dlq")  # a queue the narrow key may not see uses a-dlq
    root.create("a1", dead_queue="a-dlq")
    root.create("a-src", dead_queue="b-dlq")  # a visible queue whose dead_queue is hidden
    root.create("a-mid", dead_queue="b-dlq")
    narrow = Authed(channel, new_key(root, keys_pb2.ROLE_ADMIN, "a*"))

    # Delete: the refusal says why without naming b1.
    code, text = _refusal(lambda: narrow.queues.DeleteQueue(queues_pb2.DeleteQueueRequest(queue_name="a-dlq"), timeout=5))
    assert code == grpc.StatusCode.FAILED_PRECONDITION
    assert "'a1'" in text and "1 queue your key may not see" in text and "b1" not in text
    code, text = _refusal(lambda: root.queues.DeleteQueue(queues_pb2.DeleteQueueRequest(queue_name="a-dlq"), timeout=5))
    assert "'a1'" in text and "'b1'" in text  # a key for every queue is told everything

    # Update: giving a-dlq a dead_queue of its own is refused without naming b1.
    update = queues_pb2.UpdateQueueRequest(queue=queues_pb2.QueueInfo(queue_name="a-dlq", dead_queue="a-other"))
    update.update_mask.paths.append("dead_queue")
    narrow.create("a-other")
    code, text = _refusal(lambda: narrow.queues.UpdateQueue(update, timeout=5))
    assert code == grpc.StatusCode.FAILED_PRECONDITION and "b1" not in text and "'a1'" in text
    narrow.queues.DeleteQueue(queues_pb2.DeleteQueueRequest(queue_name="a1"), timeout=5)
    code, text = _refusal(lambda: narrow.queues.UpdateQueue(update, timeout=5))
    assert code == grpc.StatusCode.FAILED_PRECONDITION and "b1" not in text
    assert "is the dead_queue of 1 queue your key may not see" in text

    # Create with a dead_queue whose own dead_queue is hidden: refused, b-dlq unnamed.
    code, text = _refusal(lambda: narrow.create("a2", dead_queue="a-mid"))
    assert code == grpc.StatusCode.INVALID_ARGUMENT and "a-mid" in text and "b-dlq" not in text

    # QueueInfo: the hidden dead_queue reads empty in every answer; a wider key sees it.
    get = queues_pb2.GetQueueRequest(queue_name="a-src")
    assert narrow.queues.GetQueue(get, timeout=5).queue.dead_queue == ""
    assert root.queues.GetQueue(get, timeout=5).queue.dead_queue == "b-dlq"
    listed = {q.queue_name: q.dead_queue for q in narrow.queues.ListQueues(queues_pb2.ListQueuesRequest(), timeout=5).queues}
    assert listed == {"a-dlq": "", "a-mid": "", "a-other": "", "a-src": ""}
    listed = {q.queue_name: q.dead_queue for q in root.queues.ListQueues(queues_pb2.ListQueuesRequest(), timeout=5).queues}
    assert listed["a-src"] == "b-dlq" and listed["b1"] == "a-dlq"
    reference = queues_pb2.UpdateQueueRequest(queue=queues_pb2.QueueInfo(queue_name="a-src", reference="note"))
    reference.update_mask.paths.append("reference")
    assert narrow.queues.UpdateQueue(reference, timeout=5).queue.dead_queue == ""
    assert root.queues.GetQueue(get, timeout=5).queue.dead_queue == "b-dlq"  # unchanged by that update
    created = narrow.create("a3", dead_queue="a-dlq")
    assert created.dead_queue == "a-dlq"  # a queue the key matches is shown


class _Messages:
    """A stream's request iterator fed by the test; it blocks until told to end."""

    def __init__(self) -> None:
        self._queue: queue.Queue[object] = queue.Queue()

    def send(self, message: object) -> None:
        self._queue.put(message)

    def close(self) -> None:
        self._queue.put(None)

    def __iter__(self) -> Iterator[object]:
        while (message := self._queue.get()) is not None:
            yield message


@pytest.mark.parametrize("method", ["ProduceStream", "LeaseStream"])
@pytest.mark.parametrize("token", ["", "qk_0123456789abcdef_" + "A" * 43])
def test_a_stream_without_a_valid_key_is_ended_at_once(channel: grpc.Channel, method: str, token: str) -> None:
    stub = queue_pb2_grpc.QueueServiceStub(channel)
    metadata = [("authorization", f"Bearer {token}")] if token else None
    messages = _Messages()  # sends nothing and never ends by itself
    started = time.monotonic()
    try:
        call = getattr(stub, method)(iter(messages), metadata=metadata, timeout=30)
        with pytest.raises(grpc.RpcError) as err:
            next(call)
        assert err.value.code() == grpc.StatusCode.UNAUTHENTICATED
        assert time.monotonic() - started < 20  # ended by the server, not by the 30 s deadline
    finally:
        messages.close()


def test_a_stream_ends_unauthenticated_once_its_key_is_revoked(channel: grpc.Channel) -> None:
    admin = Authed(channel, BOOTSTRAP)
    admin.create("orders")
    token = new_key(admin, keys_pb2.ROLE_PRODUCER, "orders")
    stub = queue_pb2_grpc.QueueServiceStub(channel)
    request = queue_pb2.ProduceRequest(queue_name="orders", items=[queue_pb2.ProduceItem(payload=b"x")])
    messages = _Messages()
    try:
        call = stub.ProduceStream(iter(messages), metadata=[("authorization", f"Bearer {token}")], timeout=30)
        messages.send(queue_pb2.ProduceStreamRequest(request=request))
        assert next(call).WhichOneof("result") == "response"
        admin.keys.RevokeKey(keys_pb2.RevokeKeyRequest(key_id=token.split("_")[1]), timeout=5)
        messages.send(queue_pb2.ProduceStreamRequest(request=request))
        refused = next(call)
        assert refused.error.code == grpc.StatusCode.UNAUTHENTICATED.value[0]
        with pytest.raises(grpc.RpcError) as err:
            next(call)
        assert err.value.code() == grpc.StatusCode.UNAUTHENTICATED
    finally:
        messages.close()
    assert admin.stats("orders").partitions[0].total == 1


def test_revoked_keys_stop_working_and_keys_survive_restart(data_dir: str) -> None:
    srv = ThreadServer(data_dir, auth=True, admin_token=BOOTSTRAP)
    try:
        channel = grpc.insecure_channel(srv.address)
        admin = Authed(channel, BOOTSTRAP)
        admin.create("jobs")
        kept = new_key(admin, keys_pb2.ROLE_PRODUCER, "jobs")
        dropped = new_key(admin, keys_pb2.ROLE_PRODUCER, "jobs")
        dropped_id = dropped.split("_")[1]
        listed = admin.keys.ListKeys(keys_pb2.ListKeysRequest(), timeout=5).keys
        assert dropped_id in {k.key_id for k in listed}
        admin.keys.RevokeKey(keys_pb2.RevokeKeyRequest(key_id=dropped_id), timeout=5)
        assert status_of(lambda: Authed(channel, dropped).produce("jobs", [b"x"])) == grpc.StatusCode.UNAUTHENTICATED
        channel.close()
    finally:
        srv.stop()
    # Restart without the bootstrap token: stored keys still work, the revoked one does not.
    srv = ThreadServer(data_dir, auth=True)
    try:
        channel = grpc.insecure_channel(srv.address)
        Authed(channel, kept).produce("jobs", [b"after restart"])
        assert status_of(lambda: Authed(channel, dropped).produce("jobs", [b"x"])) == grpc.StatusCode.UNAUTHENTICATED
        assert status_of(lambda: Authed(channel, BOOTSTRAP).create("x")) == grpc.StatusCode.UNAUTHENTICATED
        channel.close()
    finally:
        srv.stop()
    # Only hashes are stored: the token's secret appears nowhere in the data dir.
    secret = kept.split("_", 2)[2].encode()
    for path in Path(data_dir).rglob("*"):
        if path.is_file():
            assert secret not in path.read_bytes()


def test_create_key_validation(channel: grpc.Channel) -> None:
    admin = Authed(channel, BOOTSTRAP)
    assert status_of(lambda: admin.keys.CreateKey(keys_pb2.CreateKeyRequest(role=0, queues=["*"]), timeout=5)) == (
        grpc.StatusCode.INVALID_ARGUMENT
    )
    assert status_of(lambda: admin.keys.CreateKey(keys_pb2.CreateKeyRequest(role=1), timeout=5)) == (
        grpc.StatusCode.INVALID_ARGUMENT
    )
    assert status_of(lambda: admin.keys.RevokeKey(keys_pb2.RevokeKeyRequest(key_id="nope"), timeout=5)) == (
        grpc.StatusCode.NOT_FOUND
    )


# -- TLS ------------------------------------------------------------------------------


def _openssl(*args: str, cwd: Path) -> None:
    subprocess.run(["openssl", *args], cwd=cwd, check=True, capture_output=True)


@pytest.fixture(scope="module")
def pki(tmp_path_factory: pytest.TempPathFactory) -> Path:
    d = tmp_path_factory.mktemp("pki")
    _openssl("req", "-x509", "-newkey", "rsa:2048", "-nodes", "-keyout", "ca.key", "-out", "ca.pem",
             "-days", "2", "-subj", "/CN=test-ca", cwd=d)
    for name in ("server", "client"):
        _openssl("req", "-newkey", "rsa:2048", "-nodes", "-keyout", f"{name}.key", "-out", f"{name}.csr",
                 "-subj", f"/CN={name}", cwd=d)
        (d / f"{name}.ext").write_text("subjectAltName=DNS:localhost,IP:127.0.0.1\n")
        _openssl("x509", "-req", "-in", f"{name}.csr", "-CA", "ca.pem", "-CAkey", "ca.key", "-CAcreateserial",
                 "-out", f"{name}.pem", "-days", "2", "-extfile", f"{name}.ext", cwd=d)
    return d


def _tls_channel(address: str, pki: Path, *, client_cert: bool) -> grpc.Channel:
    creds = grpc.ssl_channel_credentials(
        root_certificates=(pki / "ca.pem").read_bytes(),
        private_key=(pki / "client.key").read_bytes() if client_cert else None,
        certificate_chain=(pki / "client.pem").read_bytes() if client_cert else None,
    )
    return grpc.secure_channel(address, creds)


def test_tls_serves_encrypted_and_refuses_plaintext(data_dir: str, pki: Path) -> None:
    srv = ThreadServer(data_dir, tls_cert=str(pki / "server.pem"), tls_key=str(pki / "server.key"))
    try:
        with _tls_channel(srv.address, pki, client_cert=False) as ch:
            Stubs(ch).create("secure")
        with grpc.insecure_channel(srv.address) as plain:
            assert status_of(lambda: Stubs(plain).stats("secure")) == grpc.StatusCode.UNAVAILABLE
    finally:
        srv.stop()


def test_mutual_tls_requires_a_client_certificate(data_dir: str, pki: Path) -> None:
    srv = ThreadServer(
        data_dir,
        tls_cert=str(pki / "server.pem"),
        tls_key=str(pki / "server.key"),
        tls_client_ca=str(pki / "ca.pem"),
    )
    try:
        with _tls_channel(srv.address, pki, client_cert=True) as ch:
            Stubs(ch).create("mtls")
            assert Stubs(ch).stats("mtls").queue_name == "mtls"
        with _tls_channel(srv.address, pki, client_cert=False) as ch:
            assert status_of(lambda: Stubs(ch).stats("mtls")) == grpc.StatusCode.UNAVAILABLE
    finally:
        srv.stop()


def test_a_missing_tls_file_fails_start_with_its_name(data_dir: str, tmp_path: Path) -> None:
    missing = tmp_path / "nope.pem"
    with pytest.raises(OSError, match="nope.pem"):
        ThreadServer(data_dir, tls_cert=str(missing), tls_key=str(missing))


def test_produce_lease_round_trip_with_auth_and_tls(data_dir: str, pki: Path) -> None:
    srv = ThreadServer(
        data_dir, auth=True, admin_token=BOOTSTRAP, tls_cert=str(pki / "server.pem"), tls_key=str(pki / "server.key")
    )
    try:
        with _tls_channel(srv.address, pki, client_cert=False) as ch:
            admin = Authed(ch, BOOTSTRAP)
            admin.create("both")
            worker = Authed(ch, new_key(admin, keys_pb2.ROLE_ADMIN, "both"))
            worker.produce("both", [b"p"])
            leased = worker.lease("both")
            worker.queue.Complete(
                queue_pb2.CompleteRequest(queue_name="both", partition=0, ids=[leased.items[0].id]), timeout=5
            )
    finally:
        srv.stop()


def test_a_redrive_moves_items_only_into_queues_the_key_may_touch(channel: grpc.Channel) -> None:
    admin = Authed(channel, BOOTSTRAP)
    admin.create("team-dlq")
    admin.create("team-a", dead_queue="team-dlq")
    admin.create("other-b", dead_queue="team-dlq")
    for name in ("team-a", "other-b"):
        admin.produce(name, [name.encode()])
        leased = admin.lease(name)
        retry = [queue_pb2.RetryItem(id=leased.items[0].id, dead=True)]
        admin.queue.Retry(queue_pb2.RetryRequest(queue_name=name, partition=0, items=retry), timeout=5)
    wait_until(lambda: len(admin.list_items("team-dlq")) == 2)
    team = Authed(channel, new_key(admin, keys_pb2.ROLE_ADMIN, "team-*"))

    def redrive(**kw: object) -> storage_pb2.RedriveItemsResponse:
        request = storage_pb2.RedriveItemsRequest(queue_name="team-dlq", **kw)  # type: ignore[arg-type]
        return team.storage.RedriveItems(request, timeout=10)

    assert status_of(lambda: redrive(target_queue="other-b")) == grpc.StatusCode.PERMISSION_DENIED
    answer = redrive()
    assert (answer.moved, answer.skipped) == (1, 1)  # other-b's item stays: the key may not touch it
    assert [i.payload for i in admin.list_items("team-a")] == [b"team-a"]
    assert [i.payload for i in admin.list_items("team-dlq")] == [b"other-b"]
