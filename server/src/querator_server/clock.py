"""Wall-clock time in integer microseconds since the Unix epoch.

Every stored instant (deadlines, created_at, due times) uses this unit, so
comparisons and keys are plain integers.
"""

from __future__ import annotations

import time

MICROS = 1_000_000


def now_us() -> int:
    return time.time_ns() // 1000
