"""The queues manager (queues_manager.py), a module per role:

- state.py: what it holds (catalog, settings, actors, copies, lanes, commit groups)
  and the rules its roles share;
- data_dir.py: what the data directory may hold, and its lock;
- startup.py, shutdown.py: start and stop;
- lookups.py: queues by name and uid, pages of names;
- actors.py: starting an actor, and a primary stepping down;
- queue_lifecycle.py: create, update, delete;
- copies.py: copies of replicated queues (open, promote, demote, reset, drop);
- set_aside.py: queues set aside;
- catalog_records.py: API keys and the cluster identity.
"""

from .data_dir import DataDirError
from .queues_manager import QueuesManager
from .state import SetAside

__all__ = ["DataDirError", "QueuesManager", "SetAside"]
