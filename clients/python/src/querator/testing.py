"""Test helpers: a real Querator server in this process, on a temp dir and a free port.

Use the context manager::

    from querator.testing import server

    def test_jobs():
        with server() as srv, srv.client() as client:
            client.create_queue("jobs")
            ...

or the pytest fixtures (registered automatically when ``querator-client`` is
installed, through the ``pytest11`` entry point ``querator``):

- ``querator_server``: a running :class:`EmbeddedServer` for one test, data in ``tmp_path``;
- ``querator_client``: a :class:`~querator.Client` connected to it.

Both need the server package (``pip install querator-server``).
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

from .embedded import EmbeddedServer


@contextmanager
def server(data_dir: str | Path | None = None, **options: Any) -> Iterator[EmbeddedServer]:
    """A started :class:`EmbeddedServer`, stopped (and its temp dir removed) on exit.

    fsync is off unless ``sync=True`` is given: test data is thrown away.
    """
    options.setdefault("sync", False)
    options.setdefault("log_level", "warning")
    srv = EmbeddedServer(data_dir, **options)
    srv.start()
    try:
        yield srv
    finally:
        srv.stop()


__all__ = ["EmbeddedServer", "server"]
