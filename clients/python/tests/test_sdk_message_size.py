"""A message over a size limit is MessageTooLarge, never Overloaded: retrying the same
call cannot help, while Overloaded tells the caller to back off and retry."""

from __future__ import annotations

import pytest

import querator
from querator.embedded import EmbeddedServer

from sdk_helpers import client, queue, run, srv  # noqa: F401 (fixtures)


def test_a_request_over_the_servers_limit_is_message_too_large(client: querator.Client, queue: str) -> None:
    # 5.5 MB: under the SDK's send limit, over the server's 5,000,000 bytes.
    with pytest.raises(querator.MessageTooLarge) as err:
        client.produce(queue, [b"x" * 5_500_000])
    assert not isinstance(err.value, querator.Overloaded)
    assert err.value.status == "RESOURCE_EXHAUSTED"
    assert "5000000 bytes" in err.value.message
    assert client.queue_stats(queue).partitions[0].total == 0


def test_a_request_over_the_channels_send_limit_is_message_too_large(client: querator.Client, queue: str) -> None:
    with pytest.raises(querator.MessageTooLarge) as err:
        client.produce(queue, [b"x" * 7_000_000])
    assert "larger than max" in err.value.message


def test_a_reply_over_the_channels_receive_limit_is_message_too_large(srv: EmbeddedServer, queue: str) -> None:
    srv_client = srv.client()
    small = srv.client(channel_options=(("grpc.max_receive_message_length", 1 << 20),))
    try:
        srv_client.produce(queue, [b"y" * 2_000_000])
        with pytest.raises(querator.MessageTooLarge) as err:
            small.lease(queue, batch_size=1, wait=0)
        assert "Received message larger than max" in err.value.message
    finally:
        small.close()
        srv_client.close()


def test_the_async_client_maps_it_the_same_way(srv: EmbeddedServer, queue: str) -> None:
    async def main() -> None:
        async with srv.async_client() as client:
            with pytest.raises(querator.MessageTooLarge):
                await client.produce(queue, [b"x" * 5_500_000])

    run(main())


def test_a_busy_queue_is_still_overloaded() -> None:
    import grpc

    from querator.errors import from_status

    busy = from_status(grpc.StatusCode.RESOURCE_EXHAUSTED, "queue 'q' is overloaded: 10000 requests waiting")
    assert type(busy) is querator.Overloaded
