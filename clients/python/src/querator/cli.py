"""The ``querator`` command line."""

from __future__ import annotations

import argparse
import sys


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="querator", description="Querator work-queue service.")
    commands = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    serve = commands.add_parser("serve", help="run the server (needs the querator-server package)")
    try:
        from querator_server.cli import add_serve_arguments, run_serve
    except ImportError:
        add_serve_arguments = run_serve = None
    if add_serve_arguments is not None:
        add_serve_arguments(serve)
    args = parser.parse_args(argv)
    if args.command == "serve":
        if run_serve is None:
            print("querator: 'serve' needs the server: pip install querator-server", file=sys.stderr)
            return 2
        return int(run_serve(args))
    parser.error(f"unknown command {args.command}")
    return 2


if __name__ == "__main__":
    sys.exit(main())
