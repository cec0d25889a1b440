"""A grouped queue that outgrew its commit group leaves it for an environment of its own.

Between two cycles of its actor: the queue's storage is copied out of the group (on the
group's lane), the move is recorded (the catalog), then the group's copy is dropped. A
crash between the copy and the record leaves the group's copy in charge (start-up drops
the new one); after the record, the new one (start-up drops what the group no longer
owns). Nothing changes if the copy or the record fails.
"""

from __future__ import annotations

from collections.abc import Callable
from functools import partial

from ..errors import QueratorError, Unavailable
from ..faults import MOVE_COPIED, MOVE_RECORDED, crash_point
from ..logging import get_logger
from ..storage import QueueStore, StorageError
from ..storage.commit_group import CommitGroup
from ..storage.keyed import KeyedIndex
from ..storage.lane import StorageLane
from .batch import Reconfigure
from .transaction import answer

log = get_logger("queue")


async def leave_group(
    queue: str,
    group: CommitGroup,
    old: QueueStore,
    lane: StorageLane,
    request: Reconfigure,
    adopt: Callable[[QueueStore, KeyedIndex], None],
) -> bool:
    """Whether the queue left the group: its actor ``adopt``s the new store and its
    keyed indexes before the group's copy is dropped. When it stays, ``request`` is
    answered with why."""
    assert request.move_out is not None and request.persist is not None
    try:
        store = await group.job(partial(request.move_out, old))
    except (StorageError, OSError) as exc:
        answer(request, Unavailable(f"storage failed, retry later: {exc}"))
        return False
    try:
        keyed = await lane.run(partial(KeyedIndex, store))
        crash_point(MOVE_COPIED)
        await request.persist()
        crash_point(MOVE_RECORDED)
    except Exception as exc:
        await lane.run(store.destroy)
        answer(request, exc if isinstance(exc, QueratorError) else Unavailable(f"storage failed, retry later: {exc}"))
        return False
    store.on_commit = old.on_commit
    adopt(store, keyed)
    try:
        await group.job(old.destroy)
    except StorageError as exc:  # start-up drops what the catalog no longer owns
        log.warning("group_storage_left", queue=queue, error=str(exc))
    return True
