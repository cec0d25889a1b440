"""The queues manager: the catalog of queues and one running actor per queue.

Admin changes (create, update, delete) are serialised by one lock and written to the
catalog before they take effect, so a crash never leaves an actor the catalog does
not know, and a queue the catalog knows always gets its actor back at start.
"""

from __future__ import annotations

from .catalog_records import CatalogRecords
from .queue_lifecycle import QueueLifecycle
from .set_aside import SetAsideQueues
from .shutdown import Shutdown
from .startup import Startup


class QueuesManager(Startup, Shutdown, QueueLifecycle, SetAsideQueues, CatalogRecords):
    """Owns the catalog and the logical queues: what it holds is state.py's, each role
    is a module of this package."""
