"""Driving ``Cycle`` directly on a real ``QueueStore`` with a chosen clock (tests only)."""

from __future__ import annotations

import asyncio

from querator_server.actor.cycle import Cycle
from querator_server.actor.ids import parse_id
from querator_server.actor.view import PartitionView
from querator_server.model import QueueConfig
from querator_server.storage import QueueStore
from querator_server.storage.keyed import KeyedIndex
from querator_server.storage.record import TAG_EXPIRY, TAG_ITEM, decode_u64, parse_expiry_key

SECOND = 1_000_000
T0 = 1_800_000_000 * SECOND


def request(message: object) -> object:
    """``message`` with the future a request carries (never awaited here)."""
    message.future = asyncio.Future(loop=asyncio.new_event_loop())  # type: ignore[attr-defined]
    return message


def run_cycle(
    store: QueueStore,
    config: QueueConfig,
    views: list[PartitionView],
    now: int,
    steps: object,
    keyed: KeyedIndex | None = None,
) -> Cycle:
    """One cycle at ``now``: ``steps(cycle, txn)``, then commit; ``views`` take its views."""

    def body(txn: object) -> Cycle:
        cycle = Cycle(store, config, views, now, keyed)
        steps(cycle, txn)  # type: ignore[operator]
        cycle.finish(txn)  # type: ignore[arg-type]
        return cycle

    cycle = store.write(body)  # type: ignore[arg-type]
    for p, view in cycle.views.items():
        views[p] = view
    return cycle


def seq_of(text: str) -> int:
    ref = parse_id(text)
    assert ref is not None
    return ref.seq


def stored_keys(store: QueueStore, p: int = 0) -> tuple[set[int], dict[int, int], int]:
    """Read straight from partition ``p``: the seqs of the stored items, the expiry
    deadline the index gives each stored item, and the number of index entries.

    Fails if an item is indexed twice or an entry indexes no stored item.
    """
    with store.env.begin() as txn:
        pairs = [(bytes(key), bytes(value)) for key, value in txn.cursor(db=store.db(p))]
    seqs = {int.from_bytes(key[1:], "big") for key, _ in pairs if key[:1] == TAG_ITEM}
    indexed: dict[int, int] = {}
    entries = [(key, value) for key, value in pairs if key[:1] == TAG_EXPIRY]
    for key, value in entries:
        deadline, target = parse_expiry_key(key)
        first = int.from_bytes(target[1:], "big")
        covered = set(range(first, decode_u64(value) + 1)) if value else {first}
        assert covered & seqs, f"an expiry entry indexes no stored item: {key!r}"
        for seq in covered & seqs:
            assert seq not in indexed, f"item {seq} is indexed twice"
            indexed[seq] = deadline
    return seqs, indexed, len(entries)
