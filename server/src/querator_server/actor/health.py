"""The health of a queue's storage, as its actor sees it.

- **Faulty partitions** (cycle_base.py): a partition whose database failed is left out
  (no produce or lease goes to it) and probed again, first after ``PROBE_FIRST_S``, then
  ever less often, up to ``PROBE_MAX_S``: a probe reads the whole partition (as a start
  does), so a damaged one that stays damaged costs one read every half minute.
- **A failing storage**: a commit failed (a full disk or map, an I/O error). That
  concerns the whole environment, not one partition: every partition is reported faulty
  with the cause while it lasts, but none is left out, and every cycle tries the storage
  again until a commit proves it takes writes; with no call waiting, a cycle tries it
  ``PROBE_FIRST_S`` after the last failure, then ever less often, up to
  ``STORAGE_PROBE_MAX_S``. A cycle that fails on a full disk costs next to nothing.
- **A failed queue**: storage failing on every cycle (a full disk apart, which frees up)
  for ``fail_after_s`` marks the queue failed instead of failing calls in a loop.
"""

from __future__ import annotations

from collections.abc import Callable

from ..clock import now_us
from ..errors import NoHealthyPartition, QueratorError, ResourceExhausted, Unavailable
from ..logging import RepeatedFailure, get_logger
from ..storage import StorageError, StorageFull
from ..storage.queue_store import disk_full, low_on_space
from .cycle import Cycle
from .requests import ProduceRequest, Request

log = get_logger("queue")

PROBE_FIRST_S = 0.5
PROBE_MAX_S = 30.0
STORAGE_PROBE_MAX_S = 5.0
# A storage failure that goes on is logged again at most this often (with a count).
STORAGE_LOG_EVERY_S = 60.0


