"""The SDK reads a Lease reply's columns into the fields of each leased item."""

from __future__ import annotations

from datetime import UTC, datetime

from google.protobuf import timestamp_pb2

from querator._protocol import leased_fields
from querator.v1 import queue_pb2

CREATED_US = 1_764_000_000_123_456
DEADLINE_US = 1_764_000_060_654_321


def _ts(micros: int) -> timestamp_pb2.Timestamp:
    ts = timestamp_pb2.Timestamp()
    ts.FromMicroseconds(micros)
    return ts


def test_columns_give_every_field() -> None:
    columns = queue_pb2.LeaseColumns(
        ids=["a", "b"],
        payloads=[b"1", b"2"],
        attempts=[1, 2],
        lease_deadlines_us=[DEADLINE_US, DEADLINE_US],
        created_at_us=[CREATED_US, CREATED_US + 1],
        kinds=["", "k"],
        encodings=["", "e"],
        references=["", "r"],
        message_ids=["a", "m-b"],
        source_ids=["", "s-b"],
        dead_reasons=[queue_pb2.DEAD_REASON_UNSPECIFIED, queue_pb2.DEAD_REASON_EXPIRED],
        dead_at_us=[0, CREATED_US + 2],
        dead_attempts=[0, 4],
    )
    columns.metadata.add()
    columns.metadata.add().entries.update({"m": "v"})
    as_columns = queue_pb2.LeaseResponse(queue_name="q", partition=3, columns=columns)

    fields = list(leased_fields(as_columns))
    deadline = datetime.fromtimestamp(DEADLINE_US // 1_000_000, UTC).replace(microsecond=DEADLINE_US % 1_000_000)
    assert [(f["id"], f["payload"], f["attempts"], f["kind"], f["encoding"], f["reference"]) for f in fields] == [
        ("a", b"1", 1, "", "", ""),
        ("b", b"2", 2, "k", "e", "r"),
    ]
    assert {f["queue_name"] for f in fields} == {"q"} and {f["partition"] for f in fields} == {3}
    assert [f["lease_deadline"] for f in fields] == [deadline, deadline]
    assert fields[1]["metadata"] == {"m": "v"}
    assert fields[1]["created_at"] == datetime.fromtimestamp(CREATED_US / 1e6, UTC).replace(
        microsecond=(CREATED_US + 1) % 1_000_000
    )
    assert fields[0]["metadata"] == {} and fields[0]["metadata"] is not fields[1]["metadata"]
    assert (fields[1]["message_id"], fields[1]["dead_reason"], fields[1]["dead_attempts"]) == ("m-b", "expired", 4)
    assert (fields[0]["message_id"], fields[0]["dead_reason"], fields[0]["dead_at"]) == ("a", None, None)


def test_payload_only_columns_fill_the_optional_fields_blank() -> None:
    columns = queue_pb2.LeaseColumns(
        ids=["a", "b"], payloads=[b"x", b"y"], attempts=[1, 1], lease_deadlines_us=[1, 2], created_at_us=[3, 4]
    )
    fields = list(leased_fields(queue_pb2.LeaseResponse(queue_name="q", columns=columns)))
    assert [(f["kind"], f["encoding"], f["reference"], f["metadata"]) for f in fields] == [("", "", "", {})] * 2
    assert [(f["message_id"], f["source_id"], f["dead_reason"], f["dead_at"]) for f in fields] == [
        ("a", "", None, None),
        ("b", "", None, None),
    ]
    fields[0]["metadata"]["x"] = "1"
    assert fields[1]["metadata"] == {}
