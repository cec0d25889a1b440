"""``querator console``: serve the web console (querator.console) until interrupted.

The console is a client of the server named by ``--address`` (one server, or a
cluster's addresses) with the same TLS options as every command. With ``--token`` every
visitor acts with that key; without it, when the server checks keys, each visitor logs
in with their own, kept in the console's memory for their session.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import ipaddress
import signal
import sys
from collections.abc import Iterator
from typing import Any

from .._async_client import AsyncClient
from .._client import Client
from ._common import Commands, UsageError, client_options

DEFAULT_LISTEN = "127.0.0.1:2320"
MISSING = "querator: 'console' needs the console extra: pip install 'querator-client[console]'"


def split_listen(text: str) -> tuple[str, int]:
    host, sep, port = text.rpartition(":")
    if not sep or not port.isdigit() or int(port) > 65535:
        raise UsageError(f"--listen takes HOST:PORT, got {text!r}")
    return host.strip("[]") or "127.0.0.1", int(port)


def is_loopback(host: str) -> bool:
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


def cmd_console(args: argparse.Namespace, client: Client) -> int:
    try:
        import uvicorn

        from ..console import Console, ConsoleSettings
    except ModuleNotFoundError as exc:
        if exc.name is not None and exc.name.split(".")[0] in ("uvicorn", "starlette", "jinja2", "multipart", "python_multipart"):
            print(MISSING, file=sys.stderr)
            return 2
        raise
    _Server = _server_class()
    host, port = split_listen(args.listen)
    if not is_loopback(host):
        print(
            f"querator console: listening on {host}, beyond this machine: anyone who reaches it can use "
            + ("the --token key" if args.token else "the console with their own key"),
            file=sys.stderr,
        )
    options: dict[str, Any] = client_options(args)
    options.pop("bearer_token", None)

    def make_client(token: str | None) -> AsyncClient:
        return AsyncClient(args.address, bearer_token=token or None, **options)

    hosts = tuple(args.allowed_host or ())
    if not hosts and is_loopback(host):
        hosts = (host, "127.0.0.1", "localhost", "::1", "[::1]")
    console = Console(
        ConsoleSettings(
            make_client=make_client,
            token=args.token or None,
            read_only=args.read_only,
            target=args.address,
            allowed_hosts=hosts,
        )
    )
    config = uvicorn.Config(console.app(), host=host, port=port, log_level="warning", access_log=False)
    server = _Server(config)

    async def serve() -> None:
        task = asyncio.create_task(server.serve())
        while not server.started and not task.done():
            await asyncio.sleep(0.02)
        if server.started:
            bound = server.servers[0].sockets[0].getsockname()
            mode = " (read-only)" if args.read_only else ""
            print(f"querator console: serving http://{host}:{bound[1]}/ for {args.address}{mode}", flush=True)
        await task

    asyncio.run(serve())
    return 0 if server.started else 1


def _server_class() -> type[Any]:
    import uvicorn

    class Server(uvicorn.Server):
        """uvicorn's server, stopping cleanly on SIGTERM and SIGINT (exit 0, as
        ``querator serve`` does) instead of raising the signal again once stopped."""

        @contextlib.contextmanager
        def capture_signals(self) -> Iterator[None]:
            handlers = {sig: signal.signal(sig, self.handle_exit) for sig in (signal.SIGINT, signal.SIGTERM)}
            try:
                yield
            finally:
                for sig, handler in handlers.items():
                    signal.signal(sig, handler)

    return Server


def register(commands: Commands) -> None:
    p = commands.leaf("console", cmd_console, "serve the web console (needs querator-client[console])")
    p.add_argument("--listen", default=DEFAULT_LISTEN, help=f"HOST:PORT to serve on (default {DEFAULT_LISTEN}: this machine only)")
    p.add_argument("--read-only", action="store_true", help="show everything, change nothing: no action is offered or taken")
    p.add_argument(
        "--allowed-host",
        action="append",
        metavar="NAME",
        help="a host name the browser may use to reach the console (repeatable; default on loopback: "
        "127.0.0.1, localhost, ::1; elsewhere: any)",
    )
