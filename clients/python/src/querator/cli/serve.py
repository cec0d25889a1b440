"""``querator serve``: run the server, when the querator-server package is installed.

It parses its own arguments (the server's), so it is dispatched before the client
commands' parser runs; of the options before it, ``--address`` and ``--json`` apply
(the listening address; JSON log lines, the server's ``--log-json``).
"""

from __future__ import annotations

import argparse
import sys
from typing import Any

from ._common import Commands

MISSING = "querator: 'serve' runs the server, which is not installed here: pip install querator-server"
HELP = "run the server (needs the querator-server package)"


def register(commands: Commands) -> None:
    commands.raw("serve", HELP)


def _server() -> tuple[Any, Any] | None:
    try:
        from querator_server.cli import add_serve_arguments, run_serve
    except ModuleNotFoundError as exc:
        if exc.name is not None and exc.name.split(".")[0] == "querator_server":
            return None
        raise
    return add_serve_arguments, run_serve


def run(top: argparse.Namespace, argv: list[str]) -> int:
    """``querator [--address A] [--json] serve ARGV``; ``top`` holds only the options given."""
    server = _server()
    if server is None:
        print(MISSING, file=sys.stderr)
        return 2
    add_serve_arguments, run_serve = server
    # The options before "serve" become the server's own, ahead of ARGV (whose win): the
    # server may start itself again from these arguments alone.
    server_argv = [
        *(["--address", top.address] if getattr(top, "address", None) else []),
        *(["--log-json"] if getattr(top, "json", False) else []),
        *argv,
    ]
    parser = argparse.ArgumentParser(prog="querator serve", description="Run the Querator server.")
    add_serve_arguments(parser)
    return int(run_serve(parser.parse_args(server_argv), server_argv))
