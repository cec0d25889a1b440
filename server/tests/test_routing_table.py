"""The routing table (testdata/routing/cases.json) against the server's routing policy.

The same table runs against the Python SDK's cluster map
(clients/python/tests/test_sdk_routing_table.py) and the TypeScript client's
(clients/typescript/test/routing_table.test.ts).
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
from google.protobuf import json_format
from google.protobuf.message import Message
from google.protobuf.message_factory import GetMessageClass

from querator.v1 import queue_pb2, queues_pb2, storage_pb2
from querator_server.cluster.placement import Home, QueueEntry, key_partition
from querator_server.cluster.policy import Part, Where, where
from querator_server.errors import InvalidArgument, QueratorError, Unavailable
from querator_server.model import QueueConfig
from querator_server.storage.ordered_groups import group_partition

TABLE = json.loads((Path(__file__).parents[2] / "testdata" / "routing" / "cases.json").read_text())
CODES: dict[type[QueratorError], str] = {InvalidArgument: "INVALID_ARGUMENT", Unavailable: "UNAVAILABLE"}


def request_of(method: str, body: dict[str, Any]) -> Message:
    for module in (queue_pb2, queues_pb2, storage_pb2):
        for service in module.DESCRIPTOR.services_by_name.values():
            if method in service.methods_by_name:
                message = GetMessageClass(service.methods_by_name[method].input_type)()
                return json_format.ParseDict({**body, "queueName": "q"}, message)
    raise KeyError(method)


def entry_of(cluster: dict[str, Any]) -> QueueEntry:
    homes: list[Home] = []
    for node in cluster["homes"]:
        homes.append(Home(node, sum(h.node == node for h in homes)))
    config = QueueConfig(name="q", partitions=len(homes))
    entry = QueueEntry(config, tuple(homes), cluster["key_partitions"])
    if "primary" in cluster:  # replicated: as the catalog routes it, through the shard record
        config = config.replace(replicas=len(cluster["replicas"]))
        entry = QueueEntry(config, tuple(homes), cluster["key_partitions"], shard=1 << 40)
        entry = entry.served_by(cluster["primary"], cluster["epoch"])
        assert [h.node for h in entry.homes] == cluster["homes"]
    return entry


def expected(server: dict[str, Any]) -> Where:
    parts = tuple(Part(p["node"], tuple(p["keys"]), p["ids"]) for p in server.get("parts", ()))
    return Where(parts, tuple(server.get("spread", ())), tuple(server.get("every", ())), server.get("complete_at", ""))


@pytest.mark.parametrize("case", [c for c in TABLE["cases"] if "server" in c], ids=lambda c: c["name"])
def test_the_server_routes_each_case_of_the_table(case: dict[str, Any]) -> None:
    entry = entry_of(case["cluster"])
    request = request_of(case["call"]["method"], case["call"]["request"])
    args = (entry, case["node"], frozenset(case["cluster"]["live"]), case["call"]["method"], request, case["forwarded"])
    want = case["server"]
    if "error" in want:
        with pytest.raises(QueratorError) as raised:
            where(*args)
        assert CODES[type(raised.value)] == want["error"], raised.value.message
        if "detail" in want:
            assert raised.value.message.startswith(want["detail"]), raised.value.message
        if "field" in want:
            assert isinstance(raised.value, InvalidArgument) and raised.value.violations[0][0] == want["field"]
        return
    assert where(*args) == expected(want)


def test_every_key_vector_of_the_table() -> None:
    for vector in TABLE["key_partitions"]:
        assert key_partition(vector["key"], vector["partitions"]) == vector["partition"], vector
        # A node keeps an ordered group in the partition the cluster routes its key to.
        assert group_partition(vector["key"], vector["partitions"]) == vector["partition"], vector


def test_the_table_routes_grouped_produce_for_every_consumer() -> None:
    """Grouped Produce cases that the server and both clients check (server and client
    parts), an error among them."""
    grouped = [
        c
        for c in TABLE["cases"]
        if c["call"]["method"] == "Produce" and any(i.get("groupKey") for i in c["call"]["request"].get("items", ()))
    ]
    assert sum("server" in c and "client" in c for c in grouped) >= 5
    assert {c["server"].get("error") for c in grouped} >= {None, "INVALID_ARGUMENT", "UNAVAILABLE"}


def test_the_table_covers_every_routed_call() -> None:
    from querator_server.cluster.policy import EVERY_CALLS, HOME_CALLS

    covered = {c["call"]["method"] for c in TABLE["cases"] if "server" in c}
    assert covered == {"Produce", "Lease"} | HOME_CALLS | EVERY_CALLS
