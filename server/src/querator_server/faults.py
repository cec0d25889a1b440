"""Named crash points for crash-recovery tests.

Setting ``QUERATOR_CRASH_AT=<name>`` in a server's environment makes the process
kill itself with SIGKILL when it reaches that point, so tests can prove recovery
from a crash at exactly the worst moment. Unset, a crash point costs one dict lookup.
"""

from __future__ import annotations

import os
import signal

DEAD_LETTER_STORED = "dead-letter-stored"
"""After the dead-letter queue committed an outbox batch, before the source dropped it."""


def crash_point(name: str) -> None:
    if os.environ.get("QUERATOR_CRASH_AT") == name:
        os.kill(os.getpid(), signal.SIGKILL)
