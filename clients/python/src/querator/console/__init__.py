"""``querator console``: a web console over the public gRPC API (docs/console.md).

Needs the ``console`` extra (``pip install 'querator-client[console]'``): Starlette,
Jinja2, uvicorn and python-multipart. Every asset is served by this package.
"""

from __future__ import annotations

from ._app import Console, ConsoleSettings, create_app

__all__ = ["Console", "ConsoleSettings", "create_app"]
