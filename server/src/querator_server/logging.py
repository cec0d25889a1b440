"""structlog set-up: coloured lines on a terminal, JSON lines otherwise.

Whatever else logs in the process is made to follow: the standard library's logging
(asyncio's "Task exception was never retrieved", grpc's Python side) and warnings go
through the same renderer, and gRPC's C core, which writes plain text to the stderr
file descriptor, is kept to errors and fatal errors (``quiet_grpc_core``).
"""

from __future__ import annotations

import logging
import os
import sys

import structlog

# gRPC's C core logs at INFO and above by default (a failed TLS handshake writes a line
# per connection attempt) in its own plain-text format, which breaks JSON-lines logs.
# Set before the core starts (the server's first channel or port), as it reads them then.
GRPC_CORE_ENV = {"GRPC_VERBOSITY": "ERROR", "GRPC_TRACE": ""}


def quiet_grpc_core() -> None:
    """Keep gRPC's C core to errors, unless the operator set its variables."""
    for name, value in GRPC_CORE_ENV.items():
        os.environ.setdefault(name, value)


def grpc_core_loaded_loud() -> bool:
    """Whether gRPC's C core was loaded before ``quiet_grpc_core`` could set its variables."""
    return "grpc" in sys.modules and any(name not in os.environ for name in GRPC_CORE_ENV)


def configure(level: str = "info", *, json: bool | None = None) -> None:
    if json is None:
        json = not sys.stderr.isatty()
    renderer: structlog.typing.Processor = (
        structlog.processors.JSONRenderer() if json else structlog.dev.ConsoleRenderer(colors=True)
    )
    shared: list[structlog.typing.Processor] = [
        structlog.contextvars.merge_contextvars,
        structlog.processors.add_log_level,
        structlog.processors.TimeStamper(fmt="iso", utc=True),
    ]
    structlog.configure(
        processors=[*shared, structlog.processors.format_exc_info, renderer],
        wrapper_class=structlog.make_filtering_bound_logger(logging.getLevelNamesMapping()[level.upper()]),
        logger_factory=structlog.PrintLoggerFactory(file=sys.stderr),
        cache_logger_on_first_use=True,
    )
    handler = logging.StreamHandler(sys.stderr)
    handler.setFormatter(
        structlog.stdlib.ProcessorFormatter(
            foreign_pre_chain=[*shared, structlog.stdlib.add_logger_name],
            processors=[
                structlog.stdlib.ProcessorFormatter.remove_processors_meta,
                structlog.processors.format_exc_info,
                renderer,
            ],
        )
    )
    root = logging.getLogger()
    root.handlers[:] = [handler]
    root.setLevel(logging.getLevelNamesMapping()[level.upper()])
    logging.captureWarnings(True)
