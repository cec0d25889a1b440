"""A node's connection to etcd beyond plaintext, against real etcd processes: TLS with
client certificates (a CA made here with openssl), and etcd's user/password
authentication (a user and a role made through etcd's own auth API, then auth on).
Wrong settings stop the node at start with a message that says what to check."""

from __future__ import annotations

import os
import subprocess
from collections.abc import Iterator
from pathlib import Path

import grpc
import pytest
from cluster_helpers import Etcd, Node

from conftest import wait_until

PREFIX = "secure"


def _openssl(pki: Path, *args: str) -> None:
    subprocess.run(["openssl", *args], cwd=pki, check=True, capture_output=True, timeout=60)


def _ca(pki: Path, name: str) -> None:
    _openssl(pki, "req", "-x509", "-newkey", "rsa:2048", "-nodes", "-keyout", f"{name}.key", "-out", f"{name}.pem",
             "-days", "2", "-subj", f"/CN={name}")  # fmt: skip


def _signed(pki: Path, ca: str, name: str) -> None:
    _openssl(pki, "req", "-newkey", "rsa:2048", "-nodes", "-keyout", f"{name}.key", "-out", f"{name}.csr",
             "-subj", f"/CN={name}")  # fmt: skip
    (pki / f"{name}.ext").write_text("subjectAltName=DNS:localhost,IP:127.0.0.1\n")
    _openssl(pki, "x509", "-req", "-in", f"{name}.csr", "-CA", f"{ca}.pem", "-CAkey", f"{ca}.key", "-CAcreateserial",
             "-out", f"{name}.pem", "-days", "2", "-extfile", f"{name}.ext")  # fmt: skip


@pytest.fixture(scope="module")
def pki(tmp_path_factory: pytest.TempPathFactory) -> Path:
    pki = tmp_path_factory.mktemp("pki")
    _ca(pki, "ca")
    _ca(pki, "other-ca")  # signed nothing etcd uses
    for name in ("etcd", "querator"):
        _signed(pki, "ca", name)
    return pki


@pytest.fixture(scope="module")
def tls_etcd(pki: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Etcd]:
    credentials = grpc.ssl_channel_credentials(
        root_certificates=(pki / "ca.pem").read_bytes(),
        private_key=(pki / "querator.key").read_bytes(),
        certificate_chain=(pki / "querator.pem").read_bytes(),
    )
    args = [
        "--cert-file", str(pki / "etcd.pem"), "--key-file", str(pki / "etcd.key"),
        "--client-cert-auth", "--trusted-ca-file", str(pki / "ca.pem"),
    ]  # fmt: skip
    etcd = Etcd(str(tmp_path_factory.mktemp("etcd-tls")), args=args, credentials=credentials)
    try:
        etcd.start()
        yield etcd
    finally:
        etcd.stop()


def _url(etcd: Etcd) -> str:
    return f"etcd://{etcd.endpoint}/{PREFIX}"


def test_a_node_reaches_etcd_over_tls_with_a_client_certificate(tls_etcd: Etcd, pki: Path, tmp_path: Path) -> None:
    tls = ["--etcd-ca", str(pki / "ca.pem"), "--etcd-cert", str(pki / "querator.pem"), "--etcd-key", str(pki / "querator.key")]
    node = Node("n1", str(tmp_path / "n1"), _url(tls_etcd), args=tls)
    try:
        node.start()
        node.stubs.create("over-tls", requested_partitions=2)
        node.stubs.produce("over-tls", [b"sealed"])
        assert [q.queue_name for q in node.info().queues] == ["over-tls"]
        assert node.info().admin_writable
    finally:
        node.stop()


@pytest.mark.parametrize(
    ("flags", "message"),
    [
        # etcd's certificate is not signed by the CA the node was given.
        (["--etcd-ca", "other-ca.pem", "--etcd-cert", "querator.pem", "--etcd-key", "querator.key"], "TLS to etcd failed"),
        # etcd asks for a client certificate; the node has none.
        (["--etcd-ca", "ca.pem"], "TLS to etcd failed"),
        # Plaintext to a TLS etcd.
        ([], "does etcd expect TLS"),
    ],
    ids=["wrong-ca", "no-client-cert", "plaintext"],
)
def test_wrong_tls_settings_stop_the_node_at_start_saying_what_to_check(
    tls_etcd: Etcd, pki: Path, tmp_path: Path, flags: list[str], message: str
) -> None:
    args = [str(pki / f) if f.endswith((".pem", ".key")) else f for f in flags]
    node = Node("n2", str(tmp_path / "n2"), _url(tls_etcd), args=args)
    try:
        with pytest.raises(AssertionError) as failed:
            node.start(timeout=30)
        text = str(failed.value)
        assert "cannot reach the cluster catalog" in text and message in text, text
        assert node.proc is not None and node.proc.returncode == 1
    finally:
        node.stop()


# -- etcd's user/password authentication ---------------------------------------------------------------


