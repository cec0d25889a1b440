"""The cluster benchmark's clients through the Python SDK (``run.py --nodes N --sdk``).

The same interface as querator_target's raw client (workloads.py: open, close,
create_queue, drop_queue, count, produce, lease, complete, finish), carried out with
``querator.AsyncClient(addresses=[...])``: the SDK reads ClusterInfo and routes each call
itself (docs/sdk.md, "Clusters"), so the figures say what a user of the SDK gets from a
cluster, client CPU included. On a cluster every process is given every node's address,
the node it is bound to first, so the processes' default channels (where the SDK asks
ClusterInfo and the queue's counts) are spread over the nodes too; on a plain server, its
one address.

- Produce: one ``produce()`` of the loop's batch of bare payloads (the SDK sends them in
  the compact form ``ProduceRequest.payloads``); the SDK picks the node.
- Lease: ``lease(batch_size, wait, client_id)``; the SDK picks the node.
- Complete: ``complete(items)``, to the partition's home; with ``complete_in_lease``
  the items ride on the loop's next ``lease(complete=items)`` (the SDK sends that Lease
  to the items' home), and ``finish()`` completes what a loop still holds.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from querator_target import LEASE_TIMEOUT_S

_MAX_MESSAGE = 64 << 20


@dataclass
class SdkClusterClient:
    """Picklable: ``open()`` builds the AsyncClient inside the client process."""

    addresses: list[str]
    complete_in_lease: bool = False
    streams: bool = False  # AsyncClient(streams=...): a stream per queue (in a cluster, per node and queue)
    lease_timeout_s: int = LEASE_TIMEOUT_S
    _state: dict[str, Any] = field(default_factory=dict, repr=False)

    @property
    def address(self) -> str:
        return self.addresses[0]

    async def open(self) -> None:
        import querator

        options = (("grpc.max_receive_message_length", _MAX_MESSAGE), ("grpc.max_send_message_length", _MAX_MESSAGE))
        client = querator.AsyncClient(addresses=self.addresses, streams=self.streams, channel_options=options)
        await client.wait_ready(30)
        async for _ in client.list_queues(page_size=1):  # the first call reads the cluster map: before the clock starts
            break
        self._state.update(client=client, pending={})

    async def close(self) -> None:
        client = self._state.pop("client", None)
        if client is not None:
            await client.close()

    async def create_queue(self, name: str, partitions: int) -> None:
        await self._state["client"].create_queue(
            name, partitions=partitions, lease_timeout=self.lease_timeout_s, expire_timeout=24 * 3600, timeout=30
        )

    async def drop_queue(self, name: str) -> None:
        await self._state["client"].delete_queue(name, force=True, timeout=120)

    async def count(self, name: str) -> int:
        """Ready, leased and scheduled items."""
        stats = await self._state["client"].queue_stats(name, timeout=30)
        return sum(p.total + p.scheduled for p in stats.partitions)

    async def produce(self, queue: str, payloads: list[bytes]) -> None:
        # One request: the workload keeps its own calls in flight (--produce-inflight).
        await self._state["client"].produce(queue, payloads, batch_size=len(payloads), max_in_flight=1, timeout=60)

    async def lease(self, queue: str, client_id: str, batch: int, wait_s: float) -> tuple[object, list[bytes]]:
        client = self._state["client"]
        previous = self._state["pending"].pop(client_id, None) if self.complete_in_lease else None
        items = await client.lease(queue, batch_size=batch, wait=wait_s, client_id=client_id, complete=previous)
        return (items, client_id), [item.payload for item in items]

    async def complete(self, queue: str, token: object) -> None:
        items, client_id = token  # type: ignore[misc]
        if not items:
            return
        if self.complete_in_lease:  # completed by this loop's next Lease (or by finish())
            self._state["pending"][client_id] = items
            return
        await self._state["client"].complete(items)

    async def finish(self, queue: str, client_id: str) -> None:
        previous = self._state["pending"].pop(client_id, None)
        if previous:
            await self._state["client"].complete(previous)
