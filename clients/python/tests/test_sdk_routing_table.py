"""The routing table (testdata/routing/cases.json) against the SDK's cluster map: the
node each call is sent to. The server's policy runs the same table
(server/tests/test_routing_table.py), and so does the TypeScript client."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
from google.protobuf import json_format
from google.protobuf.message import Message
from google.protobuf.message_factory import GetMessageClass

from querator._cluster import ClusterMap, key_partition
from querator._operations import QUEUE, QUEUES, STORAGE, Call
from querator.v1 import cluster_pb2, queue_pb2, queues_pb2, storage_pb2

TABLE = json.loads((Path(__file__).parents[3] / "testdata" / "routing" / "cases.json").read_text())
_SERVICES = ((queue_pb2, QUEUE), (queues_pb2, QUEUES), (storage_pb2, STORAGE))


def call_of(method: str, body: dict[str, Any]) -> Call:
    for module, service in _SERVICES:
        for descriptor in module.DESCRIPTOR.services_by_name.values():
            if method in descriptor.methods_by_name:
                message: Message = GetMessageClass(descriptor.methods_by_name[method].input_type)()
                json_format.ParseDict({**body, "queueName": "q"}, message)
                return Call(service, method, message, 10.0, True)
    raise KeyError(method)


def map_of(cluster: dict[str, Any]) -> ClusterMap:
    nodes = sorted(set(cluster["homes"]) | set(cluster["live"]))
    m = ClusterMap(30)
    m.apply(
        cluster_pb2.ClusterInfoResponse(
            clustered=True,
            revision=1,
            members=[cluster_pb2.ClusterMember(node_id=n, address=f"{n}:1", live=n in cluster["live"]) for n in nodes],
            queues=[cluster_pb2.QueuePlacement(queue_name="q", homes=cluster["homes"], key_partitions=cluster["key_partitions"])],
        ),
        None,
        0,
    )
    m.apply_stats("q", [])
    return m


@pytest.mark.parametrize("case", [c for c in TABLE["cases"] if "client" in c], ids=lambda c: c["name"])
def test_the_sdk_routes_each_case_of_the_table(case: dict[str, Any]) -> None:
    m = map_of(case["cluster"])
    call = call_of(case["call"]["method"], case["call"]["request"])
    want = case["client"]
    if "one_of" in want:
        chosen = set()
        for _ in range(60):
            route = m.route(call, 0)
            chosen.add(route.node)
            m.leased("q", route.node, 0)  # found nothing there: a Lease moves on
        assert chosen == set(want["one_of"])
    else:
        assert m.route(call, 0).node == want["node"]


def test_every_key_vector_of_the_table() -> None:
    for vector in TABLE["key_partitions"]:
        assert key_partition(vector["key"], vector["partitions"]) == vector["partition"], vector


def test_a_server_before_key_partitions_spreads_keys_over_every_partition() -> None:
    m = map_of({"homes": ["n1", "n2", "n3"], "key_partitions": 0, "live": ["n1", "n2", "n3"]})
    assert m.home_of_key("q", "b") == "n3"  # crc32("b") % 3 = 2
