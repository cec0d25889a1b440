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

TLS and API keys, as in production::

    certs = make_certificates(tmp_path)            # a CA, server and client files (openssl)
    with server(tls=certs, mutual_tls=True, admin_token="secret") as srv:
        with srv.client() as admin:                # CA, client certificate and token set
            key = admin.create_key("producer", ["orders*"])

Both need the server package (``pip install querator-server``).
"""

from __future__ import annotations

import shutil
import subprocess
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

from .embedded import EmbeddedServer, TLSFiles


@contextmanager
def server(data_dir: str | Path | None = None, **options: Any) -> Iterator[EmbeddedServer]:
    """A started :class:`EmbeddedServer`, stopped (and its temp dir removed) on exit.

    fsync is off unless ``sync=True`` is given: test data is thrown away. ``options``
    are :class:`EmbeddedServer`'s (``tls=``, ``mutual_tls=``, ``admin_token=``, ...).
    """
    options.setdefault("sync", False)
    options.setdefault("log_level", "warning")
    srv = EmbeddedServer(data_dir, **options)
    srv.start()
    try:
        yield srv
    finally:
        srv.stop()


def make_certificates(directory: str | Path, *, hosts: tuple[str, ...] = ("localhost", "127.0.0.1")) -> TLSFiles:
    """A throw-away CA and the server and client certificates it signs, in ``directory``.

    The server certificate names ``hosts`` (DNS names and IP addresses). Made with the
    ``openssl`` command (P-256 keys, valid two days); for tests only.
    """
    openssl = shutil.which("openssl")
    if openssl is None:
        raise RuntimeError("make_certificates needs the openssl command")
    d = Path(directory)
    d.mkdir(parents=True, exist_ok=True)

    def run(*args: str) -> None:
        subprocess.run([openssl, *args], cwd=d, check=True, capture_output=True)

    key = ("-newkey", "ec", "-pkeyopt", "ec_paramgen_curve:prime256v1", "-nodes")
    run("req", "-x509", *key, "-keyout", "ca.key", "-out", "ca.pem", "-days", "2", "-subj", "/CN=querator-test-ca")
    names = ",".join(f"IP:{h}" if h.replace(".", "").isdigit() or ":" in h else f"DNS:{h}" for h in hosts)
    for name in ("server", "client"):
        run("req", *key, "-keyout", f"{name}.key", "-out", f"{name}.csr", "-subj", f"/CN=querator-test-{name}")
        (d / f"{name}.ext").write_text(f"subjectAltName={names}\n")
        run("x509", "-req", "-in", f"{name}.csr", "-CA", "ca.pem", "-CAkey", "ca.key", "-CAcreateserial",
            "-out", f"{name}.pem", "-days", "2", "-extfile", f"{name}.ext")  # fmt: skip
    return TLSFiles(
        ca=d / "ca.pem",
        server_cert=d / "server.pem",
        server_key=d / "server.key",
        client_cert=d / "client.pem",
        client_key=d / "client.key",
    )


__all__ = ["EmbeddedServer", "TLSFiles", "make_certificates", "server"]
