"""What encoding, decoding and leasing one item record costs, per item, in µs.

A bounded micro-benchmark of ``storage/record.py`` alone (no LMDB, no server): the
hot-path forms (a fresh 256-byte payload-only item, its plain lease rewrite, the
header read an ack does) and the general ones (an item with strings and metadata;
one with a history, as a re-queued or dead-lettered item has). Each figure is the
best of ``--rounds`` runs of ``--count`` items, so it is the machine's, not its
neighbours'.

    .venv/bin/python bench/record_codec.py [--count 200000] [--rounds 5] [--against PATH]

``--against`` also measures another version of record.py (it imports nothing of the
server), e.g. ``git show <commit>:server/src/querator_server/storage/record.py >
/tmp/old.py``, in rounds alternating with the installed one, so both meet the same
load and a change can be compared with what it replaced.
"""

from __future__ import annotations

import argparse
import importlib.util
import sys
import time
from collections.abc import Callable
from types import ModuleType

PAYLOAD = b"x" * 256
CREATED, EXPIRE = 1_700_000_000_000_000, 1_800_000_000_000_000


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


def cases(record: ModuleType) -> dict[str, Callable[[], object]]:
    """The measured operations of one record module, by name."""
    Item = record.Item
    items = {
        "plain": Item(PAYLOAD, created_at=CREATED, expire_deadline=EXPIRE),
        "strings": Item(
            PAYLOAD,
            kind="invoice",
            reference="order-1234",
            encoding="json",
            metadata={"traceparent": "00-0af7651916cd43dd8448eb211c80319c-b7ad6b7169203331-01"},
            created_at=CREATED,
            expire_deadline=EXPIRE,
        ),
    }
    if "message_id" in Item.__slots__:
        items["history"] = Item(
            PAYLOAD,
            source_id="7.0.1f",
            created_at=CREATED,
            expire_deadline=EXPIRE,
            message_id="7.0.1a",
            dead_reason=1,
            dead_at=CREATED + 100,
            dead_attempts=3,
        )
    out: dict[str, Callable[[], object]] = {}
    for name, item in items.items():
        raw = item.encode()
        out[f"{name} encode"] = item.encode
        out[f"{name} decode"] = lambda raw=raw: Item.decode(raw)
        out[f"{name} read_state"] = lambda raw=raw: record.read_state(raw)
    leaser = record.plain_leaser(now=CREATED, max_attempts=0, deadline=CREATED + 60_000_000, key_bytes=b"")
    raw_plain = items["plain"].encode()
    out["plain lease rewrite"] = lambda: leaser(raw_plain)
    return out


def run_once(fn: Callable[[], object], count: int) -> float:
    started = time.perf_counter()
    for _ in range(count):
        fn()
    return (time.perf_counter() - started) / count * 1e6


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--count", type=int, default=200_000)
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--against", help="another record.py to measure alongside the installed one")
    args = parser.parse_args()
    versions = {"installed": cases(load_record(None))}
    if args.against:
        versions["against"] = cases(load_record(args.against))
    best: dict[tuple[str, str], float] = {}
    for _ in range(args.rounds):
        for version, ops in versions.items():
            for name, fn in ops.items():
                key = (version, name)
                best[key] = min(best.get(key, float("inf")), run_once(fn, args.count))
    names = list(versions["installed"])
    print(f"{'µs per item':<24}" + "".join(f"{v:>12}" for v in versions))
    for name in names:
        cells = "".join(
            f"{best[(v, name)]:>12.3f}" if (v, name) in best else f"{'-':>12}" for v in versions
        )
        print(f"{name:<24}{cells}")


if __name__ == "__main__":
    main()