class StorageHealth:
    """What is known of one queue's storage. ``on_partitions(queue, faulty)`` is told the
    number of partitions reported faulty when it changes; ``partitions()`` gives the
    queue's partition count."""

    def __init__(
        self,
        queue: str,
        path: str,
        partitions: Callable[[], int],
        *,
        fail_after_s: float,
        on_partitions: Callable[[str, int], None] | None = None,
    ) -> None:
        self._queue = queue
        self._path = path
        self._partitions = partitions
        self._on_partitions = on_partitions
        # Faulty partitions: partition -> why, and since when (wall µs). Replaced, never
        # changed in place, so a cycle may hold the one it was given.
        self.faulty: dict[int, str] = {}
        self.faulty_since: dict[int, int] = {}
        self._probe_at = 0  # when to probe them next (wall µs)
        self._probe_delay_s = PROBE_FIRST_S
        self.probing: list[int] = []  # the partitions the running cycle probes
        # A failing storage: why, since when (wall µs), and whether the disk or map is full.
        self.failure = ""
        self.failing_since = 0
        self._full = False
        self._storage_probe_at = 0  # when to try it again with no call waiting (wall µs)
        self._storage_probe_delay_s = PROBE_FIRST_S
        self._failures: RepeatedFailure | None = None
        # A run of failed cycles (toward a failed queue).
        self._fail_after_us = int(fail_after_s * 1_000_000)
        self._run_since = 0  # wall µs of the first failed cycle in a row; 0: none
        self._run_cycles = 0

    # -- what callers read ---------------------------------------------------------

    def faulty_count(self) -> int:
        """The partitions reported faulty: all of them while the storage is failing."""
        return self._partitions() if self.failure else len(self.faulty)

    def failure_of(self, p: int) -> tuple[str, int]:
        """Why partition ``p`` is reported faulty and since when ("", 0: it is not)."""
        return self.faulty.get(p) or self.failure, self.faulty_since.get(p) or self.failing_since

    def probe_due(self) -> bool:
        if not (self.faulty or self.failure):  # the common case, on every turn of the loop
            return False
        now = now_us()
        return bool(self.faulty) and now >= self._probe_at or bool(self.failure) and now >= self._storage_probe_at

    def wake_times(self) -> list[int]:
        """When the actor must wake to probe (wall µs)."""
        return ([self._probe_at] if self.faulty else []) + ([self._storage_probe_at] if self.failure else [])

    # -- probes --------------------------------------------------------------------

    def take_probes(self, now: int) -> list[int]:
        """The faulty partitions this cycle probes (all of them, when a probe is due)."""
        if not self.faulty or now < self._probe_at:
            self.probing = []
        else:
            self._probe_at = now + int(self._probe_delay_s * 1_000_000)
            self._probe_delay_s = min(self._probe_delay_s * 2, PROBE_MAX_S)
            self.probing = sorted(self.faulty)
        return self.probing

    def take_storage_probe(self, now: int) -> bool:
        """Whether this cycle is to try the failing storage with no call waiting. Not on
        a file system still full: a small write may succeed there (LMDB reuses freed
        pages) while it proves nothing."""
        if not self.failure or now < self._storage_probe_at:
            return False
        self._storage_probe_at = now + int(self._storage_probe_delay_s * 1_000_000)
        self._storage_probe_delay_s = min(self._storage_probe_delay_s * 2, STORAGE_PROBE_MAX_S)
        return not (self._full and low_on_space(self._path))

    # -- what cycles found ---------------------------------------------------------

    def partitions_changed(self, faulty: dict[int, str], recovered: dict[int, object], now: int) -> list[int]:
        """Adopt what a committed cycle found: partitions now faulty, and probed ones that
        work again (their views came with the cycle's). Answers the newly faulty ones."""
        newly = [p for p in faulty if p not in self.faulty]
        self.faulty = {**{p: why for p, why in self.faulty.items() if p not in recovered}, **faulty}
        self.faulty_since = {p: self.faulty_since.get(p, now) for p in self.faulty}
        for p in newly:
            log.error("partition_faulty", queue=self._queue, partition=p, reason=faulty[p])
        if newly and len(self.faulty) == len(newly):
            self._probe_at = now + int(PROBE_FIRST_S * 1_000_000)
            self._probe_delay_s = PROBE_FIRST_S * 2
        if not self.faulty:
            self._probe_delay_s = PROBE_FIRST_S
        if newly or recovered:
            self._told()
        return newly

    def recovered(self, p: int, now: int) -> None:
        since = self.faulty_since.get(p, 0)
        log.warning("partition_recovered", queue=self._queue, partition=p, faulty_s=round((now - since) / 1e6, 1))

    def storage_failed(self, exc: StorageError) -> None:
        """A commit failed: every partition is reported faulty with why until a commit
        works again (``storage_works``)."""
        now = now_us()
        first = not self.failure
        self.failure = f"its storage failed: {exc}"
        self._full = disk_full(exc)
        self._storage_probe_at = now + int(PROBE_FIRST_S * 1_000_000)
        self._storage_probe_delay_s = PROBE_FIRST_S * 2
        if first:
            self.failing_since = now
            self._failures = RepeatedFailure(STORAGE_LOG_EVERY_S)
            self._told()
        assert self._failures is not None
        reported = self._failures.failed()
        if reported:
            log.error("storage_failed", queue=self._queue, error=str(exc), failures=reported)

    def storage_works(self, cycle: Cycle) -> None:
        """A cycle that wrote (changed a partition, or ``touch``) committed while the
        storage was failing: it works again, unless the disk is still full (a write LMDB
        fitted into freed pages proves nothing then: the next Produce would fail again)."""
        if not (cycle.views or cycle.touched) or (self._full and low_on_space(self._path)):
            return
        failures = self._failures.failures if self._failures is not None else 0
        log.warning(
            "storage_recovered",
            queue=self._queue,
            failing_s=round((cycle.now - self.failing_since) / 1e6, 1),
            failures=failures,
        )
        self.failure = ""
        self.failing_since = 0
        self._full = False
        self._failures = None
        self._storage_probe_delay_s = PROBE_FIRST_S
        self._told()

    def cycle_failed(self, reason: str) -> str:
        """Another cycle failed for the storage (not a full disk, which frees up). Answers
        why the queue has failed once it has failed on every cycle for ``fail_after_s``
        (at least 3 cycles), else ""."""
        now = now_us()
        if not self._run_since:
            self._run_since = now
        self._run_cycles += 1
        if self._run_cycles < 3 or now - self._run_since < self._fail_after_us:
            return ""
        seconds = (now - self._run_since) / 1e6
        return f"its storage failed on every cycle for {seconds:.0f} s ({self._run_cycles} cycles): {reason}"

    def cycle_wrote(self, cycle: Cycle) -> None:
        """A committed write (a listing proves nothing of writes) ends a run of failures."""
        if self._run_cycles and cycle.writable and not any(r is None for r, _ in cycle.step_failures):
            self._run_since = self._run_cycles = 0

    def _told(self) -> None:
        if self._on_partitions is not None:
            self._on_partitions(self._queue, self.faulty_count())


def storage_error(exc: StorageError, request: Request | None = None) -> QueratorError:
    """What a request that a failed commit did not apply answers."""
    if isinstance(exc, StorageFull):
        return ResourceExhausted(str(exc))
    if isinstance(request, ProduceRequest) and disk_full(exc):
        # Nothing of a commit that ran out of space was stored: in a cluster another
        # home may take the items (the router tries one for an unkeyed Produce).
        return NoHealthyPartition(f"storage failed, retry later: {exc}")
    return Unavailable(f"storage failed, retry later: {exc}")
