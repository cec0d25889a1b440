"""Server logs: structured events through the standard library's ``logging``.

Every module logs through :func:`get_logger`: a structlog logger with the server's own
processors (not structlog's global configuration, which belongs to the application
when the server runs inside one), writing to the stdlib logger ``querator.server`` or
a child of it. A record's message is ``event key=value ...`` (readable under any
handler) and the event itself rides along as ``record.querator_event``.

So the host's logging configuration decides what happens to the server's logs: an
embedded server writes nothing of its own, to stdout or anywhere else.
``querator serve`` owns its process (:func:`configure` with ``process=True``): one
handler on the root logger renders every record, the server's events, the standard
library's (asyncio's "Task exception was never retrieved", grpc's Python side) and
warnings, as a JSON line (coloured text on a terminal) on stderr; and gRPC's C core,
which writes plain text to the stderr file descriptor, is kept to errors and fatal
errors (:func:`quiet_grpc_core`).
"""

from __future__ import annotations

import logging
import os
import sys
import time
from collections.abc import Callable, MutableMapping
from datetime import UTC, datetime
from typing import Any

import structlog

ROOT = "querator.server"
EVENT_ATTR = "querator_event"

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


def _to_stdlib(_logger: Any, _method: str, event_dict: MutableMapping[str, Any]) -> tuple[tuple[Any, ...], dict[str, Any]]:
    """The last processor: the stdlib call's arguments (message, ``extra``, ``exc_info``)."""
    exc_info = event_dict.pop("exc_info", None)
    fields = " ".join(f"{key}={value}" for key, value in event_dict.items() if key not in ("event", "level"))
    message = f"{event_dict.get('event', '')} {fields}".rstrip()
    return (message,), {"extra": {EVENT_ATTR: dict(event_dict)}, "exc_info": exc_info}


_PROCESSORS: list[Any] = [
    structlog.stdlib.filter_by_level,
    structlog.contextvars.merge_contextvars,
    structlog.processors.add_log_level,
    _to_stdlib,
]


def get_logger(name: str = "") -> Any:
    """The logger of a server module: ``querator.server`` or ``querator.server.<name>``."""
    target = logging.getLogger(f"{ROOT}.{name}" if name else ROOT)
    return structlog.wrap_logger(target, processors=_PROCESSORS, wrapper_class=structlog.stdlib.BoundLogger)


class EventFormatter(logging.Formatter):
    """Renders a record as one line: a server event as it was logged, any other record
    as its message with the logger's name; plus level, timestamp and exception."""

    def __init__(self, *, json: bool) -> None:
        super().__init__()
        self._render: Any = structlog.processors.JSONRenderer() if json else structlog.dev.ConsoleRenderer(colors=True)

    def format(self, record: logging.LogRecord) -> str:
        event = getattr(record, EVENT_ATTR, None)
        if event is None:
            event = {"event": record.getMessage(), "logger": record.name}
        event = dict(event)
        event.setdefault("level", record.levelname.lower())
        event["timestamp"] = datetime.fromtimestamp(record.created, UTC).isoformat()
        if record.exc_info:
            event["exception"] = self.formatException(record.exc_info)
        return str(self._render(None, record.levelname.lower(), event))


def configure(level: str = "info", *, json: bool | None = None, process: bool = False) -> None:
    """Write the server's events at ``level`` and above to stderr: JSON lines, or
    coloured text on a terminal (``json`` decides when given).

    ``process``: the server owns the process (``querator serve``): every stdlib record
    and warning goes the same way (the handler is the root logger's). Otherwise only
    ``querator.server`` gets the handler (an embedded server with a ``log_level``).
    Replaces an earlier call's handler.
    """
    if json is None:
        json = not sys.stderr.isatty()
    handler = logging.StreamHandler(sys.stderr)
    handler.setFormatter(EventFormatter(json=json))
    handler.querator_handler = True  # type: ignore[attr-defined]
    server = logging.getLogger(ROOT)
    for old in [h for h in server.handlers if getattr(h, "querator_handler", False)]:
        server.removeHandler(old)
    server.setLevel(logging.getLevelNamesMapping()[level.upper()])
    if process:
        root = logging.getLogger()
        root.handlers[:] = [handler]
        root.setLevel(server.level)
        server.propagate = True
        logging.captureWarnings(True)
    else:
        server.addHandler(handler)
        server.propagate = False


class RepeatedFailure:
    """How often to log a failure that is retried on a cadence: the first time, then at
    most once per ``every_s`` with how many failures there were since the last line.

    A step retried every second that stays broken for an hour would otherwise write
    3,600 identical lines, which drown the rest of the log and tell nothing more than
    one line a minute with a count.
    """

    def __init__(self, every_s: float = 60.0, clock: Callable[[], float] = time.monotonic) -> None:
        self.every_s = every_s
        self._clock = clock
        self._logged_at: float | None = None
        self._unlogged = 0
        self.failures = 0  # since the first failure of this run

    def failed(self) -> int:
        """Count one failure; how many to report now (0: no line is due)."""
        self.failures += 1
        self._unlogged += 1
        now = self._clock()
        if self._logged_at is not None and now - self._logged_at < self.every_s:
            return 0
        self._logged_at = now
        reported, self._unlogged = self._unlogged, 0
        return reported
