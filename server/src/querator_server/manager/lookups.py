"""Finding queues: by name, by storage uid, a page of names, and the actor serving one."""

from __future__ import annotations

import bisect
import itertools
from collections.abc import Callable, Iterable

from ..actor import LogicalQueue
from ..errors import NotFound, Unavailable
from ..model import QueueConfig
from .state import ManagerState


class Lookups(ManagerState):
    def actor(self, name: str) -> LogicalQueue:
        actor = self._actors.get(name)
        if actor is None or name in self._failed:
            if name in self._failed:
                raise self._failed_error(name)
            if self._closing:
                raise self._shutting_down()
            if name in self._copies:
                raise Unavailable(f"queue {name!r} is not served on this node (it keeps a passive copy); retry at its primary")
            raise NotFound(f"queue {name!r} does not exist")
        return actor

    def actor_by_uid(self, uid: int) -> LogicalQueue | None:
        """The running actor of the queue whose storage uid is ``uid`` (None: none is;
        the queue was deleted)."""
        return next((actor for actor in self._actors.values() if actor.config.uid == uid), None)

    def queues(self) -> Iterable[LogicalQueue]:
        return self._actors.values()

    def get(self, name: str) -> QueueConfig:
        config = self._configs.get(name)
        if config is None:
            raise NotFound(f"queue {name!r} does not exist")
        return config

    def list(
        self, after: str, limit: int, visible: Callable[[str], bool] | None = None
    ) -> tuple[list[QueueConfig], bool]:
        """Up to ``limit`` queues named after ``after`` (and ``visible``), and whether more follow."""
        start = bisect.bisect_right(self._names, after) if after else 0
        if visible is None:
            names = self._names[start : start + limit + 1]
        else:
            names = []
            for name in itertools.islice(self._names, start, None):
                if visible(name):
                    names.append(name)
                    if len(names) > limit:
                        break
        return [self._configs[n] for n in names[:limit]], len(names) > limit

    def queues_by_uid(
        self, visible: Callable[[str], bool] | None = None, origin: QueueConfig | None = None
    ) -> dict[int, str]:
        """The name of every queue (that is ``visible``) a redrive out of ``origin`` may
        move items back to, by storage uid; with those it reaches elsewhere
        (``redrive_targets``).

        A replicated origin's items were dead-lettered on whichever node was its primary
        then, or sent there from another node: a one-copy queue's uid in their source_id
        is the uid on *that* node, and here it may name another queue. Only the uids the
        cluster hands out (replicated queues') name a source safely there; the others'
        items stay and are counted skipped.
        """
        here = {c.uid: c.name for c in self._configs.values() if visible is None or visible(c.name)}
        if self.redrive_targets is None:
            return here
        elsewhere = self.redrive_targets(visible)
        if origin is not None and origin.replicas > 1:
            return elsewhere
        return {**elsewhere, **here}

    def own_sources(
        self, visible: Callable[[str], bool] | None, origin: QueueConfig
    ) -> tuple[str, dict[int, str]]:
        """For a redrive out of a replicated ``origin``: the prefix naming this node's
        one-copy sources there, and those queues by uid (``RedriveRequest.own``)."""
        if not self.own_source_prefix or origin.replicas <= 1:
            return "", {}
        mine = {c.uid: c.name for c in self._configs.values() if c.replicas <= 1 and (visible is None or visible(c.name))}
        return self.own_source_prefix, mine

    def uid_of(self, name: str) -> int:
        """The storage uid of queue ``name`` here, or of a replicated queue whose primary
        is another node (a redrive's target_queue); NotFound when neither."""
        config = self._configs.get(name)
        if config is not None:
            return config.uid
        elsewhere = {} if self.redrive_targets is None else self.redrive_targets(None)
        uid = next((u for u, n in elsewhere.items() if n == name), 0)
        if not uid:
            raise NotFound(f"queue {name!r} does not exist")
        return uid