def _enable_auth(etcd: Etcd, prefix: str, user: str, password: str) -> None:
    """A root user (etcd needs one to turn auth on) and ``user`` with read and write on
    ``prefix`` only, through etcd's auth API; then auth on."""
    from aetcd import rpc  # type: ignore[import-untyped]

    from querator_server.cluster.etcd import prefix_end

    channel = etcd.channel()
    try:
        auth = rpc.AuthStub(channel)
        auth.UserAdd(rpc.AuthUserAddRequest(name="root", password="root-secret"), timeout=10)
        auth.UserGrantRole(rpc.AuthUserGrantRoleRequest(user="root", role="root"), timeout=10)
        auth.UserAdd(rpc.AuthUserAddRequest(name=user, password=password), timeout=10)
        auth.RoleAdd(rpc.AuthRoleAddRequest(name="querator-nodes"), timeout=10)
        key = f"/{prefix}/".encode()
        permission = rpc.Permission(permType=rpc.Permission.READWRITE, key=key, range_end=prefix_end(key))
        auth.RoleGrantPermission(rpc.AuthRoleGrantPermissionRequest(name="querator-nodes", perm=permission), timeout=10)
        auth.UserGrantRole(rpc.AuthUserGrantRoleRequest(user=user, role="querator-nodes"), timeout=10)
        auth.AuthEnable(rpc.AuthEnableRequest(), timeout=10)
    finally:
        channel.close()


@pytest.fixture(scope="module")
def auth_etcd(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Etcd]:
    etcd = Etcd(str(tmp_path_factory.mktemp("etcd-auth")))
    try:
        etcd.start()
        _enable_auth(etcd, PREFIX, "querator", "node-secret")
        yield etcd
    finally:
        etcd.stop()


def test_a_node_authenticates_to_etcd_and_again_after_etcd_restarts(auth_etcd: Etcd, tmp_path: Path) -> None:
    password_file = tmp_path / "etcd-password"
    password_file.write_text("node-secret\n")
    password_file.chmod(0o600)
    n1 = Node("n1", str(tmp_path / "n1"), _url(auth_etcd),
              args=["--etcd-user", "querator", "--etcd-password-file", str(password_file)])  # fmt: skip
    # The password from the environment, for the other node.
    n2 = Node("n2", str(tmp_path / "n2"), _url(auth_etcd), env={"QUERATOR_ETCD_USER": "querator",
              "QUERATOR_ETCD_PASSWORD": "node-secret"})  # fmt: skip
    try:
        n1.start()
        n2.start()
        n1.stubs.create("with-auth", requested_partitions=2)
        wait_until(lambda: "with-auth" in [q.queue_name for q in n2.info().queues], timeout=10)
        assert {m.node_id for m in n1.info().members if m.live} == {"n1", "n2"}
        # etcd forgets its tokens when it restarts: the nodes authenticate again, and
        # take admin calls once more.
        auth_etcd.kill9()
        auth_etcd.start()
        wait_until(lambda: n1.info().admin_writable and n2.info().admin_writable, timeout=30, interval=0.2)

        def created() -> bool:
            try:
                n2.stubs.create("after-restart")
            except grpc.RpcError as exc:
                if exc.code() == grpc.StatusCode.ALREADY_EXISTS:
                    return True
                return False
            return True

        wait_until(created, timeout=30, interval=0.5)
        wait_until(lambda: "after-restart" in [q.queue_name for q in n1.info().queues], timeout=10)
    finally:
        n1.stop()
        n2.stop()


@pytest.mark.parametrize(
    ("env", "message"),
    [
        ({"QUERATOR_ETCD_USER": "querator", "QUERATOR_ETCD_PASSWORD": "pw-7f3a"}, "check the user and its password"),
        ({}, "etcd has authentication on"),
    ],
    ids=["wrong-password", "no-user"],
)
def test_wrong_etcd_credentials_stop_the_node_at_start_saying_what_to_check(
    auth_etcd: Etcd, tmp_path: Path, env: dict[str, str], message: str
) -> None:
    node = Node("n3", str(tmp_path / "n3"), _url(auth_etcd), env=env)
    try:
        with pytest.raises(AssertionError) as failed:
            node.start(timeout=30)
        text = str(failed.value)
        assert "cannot reach the cluster catalog" in text and message in text, text
        assert "pw-7f3a" not in text  # the password is never echoed
    finally:
        node.stop()


def test_a_user_without_permission_on_the_prefix_is_told_so(auth_etcd: Etcd, tmp_path: Path) -> None:
    node = Node("n4", str(tmp_path / "n4"), f"etcd://{auth_etcd.endpoint}/elsewhere",
                env={"QUERATOR_ETCD_USER": "querator", "QUERATOR_ETCD_PASSWORD": "node-secret"})  # fmt: skip
    try:
        with pytest.raises(AssertionError) as failed:
            node.start(timeout=30)
        assert "needs read and write permission on the cluster's prefix" in str(failed.value), str(failed.value)
    finally:
        node.stop()


def test_etcd_settings_that_cannot_work_are_refused_before_start(tmp_path: Path) -> None:
    import sys

    base = [sys.executable, "-m", "querator_server.cli", "--data-dir", str(tmp_path / "d"), "--address", "127.0.0.1:0"]
    cluster = ["--cluster", "etcd://127.0.0.1:1/x", "--node-id", "n1"]
    env = {k: v for k, v in os.environ.items() if not k.startswith("QUERATOR_")}
    for args, extra_env, message in (
        ([*cluster, "--etcd-user", "u"], {}, "--etcd-user needs its password"),
        ([*cluster, "--etcd-cert", "c.pem"], {}, "needs both --etcd-cert and --etcd-key"),
        (cluster, {"QUERATOR_ETCD_PASSWORD": "p"}, "an etcd password needs --etcd-user"),
        (["--etcd-ca", "ca.pem"], {}, "give --cluster too"),
    ):
        run = subprocess.run([*base, *args], env={**env, **extra_env}, capture_output=True, text=True, timeout=60)
        assert run.returncode == 2 and message in run.stderr, (args, run.stderr)
