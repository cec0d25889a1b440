"""The bootstrap admin token of `querator serve --auth`: its strength, the warning while
it stays usable next to API keys, and its retirement (real server processes)."""

from __future__ import annotations

import os
import secrets
import subprocess
import sys
from collections.abc import Iterator

import grpc
import pytest
from security_helpers import Authed, new_key, status_of

from querator.v1 import keys_pb2

from conftest import ProcessServer, wait_until

STRONG = secrets.token_urlsafe(32)  # 43 characters, 256 bits


def _serve_refused(data_dir: str, token: str) -> tuple[int, str]:
    env = dict(os.environ, QUERATOR_AUTH="true", QUERATOR_ADMIN_TOKEN=token)
    done = subprocess.run(
        [sys.executable, "-m", "querator_server.cli", "--address", "127.0.0.1:0", "--data-dir", data_dir],
        env=env,
        stdin=subprocess.DEVNULL,
        capture_output=True,
        timeout=30,
        check=False,
    )
    return done.returncode, done.stderr.decode()


@pytest.mark.parametrize(
    ("token", "reason"),
    [
        ("change-me", "at least 43"),
        (STRONG[:42], "at least 43"),
        ("ab" * 30, "different characters"),
        (STRONG[:20] + " " + STRONG[20:], "whitespace"),
    ],
    # Fixed ids: STRONG is random, and parallel test workers must collect the same names.
    ids=["short", "short-random", "repeated", "whitespace"],
)
def test_a_weak_bootstrap_token_is_refused_at_start(data_dir: str, token: str, reason: str) -> None:
    code, stderr = _serve_refused(data_dir, token)
    assert code == 2
    assert reason in stderr and "QUERATOR_ADMIN_TOKEN" in stderr
    assert token not in stderr  # the token itself is never printed
    assert not os.path.exists(data_dir)  # refused before anything was created


@pytest.fixture
def channels() -> Iterator[list[grpc.Channel]]:
    opened: list[grpc.Channel] = []
    yield opened
    for channel in opened:
        channel.close()


def _start(data_dir: str, channels: list[grpc.Channel], **env: str) -> tuple[ProcessServer, grpc.Channel]:
    srv = ProcessServer(data_dir, env={"QUERATOR_AUTH": "true", "QUERATOR_ADMIN_TOKEN": STRONG, **env})
    srv.start()
    channel = grpc.insecure_channel(srv.address)
    channels.append(channel)
    return srv, channel


def test_the_token_warns_while_keys_exist(data_dir: str, channels: list[grpc.Channel]) -> None:
    srv, channel = _start(data_dir, channels)
    try:
        admin = Authed(channel, STRONG)
        admin.create("jobs")  # no key yet: no warning
        assert "bootstrap_token" not in srv.stderr_text()
        new_key(admin, keys_pb2.ROLE_PRODUCER, "jobs")  # the first key: warned at once
        wait_until(lambda: "bootstrap_token_active" in srv.stderr_text(), timeout=20)
        admin.create("more")  # the token used while a key exists
        wait_until(lambda: "bootstrap_token_used" in srv.stderr_text(), timeout=20)
        new_key(admin, keys_pb2.ROLE_CONSUMER, "jobs")
        admin.create("again")
        log = srv.stderr_text()
        assert log.count("bootstrap_token_used") == 1 and log.count("bootstrap_token_active") == 1  # once each
        assert srv.terminate() == 0
        srv.start()  # restarted with the token still set: warned at start
        wait_until(lambda: "bootstrap_token_active" in srv.stderr_text(), timeout=20)
    finally:
        srv.stop()


def test_the_token_retires_once_an_admin_key_for_every_queue_exists(
    data_dir: str, channels: list[grpc.Channel]
) -> None:
    srv, channel = _start(data_dir, channels, QUERATOR_ADMIN_TOKEN_UNTIL_KEY="true")
    try:
        bootstrap = Authed(channel, STRONG)
        narrow = new_key(bootstrap, keys_pb2.ROLE_ADMIN, "team-*")  # not for every queue: still usable
        bootstrap.create("jobs")
        root_token = new_key(bootstrap, keys_pb2.ROLE_ADMIN, "*")
        with pytest.raises(grpc.RpcError) as err:
            bootstrap.create("refused")
        assert err.value.code() == grpc.StatusCode.UNAUTHENTICATED
        assert "retired" in str(err.value.details())
        root = Authed(channel, root_token)
        root.create("by-key")
        Authed(channel, narrow).create("team-a")
        assert srv.terminate() == 0

        srv.start()  # retired across restarts: the key is stored, the rule is in the setting
        channel = grpc.insecure_channel(srv.address)
        channels.append(channel)
        bootstrap, root = Authed(channel, STRONG), Authed(channel, root_token)
        assert status_of(lambda: bootstrap.create("refused")) == grpc.StatusCode.UNAUTHENTICATED
        assert "bootstrap_token_active" not in srv.stderr_text()  # retired, so no warning at start
        # Revoking the last such key brings the token back: a way in is never lost.
        root.keys.RevokeKey(keys_pb2.RevokeKeyRequest(key_id=root_token.split("_")[1]), timeout=10)
        bootstrap.create("recovered")
    finally:
        srv.stop()
