"""Run a Querator server inside this process (embedded mode, and tests).

``EmbeddedServer`` starts the real server (the ``querator-server`` package, imported
only here) on its own event loop in a background thread, listening on a free
127.0.0.1 port, storing in ``data_dir`` (a temporary directory when not given, removed
on stop). Clients talk to it over real gRPC, exactly as they would to a remote one::

    from querator.embedded import EmbeddedServer

    with EmbeddedServer() as server, server.client() as client:
        client.create_queue("jobs")

With ``tls=TLSFiles(...)`` it serves TLS (``mutual_tls=True``: clients must show a
certificate signed by ``tls.ca``), and with ``admin_token=`` it requires API keys, the
token acting as the bootstrap admin key. ``server.client()`` then connects with the CA,
the client certificate and the admin token filled in (override any of them).
"""

from __future__ import annotations

import asyncio
import shutil
import tempfile
import threading
from dataclasses import dataclass
from pathlib import Path
from types import TracebackType
from typing import Any

from ._async_client import AsyncClient
from ._client import Client

_MISSING = "the embedded server needs the server package: pip install querator-server"


def _server_modules() -> tuple[Any, Any, Any]:
    try:
        from querator_server import logging as server_logging
        from querator_server.config import ServerConfig
        from querator_server.server import QueratorServer
    except ModuleNotFoundError as exc:
        # Only the missing package gets the install hint; an import error inside an
        # installed server propagates as it is.
        if exc.name == "querator_server":
            raise ImportError(_MISSING) from exc
        raise
    return ServerConfig, QueratorServer, server_logging


@dataclass(frozen=True, slots=True)
class TLSFiles:
    """PEM files for a TLS server and its clients (:func:`querator.testing.make_certificates`).

    ``ca`` signed the server's certificate (clients trust it) and, for mutual TLS, the
    client's; the server's certificate must name the host clients dial (127.0.0.1).
    """

    ca: Path
    server_cert: Path
    server_key: Path
    client_cert: Path | None = None
    client_key: Path | None = None


class EmbeddedServer:
    """A Querator server on a background thread of this process.

    ``address`` defaults to ``127.0.0.1:0`` (a free port; read :attr:`address` after
    start). ``sync=False`` skips fsync (faster; for throw-away data such as tests).
    ``log_level`` writes the server's structured logs to stderr at that level; None
    (the default) leaves them to the application's logging configuration: they go
    through stdlib ``logging`` to the logger ``querator.server``, never to stdout. ``tls`` serves TLS (``mutual_tls``: client
    certificates signed by ``tls.ca`` required); ``admin_token`` turns API keys on with
    that bootstrap admin token. Other ``settings`` go to ``ServerConfig``.
    """

    def __init__(
        self,
        data_dir: str | Path | None = None,
        *,
        address: str = "127.0.0.1:0",
        sync: bool = True,
        log_level: str | None = None,
        tls: TLSFiles | None = None,
        mutual_tls: bool = False,
        admin_token: str | None = None,
        **settings: Any,
    ) -> None:
        if mutual_tls and (tls is None or tls.client_cert is None or tls.client_key is None):
            raise ValueError("mutual_tls needs tls= with client_cert and client_key")
        self._given_dir = data_dir
        self._address = address
        self._sync = sync
        self._log_level = log_level
        self.tls = tls
        self.mutual_tls = mutual_tls
        self.admin_token = admin_token
        if tls is not None:
            settings.update(tls_cert=str(tls.server_cert), tls_key=str(tls.server_key))
            if mutual_tls:
                settings["tls_client_ca"] = str(tls.ca)
        if admin_token is not None:
            settings.update(auth=True, admin_token=admin_token)
        self._settings = settings
        self._loop: asyncio.AbstractEventLoop | None = None
        self._thread: threading.Thread | None = None
        self._server: Any = None
        self._temp_dir: str | None = None
        self.data_dir: str = str(data_dir) if data_dir is not None else ""
        self.address: str = ""

    @property
    def running(self) -> bool:
        return self._server is not None

    def start(self, timeout: float = 30) -> EmbeddedServer:
        """Start the server; returns once it accepts calls."""
        if self._server is not None:
            return self
        server_config, server_class, server_logging = _server_modules()
        if self._given_dir is None:
            self._temp_dir = tempfile.mkdtemp(prefix="querator-")
            self.data_dir = str(Path(self._temp_dir) / "data")
        if self._log_level is not None:
            server_logging.configure(self._log_level)
        config = server_config(address=self._address, data_dir=self.data_dir, sync=self._sync, **self._settings)
        loop = asyncio.new_event_loop()
        thread = threading.Thread(target=loop.run_forever, name="querator-embedded", daemon=True)
        thread.start()
        self._loop, self._thread = loop, thread
        server = server_class(config)
        try:
            asyncio.run_coroutine_threadsafe(server.start(), loop).result(timeout)
        except BaseException:
            self._shutdown_loop()
            raise
        self._server = server
        self.address = str(server.address)
        return self

    def stop(self, grace: float = 1.0, timeout: float = 30) -> None:
        """Stop the server (waiting leases are answered), close storage, end the thread."""
        server, self._server = self._server, None
        if server is not None and self._loop is not None:
            try:
                asyncio.run_coroutine_threadsafe(server.stop(grace), self._loop).result(timeout)
            finally:
                self._shutdown_loop()
        if self._temp_dir is not None:
            shutil.rmtree(self._temp_dir, ignore_errors=True)
            self._temp_dir = None

    def _shutdown_loop(self) -> None:
        loop, thread = self._loop, self._thread
        self._loop = self._thread = None
        if loop is not None:
            loop.call_soon_threadsafe(loop.stop)
            if thread is not None:
                thread.join(10)
            if not loop.is_running():
                loop.close()

    def client_options(self) -> dict[str, Any]:
        """The client settings this server needs: CA, client certificate, admin token."""
        out: dict[str, Any] = {}
        if self.tls is not None:
            out["root_certificates"] = self.tls.ca.read_bytes()
            if self.mutual_tls and self.tls.client_cert is not None and self.tls.client_key is not None:
                out["certificate_chain"] = self.tls.client_cert.read_bytes()
                out["private_key"] = self.tls.client_key.read_bytes()
        if self.admin_token is not None:
            out["bearer_token"] = self.admin_token
        return out

    def client(self, **options: Any) -> Client:
        """A :class:`~querator.Client` connected to this server (``options`` override
        :meth:`client_options`, e.g. ``bearer_token=`` another key)."""
        self._require_running()
        return Client(self.address, **{**self.client_options(), **options})

    def async_client(self, **options: Any) -> AsyncClient:
        """An :class:`~querator.AsyncClient` connected to this server (use it in one loop)."""
        self._require_running()
        return AsyncClient(self.address, **{**self.client_options(), **options})

    def _require_running(self) -> None:
        if self._server is None:
            raise RuntimeError("the embedded server is not running; call start() first")

    def __enter__(self) -> EmbeddedServer:
        return self.start()

    def __exit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        self.stop()

    def __repr__(self) -> str:
        state = f"address={self.address!r}" if self.running else "stopped"
        return f"EmbeddedServer({state}, data_dir={self.data_dir!r})"


__all__ = ["EmbeddedServer", "TLSFiles"]
