"""TLS, mutual TLS and API keys end to end: clients, embedded server helpers and the CLI."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

import querator
from querator.cli import main
from querator.embedded import EmbeddedServer, TLSFiles
from querator.testing import make_certificates, server

from sdk_helpers import run, unique

ADMIN = "bootstrap-admin-token-for-sdk-tests"


@pytest.fixture(scope="module")
def certs(tmp_path_factory: pytest.TempPathFactory) -> TLSFiles:
    return make_certificates(tmp_path_factory.mktemp("pki"))


@pytest.fixture
def tls_srv(certs: TLSFiles) -> Iterator[EmbeddedServer]:
    with server(tls=certs, admin_token=ADMIN) as srv:
        yield srv


def test_client_over_tls_with_bearer_tokens(tls_srv: EmbeddedServer, certs: TLSFiles) -> None:
    with tls_srv.client() as admin:  # the CA and the admin token filled in
        admin.create_queue("orders-eu")
        admin.create_queue("billing")
        producer = admin.create_key("producer", ["orders*"], description="checkout")
        consumer = admin.create_key("consumer", "orders*")
        assert producer.token.startswith("qk_") and producer.key.role == "producer"
        assert producer.token not in repr(producer)
        listed = {k.key_id: k for k in admin.list_keys()}
        assert listed[producer.key_id].queues == ["orders*"] and listed[producer.key_id].description == "checkout"
        assert listed[consumer.key_id].role == "consumer"

    ca = certs.ca.read_bytes()
    with querator.Client(tls_srv.address, root_certificates=ca, bearer_token=producer.token) as client:
        assert client.produce("orders-eu", ["a"]).ids
        with pytest.raises(querator.PermissionDenied) as denied:
            client.lease("orders-eu", wait=0)
        assert denied.value.status == "PERMISSION_DENIED"
        with pytest.raises(querator.PermissionDenied):
            client.produce("billing", ["x"])
        with pytest.raises(querator.PermissionDenied):
            client.list_keys()
    with querator.Client(tls_srv.address, root_certificates=ca) as anonymous:
        with pytest.raises(querator.Unauthenticated):
            anonymous.queue_stats("orders-eu")
    with querator.Client(tls_srv.address, retries=0, timeout=5) as plaintext:
        with pytest.raises(querator.Unavailable):
            plaintext.queue_stats("orders-eu")

    async def consume() -> None:
        async with tls_srv.async_client(bearer_token=consumer.token) as client:
            [item] = await client.lease("orders-eu", wait=0)
            await item.complete()
            with tls_srv.client() as admin:
                admin.revoke_key(consumer.key_id)
                with pytest.raises(querator.NotFound) as missing:
                    admin.revoke_key(consumer.key_id)
                assert not isinstance(missing.value, querator.QueueNotFound)
            with pytest.raises(querator.Unauthenticated):
                await client.queue_stats("orders-eu")

    run(consume())


def test_mutual_tls_client_certificates(certs: TLSFiles) -> None:
    with server(tls=certs, mutual_tls=True, admin_token=ADMIN) as srv:
        with srv.client() as client:  # CA, client certificate and key, admin token
            client.create_queue("mtls")
            assert client.queue_stats("mtls").total == 0
        without_cert = querator.Client(
            srv.address, root_certificates=certs.ca.read_bytes(), bearer_token=ADMIN, retries=0, timeout=5
        )
        with without_cert, pytest.raises(querator.Unavailable):
            without_cert.queue_stats("mtls")
    with pytest.raises(ValueError, match="client_cert"):
        EmbeddedServer(tls=TLSFiles(certs.ca, certs.server_cert, certs.server_key), mutual_tls=True)


def cli(capsys: pytest.CaptureFixture[str], *args: str) -> tuple[int, str, str]:
    code = main(list(args))
    out, err = capsys.readouterr()
    return code, out, err


def test_keys_cli_end_to_end(tls_srv: EmbeddedServer, certs: TLSFiles, capsys: pytest.CaptureFixture[str]) -> None:
    conn = ["--address", tls_srv.address, "--tls-ca", str(certs.ca)]
    queue = unique("orders")
    assert cli(capsys, "queues", "create", queue, *conn, "--token", ADMIN)[0] == 0

    code, out, err = cli(capsys, "keys", "create", "--queues", "orders*", "--role", "producer", *conn, "--token", ADMIN)
    assert code == 0, err
    token = out.strip()
    assert token.startswith("qk_") and "shown only once" in err
    key_id = token.split("_")[1]

    # Connection options also go before the command.
    code, out, err = cli(capsys, *conn, "--token", ADMIN, "keys", "list", "--json")
    assert code == 0, err
    keys = {k["key_id"]: k for k in json.loads(out)}
    assert keys[key_id]["role"] == "producer" and keys[key_id]["queues"] == ["orders*"]
    code, out, _ = cli(capsys, "keys", "list", *conn, "--token", ADMIN)
    assert out.startswith("KEY_ID") and key_id in out

    code, out, err = cli(capsys, "produce", queue, "hello", *conn, "--token", token, "--json")
    assert code == 0 and json.loads(out)["count"] == 1, err
    code, out, err = cli(capsys, "lease", queue, *conn, "--token", token)
    assert code == 1 and "PERMISSION_DENIED" in err
    code, _, err = cli(capsys, "queues", "stats", queue, *conn)
    assert code == 1 and "UNAUTHENTICATED" in err

    code, out, _ = cli(capsys, "keys", "create", "--queues", "a*", "b", "--role", "admin", "--json", *conn, "--token", ADMIN)
    created = json.loads(out)
    assert code == 0 and created["key"]["queues"] == ["a*", "b"] and created["token"].startswith("qk_")
    with pytest.raises(SystemExit) as usage:
        main(["keys", "create", "--queues", "*", "--role", "boss", *conn])
    assert usage.value.code == 2 and "invalid choice: 'boss'" in capsys.readouterr().err

    # The environment carries the token and the CA; a revoked key stops working.
    env = dict(os.environ, QUERATOR_ADDRESS=tls_srv.address, QUERATOR_TLS_CA=str(certs.ca), QUERATOR_TOKEN=ADMIN)
    revoked = subprocess.run(
        [sys.executable, "-m", "querator.cli", "keys", "revoke", key_id], env=env, capture_output=True, text=True, timeout=60
    )
    assert revoked.returncode == 0 and f"revoked key {key_id}" in revoked.stdout, revoked.stderr
    code, _, err = cli(capsys, "produce", queue, "again", *conn, "--token", token)
    assert code == 1 and "UNAUTHENTICATED" in err


def test_cli_mutual_tls_options(certs: TLSFiles, capsys: pytest.CaptureFixture[str], tmp_path: Path) -> None:
    with server(tls=certs, mutual_tls=True) as srv:
        conn = ["--address", srv.address, "--tls-ca", str(certs.ca)]
        client_cert = ["--tls-cert", str(certs.client_cert), "--tls-key", str(certs.client_key)]
        code, out, err = cli(capsys, "queues", "create", "m", *conn, *client_cert, "--json")
        assert code == 0 and json.loads(out)["name"] == "m", err
        code, _, err = cli(capsys, "queues", "get", "m", *conn, "--tls-cert", str(certs.client_cert))
        assert code == 2 and "--tls-key" in err
        code, _, err = cli(capsys, "queues", "get", "m", *conn, "--tls-ca", str(tmp_path / "missing.pem"))
        assert code == 2 and "cannot read" in err
