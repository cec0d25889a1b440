"""How a dead letter held in a replicated dead-letter queue names a one-copy source.

A one-copy queue's item ids carry its node's own storage uid (counted from 1 on every
node); a replicated queue's carry its shard's uid, the same on every node and never
below shard_record.SHARD_UID_BASE. A dead letter of a one-copy queue sent to a
replicated dead-letter queue is named "<node>/<id>": cluster-wide, and the same every
time it is sent again (the dead-letter queue deduplicates by it). Only that node may
redrive it, to its own queue of that uid; an unqualified id of a one-copy uid there
(stored before this naming) names no source safely and stays.
"""

from __future__ import annotations

from ..actor.ids import parse_id
from .shard_record import SHARD_UID_BASE


def qualify(node: str, source_id: str) -> str:
    """``source_id`` named cluster-wide: unchanged for a replicated source (or one
    qualified already), else prefixed with ``node``."""
    ref = parse_id(source_id)
    if ref is None or ref.uid >= SHARD_UID_BASE:
        return source_id
    return f"{node}/{source_id}"


def prefix(node: str) -> str:
    """What the source ids of ``node``'s one-copy queues start with."""
    return f"{node}/"
