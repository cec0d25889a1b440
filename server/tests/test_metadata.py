"""Item metadata: string pairs carried from produce to lease (e.g. trace context)."""

from __future__ import annotations

import grpc
import pytest

from querator.v1 import queue_pb2

from conftest import Stubs


def test_metadata_travels_from_produce_to_lease_and_listing(stubs: Stubs) -> None:
    stubs.create("meta")
    pairs = {"traceparent": "00-0af7651916cd43dd8448eb211c80319c-b7ad6b7169203331-01", "tenant": "é"}
    item = queue_pb2.ProduceItem(payload=b"x", metadata=pairs)
    stubs.queue.Produce(queue_pb2.ProduceRequest(queue_name="meta", items=[item, queue_pb2.ProduceItem(payload=b"y")]))
    leased = stubs.lease("meta", batch_size=2)
    assert dict(leased.items[0].metadata) == pairs
    assert dict(leased.items[1].metadata) == {}
    assert dict(stubs.list_items("meta")[0].metadata) == pairs


@pytest.mark.parametrize(
    "pairs",
    [{"": "x"}, {"k" * 257: "x"}, {f"k{i}": "v" for i in range(65)}, {"big": "v" * 17_000}],
)
def test_metadata_limits(stubs: Stubs, pairs: dict[str, str]) -> None:
    stubs.create("metalimits")
    item = queue_pb2.ProduceItem(payload=b"x", metadata=pairs)
    with pytest.raises(grpc.RpcError) as err:
        stubs.queue.Produce(queue_pb2.ProduceRequest(queue_name="metalimits", items=[item]), timeout=5)
    assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert "items[0].metadata" in err.value.details()
