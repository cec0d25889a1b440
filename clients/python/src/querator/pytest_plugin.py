"""pytest fixtures ``querator_server`` and ``querator_client`` (see :mod:`querator.testing`).

Loaded automatically through the ``pytest11`` entry point; or name it in a conftest:
``pytest_plugins = ["querator.pytest_plugin"]``.
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest

from ._client import Client
from .embedded import EmbeddedServer
from .testing import server


@pytest.fixture
def querator_server(tmp_path: Path) -> Iterator[EmbeddedServer]:
    """A real Querator server for one test, listening on a free 127.0.0.1 port."""
    with server(tmp_path / "querator-data") as srv:
        yield srv


@pytest.fixture
def querator_client(querator_server: EmbeddedServer) -> Iterator[Client]:
    """A :class:`~querator.Client` connected to ``querator_server``."""
    with querator_server.client() as client:
        yield client
