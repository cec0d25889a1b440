from querator.v1 import queue_pb2

from conftest import Stubs


def test_produce_lease_complete_round_trip(stubs: Stubs) -> None:
    stubs.create("smoke")
    produced = stubs.produce("smoke", [b"a", b"b", b"c"])
    assert len(produced.ids) == 3
    leased = stubs.lease("smoke", batch_size=10, client_id="c1")
    assert [i.payload for i in leased.items] == [b"a", b"b", b"c"]
    assert all(i.attempts == 1 for i in leased.items)
    stubs.complete("smoke", leased.partition, [i.id for i in leased.items])
    stats = stubs.stats("smoke")
    assert stats.partitions[0].total == 0
    empty = stubs.lease("smoke", batch_size=1, request_timeout={"nanos": 200_000_000})
    assert list(empty.items) == []
    assert isinstance(empty, queue_pb2.LeaseResponse)
