"""What the tests of API keys share: the bootstrap admin token they start servers with,
stubs whose calls carry a bearer token, and small helpers for refused calls and new keys."""

from __future__ import annotations

import grpc
import pytest

from querator.v1 import keys_pb2, keys_pb2_grpc

from conftest import Stubs

BOOTSTRAP = "bootstrap-admin-token-for-tests"


class Authed(Stubs):
    """Stubs whose calls carry a bearer token."""

    def __init__(self, channel: grpc.Channel, token: str) -> None:
        self.token = token
        super().__init__(grpc.intercept_channel(channel, _Bearer(token)))
        self.keys = keys_pb2_grpc.KeysServiceStub(self.channel)


class _Bearer(grpc.UnaryUnaryClientInterceptor):  # type: ignore[misc]
    def __init__(self, token: str) -> None:
        self.token = token

    def intercept_unary_unary(self, continuation, details, request):  # type: ignore[no-untyped-def]
        metadata = list(details.metadata or []) + [("authorization", f"Bearer {self.token}")]
        details = details._replace(metadata=metadata)
        return continuation(details, request)


def status_of(call: object) -> grpc.StatusCode:
    """The status code ``call()`` fails with (the test fails if it succeeds)."""
    with pytest.raises(grpc.RpcError) as err:
        call()  # type: ignore[operator]
    return err.value.code()  # type: ignore[no-any-return]


def new_key(admin: Authed, role: int, *queues: str) -> str:
    """A new API key of ``role`` for the queue patterns ``queues``, made by ``admin``."""
    response = admin.keys.CreateKey(keys_pb2.CreateKeyRequest(role=role, queues=list(queues)), timeout=10)
    assert response.token.startswith("qk_")
    return str(response.token)
