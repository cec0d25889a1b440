"""The SDK's item models carry each item's stable message id and a dead letter's
history (why, when, after how many attempts), from Lease and ListItems alike, in the
sync and async clients; ImportItems keeps them. A real server on tmp_path."""

from __future__ import annotations

from datetime import UTC, datetime, timedelta

import pytest

import querator
from querator import DeadReason
from querator.embedded import EmbeddedServer

from sdk_helpers import client, run, srv, unique, wait_until  # noqa: F401 (fixtures)


def test_a_dead_letter_keeps_its_message_id_and_says_why_and_when(client: querator.Client) -> None:
    dlq, name = unique("dlq"), unique()
    client.create_queue(dlq)
    client.create_queue(name, dead_queue=dlq, max_attempts=3)
    (produced,) = client.produce(name, ["job"]).ids
    first = client.lease(name, wait=0)[0]
    assert (first.message_id, first.source_id, first.dead_reason, first.dead_at) == (produced, "", None, None)
    first.retry()
    second = client.lease(name, wait=0)[0]
    assert second.id != produced and second.message_id == produced and second.attempts == 2
    before = datetime.now(UTC)
    second.dead()
    wait_until(lambda: list(client.list_items(dlq)))

    (stored,) = client.list_items(dlq)
    assert (stored.message_id, stored.source_id, stored.dead_reason, stored.dead_attempts, stored.attempts) == (
        produced,
        second.id,
        DeadReason.RETRY_DEAD,
        2,
        0,
    )
    assert stored.dead_at is not None and before - timedelta(seconds=1) <= stored.dead_at <= datetime.now(UTC)
    assert stored.dead_reason == "retry_dead"  # a str enum: logs and JSON show the word

    (dead,) = client.lease(dlq, wait=0)
    assert (dead.message_id, dead.source_id, dead.dead_reason, dead.dead_at, dead.dead_attempts) == (
        produced,
        second.id,
        DeadReason.RETRY_DEAD,
        stored.dead_at,
        2,
    )
    assert dead.id != produced and dead.attempts == 1


def test_the_async_twin_and_import_carry_the_history(srv: EmbeddedServer, client: querator.Client) -> None:
    source, copy = unique(), unique()
    client.create_queue(source)
    client.create_queue(copy)
    died = datetime(2026, 1, 2, 3, 4, 5, tzinfo=UTC)
    client.import_items(
        source,
        [
            querator.StoredItem(
                payload=b"x",
                message_id="7.0.1",
                source_id="7.0.9",
                dead_reason=DeadReason.MAX_ATTEMPTS,
                dead_at=died,
                dead_attempts=5,
            ),
            querator.StoredItem(payload=b"fresh"),
        ],
    )
    listed = list(client.list_items(source))
    assert (listed[0].message_id, listed[0].dead_reason, listed[0].dead_at, listed[0].dead_attempts) == (
        "7.0.1",
        DeadReason.MAX_ATTEMPTS,
        died,
        5,
    )
    assert listed[1].message_id == listed[1].id and listed[1].dead_reason is None and listed[1].dead_at is None
    # An exported item imported elsewhere keeps its history.
    client.import_items(copy, [listed[0]])
    assert next(iter(client.list_items(copy))).message_id == "7.0.1"

    async def lease_async() -> list[querator.AsyncLeasedItem]:
        async with querator.AsyncClient(srv.address) as aclient:
            return await aclient.lease(source, batch_size=2, wait=0)

    items = run(lease_async())
    assert [(i.message_id, i.source_id, i.dead_reason, i.dead_at, i.dead_attempts) for i in items] == [
        ("7.0.1", "7.0.9", DeadReason.MAX_ATTEMPTS, died, 5),
        (listed[1].id, "", None, None, 0),
    ]


def _dead_letters(client: querator.Client, dlq: str, name: str, payloads: list[str], kind: str = "") -> dict[str, str]:
    """Produce into ``name`` and give every item up as dead; message id by payload."""
    client.produce(name, [querator.Item(p, kind=kind) for p in payloads])
    ids: dict[str, str] = {}
    for item in client.lease(name, batch_size=len(payloads), wait=0):
        ids[item.text] = item.message_id
        item.dead()
    wait_until(lambda: len(list(client.list_items(dlq))) >= len(payloads))
    return ids


def test_redrive_items_moves_dead_letters_back_with_their_message_ids(srv: EmbeddedServer, client: querator.Client) -> None:
    dlq, name, other = unique("dlq"), unique(), unique("other")
    client.create_queue(dlq)
    client.create_queue(name, dead_queue=dlq)
    client.create_queue(other)
    ids = _dead_letters(client, dlq, name, ["a", "b", "c"], kind="k")
    ids |= _dead_letters(client, dlq, name, ["z"], kind="other")

    assert client.redrive_items(dlq, dead_reason=DeadReason.EXPIRED) == querator.RedriveResult()
    first = client.redrive_items(dlq, kind="k", limit=2, dead_reason="retry_dead")
    assert first.moved == 2 and first.skipped == 0 and set(first.message_ids) <= {ids["a"], ids["b"], ids["c"]}
    back = {i.payload.decode(): i for i in client.list_items(name)}
    assert {back[p].message_id for p in back} == set(first.message_ids)
    assert all(i.dead_reason is None and i.attempts == 0 for i in back.values())

    async def rest() -> querator.RedriveResult:
        async with querator.AsyncClient(srv.address) as aclient:
            return await aclient.redrive_items(dlq, to=other)

    moved = run(rest())
    assert moved.moved == 2 and list(client.list_items(dlq)) == []
    assert sorted(i.message_id for i in client.list_items(other)) == sorted(moved.message_ids)
    with pytest.raises(ValueError):
        client.redrive_items(dlq, limit=0)
    with pytest.raises(querator.InvalidRequest):
        client.redrive_items(dlq, to=dlq)
