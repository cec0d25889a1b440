"""Which form a produce request takes: the compact one (ProduceRequest.payloads) for
batches of bare payloads, ProduceItems for everything else; both store the same."""

from __future__ import annotations

from datetime import UTC, datetime, timedelta

import querator
from querator import Item
from querator import _protocol as p

from sdk_helpers import client, queue, srv  # noqa: F401 (fixtures)


def _request(values: object, defaults: Item | None = None, trace: dict[str, str] | None = None) -> object:
    [batch] = list(p.produce_batches(values, defaults, trace=trace))  # type: ignore[arg-type]
    return p.produce_request("q", batch, 5.0)


def test_bare_payloads_go_compact() -> None:
    request = _request([b"a", "b", bytearray(b"c"), memoryview(b"d")])
    assert list(request.payloads) == [b"a", b"b", b"c", b"d"]  # type: ignore[attr-defined]
    assert not request.items  # type: ignore[attr-defined]
    assert not p.all_keyed(list(p.produce_batches([b"a"], None))[0])


def test_anything_more_than_a_payload_goes_as_items() -> None:
    later = datetime.now(UTC) + timedelta(hours=1)
    for values, defaults, trace in (
        ([b"a", Item(b"b", kind="k")], None, None),  # one item with more: the whole batch as items
        ([b"a"], Item(b"", encoding="text/plain"), None),
        ([b"a"], Item(b"", enqueue_at=later), None),
        ([b"a"], None, {"traceparent": "00-0af7651916cd43dd8448eb211c80319c-b7ad6b7169203331-01"}),
        ([Item(b"a", idempotency_key="k1")], None, None),
    ):
        request = _request(values, defaults, trace)
        assert not request.payloads and len(request.items) == len(values)  # type: ignore[attr-defined]
    mixed = _request([b"a", Item(b"b", kind="k")])
    assert [(i.payload, i.kind) for i in mixed.items] == [(b"a", ""), (b"b", "k")]  # type: ignore[attr-defined]
    assert p.all_keyed(list(p.produce_batches([Item(b"a", idempotency_key="k1")], None))[0])


def test_both_forms_store_the_same(client: querator.Client, queue: str) -> None:
    compact = client.produce(queue, [b"one", "two"])
    itemized = client.produce(queue, [Item(b"three"), Item("four")])
    leased = client.lease(queue, batch_size=10, wait=0)
    assert [(i.id, i.payload, i.kind, i.encoding) for i in leased] == [
        (compact.ids[0], b"one", "", ""),
        (compact.ids[1], b"two", "", ""),
        (itemized.ids[0], b"three", "", ""),
        (itemized.ids[1], b"four", "", ""),
    ]


def test_producers_keep_bare_payloads_bare() -> None:
    from querator._producer import _Settings

    def settings(kind: str = "", tracing: bool = False, priority: int = 0) -> _Settings:
        return _Settings("q", 100, 1 << 20, 0.01, 2, 1000, "", kind, "", None, priority, tracing)

    assert settings().message(b"x", None, None) == (b"x", 7)
    assert settings().message("y", None, None) == (b"y", 7)
    for made in (
        settings().message(b"x", "key-1", None),
        settings().message(b"x", None, {"a": "b"}),
        settings().message(Item(b"x"), None, None),
        settings(kind="k").message(b"x", None, None),
        settings(priority=3).message(b"x", None, None),
    ):
        assert not isinstance(made[0], bytes)
