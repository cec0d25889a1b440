"""What encoding, decoding and leasing one item record costs, per item, in µs.

A bounded micro-benchmark of ``storage/record.py`` alone (no LMDB, no server): the
hot-path forms (a fresh 256-byte payload-only item; the plain lease rewrite; the
header read an ack does) and the general ones (an item with strings and metadata;
one with a history, as a re-queued or dead-lettered item has). Best of ``--rounds``
runs of ``--count`` items each, so a figure is the machine's, not its neighbours'.

    .venv/bin/python bench/record_codec.py [--count 200000] [--rounds 5] [--record PATH]

``--record`` measures another version of record.py (it imports nothing of the server),
e.g. ``git show <commit>:server/src/querator_server/storage/record.py > /tmp/old.py``,
so a change can be compared with what it replaced on the same machine.
"""

from __future__ import annotations

import argparse
import importlib.util
import sys
import time
from collections.abc import Callable
from types import ModuleType

PAYLOAD = b"x" * 256


def best_us(fn: Callable[[], object], count: int, rounds: int) -> float:
    best = float("inf")
    for _ in range(rounds):
        started = time.perf_counter()
        for _ in range(count):
            fn()
        best = min(best, time.perf_counter() - started)
    return best / count * 1e6


def load_record(path: str | None) -> ModuleType:
    if path is None:
        from querator_server.storage import record

        return record
    spec = importlib.util.spec_from_file_location("record_under_test", path)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # dataclasses look their module up
    spec.loader.exec_module(module)
    return module


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--count", type=int, default=200_000)
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--record", help="a record.py to measure instead of the installed one")
    args = parser.parse_args()
    record = load_record(args.record)
    Item, plain_leaser, read_state = record.Item, record.plain_leaser, record.read_state
    plain = Item(PAYLOAD, created_at=1_700_000_000_000_000, expire_deadline=1_800_000_000_000_000)
    rich = Item(
        PAYLOAD,
        kind="invoice",
        reference="order-1234",
        encoding="json",
        metadata={"traceparent": "00-0af7651916cd43dd8448eb211c80319c-b7ad6b7169203331-01"},
        created_at=1_700_000_000_000_000,
        expire_deadline=1_800_000_000_000_000,
    )
    cases: list[tuple[str, object]] = [("plain", plain), ("strings", rich)]
    if "message_id" in Item.__slots__:  # type: ignore[attr-defined]
        history = Item(
            PAYLOAD,
            source_id="7.0.1f",
            created_at=1_700_000_000_000_000,
            expire_deadline=1_800_000_000_000_000,
            message_id="7.0.1a",
            dead_reason=1,
            dead_at=1_700_000_100_000_000,
            dead_attempts=3,
        )
        cases.append(("history", history))
    leaser = plain_leaser(now=1_700_000_000_000_000, max_attempts=0, deadline=1_700_000_060_000_000, key_bytes=b"")
    raw_plain = plain.encode()
    print(f"{'record':<10}{'encode':>10}{'decode':>10}{'read_state':>12}")
    for name, item in cases:
        raw = item.encode()  # type: ignore[attr-defined]
        enc = best_us(item.encode, args.count, args.rounds)  # type: ignore[attr-defined]
        dec = best_us(lambda raw=raw: Item.decode(raw), args.count, args.rounds)  # type: ignore[misc]
        state = best_us(lambda raw=raw: read_state(raw), args.count, args.rounds)  # type: ignore[misc]
        print(f"{name:<10}{enc:>10.3f}{dec:>10.3f}{state:>12.3f}")
    lease = best_us(lambda: leaser(raw_plain), args.count, args.rounds)
    print(f"plain lease rewrite: {lease:.3f} µs per item")


if __name__ == "__main__":
    main()
