"""The ``querator`` command line.

``querator serve`` runs the server (needs the querator-server package). Every other
command is a client of a running server: ``--address`` (env QUERATOR_ADDRESS, default
127.0.0.1:2319), ``--token`` (env QUERATOR_TOKEN) for a server with API keys, and
``--tls-ca`` (env QUERATOR_TLS_CA), ``--tls-cert``/``--tls-key`` for TLS and mutual TLS;
these go before or after the command. Output is a table for people, or JSON with
``--json``. Exit codes: 0 ok, 1 the server answered an error (its status name is
printed), 2 bad usage.

One module per concern: :mod:`._common` (options, values, registration), :mod:`._input`
and :mod:`._output`, and the command modules listed in ``_app.COMMAND_MODULES``.
"""

from ._app import COMMAND_MODULES, build_parser, main, parse
from ._common import UsageError, parse_duration, parse_time

__all__ = ["COMMAND_MODULES", "UsageError", "build_parser", "main", "parse", "parse_duration", "parse_time"]
