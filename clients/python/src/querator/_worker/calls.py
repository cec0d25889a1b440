"""Every call a worker makes on its client, in one place."""

from __future__ import annotations

from collections.abc import Awaitable, Callable, Coroutine, Sequence
from datetime import datetime
from typing import TYPE_CHECKING, Any

from .. import _operations as ops
from .._convert import Seconds
from .._items import AsyncLeasedItem, LeasedItem, _LeasedBase
from .._models import CompleteResult, QueueInfo, QueueStats

if TYPE_CHECKING:
    from .._async_client import AsyncClient
    from .._client import Client
    from .._config import ClientConfig


class WorkerCalls:
    """The worker's view of an :class:`~querator.AsyncClient`: the engine, the settler
    and keep-alive reach the client only through here."""

    def __init__(self, aclient: AsyncClient) -> None:
        self.aclient = aclient
        self.config: ClientConfig = aclient.config
        # The client's internal interface, as the Producers use it: sans-IO operations
        # run by its transport.
        self._transport = aclient._transport
        #: Tries of a settle call on UNAVAILABLE (the client's own policy).
        self.retries: int = self.config.retries

    def backoff(self, attempt: int) -> float:
        """Seconds to wait before try ``attempt + 1`` (the client's backoff)."""
        return self._transport.retry_policy.backoff(attempt).total_seconds()

    def async_item(self, fields: dict[str, Any]) -> _LeasedBase:
        """A leased item for an async handler, bound to this client."""
        return AsyncLeasedItem(self.aclient, **fields)

    @staticmethod
    def sync_item(client: Client, fields: dict[str, Any]) -> _LeasedBase:
        """A leased item for a sync handler, bound to the blocking ``client``."""
        return LeasedItem(client, **fields)

    def sync_client(self) -> Client:
        """A blocking client of the same settings, for sync handlers' items (an
        AsyncWorker with a sync handler; the Worker hands its own)."""
        from .._client import Client

        return Client(config=self.config)

    def queue_info(self, queue_name: str) -> Awaitable[QueueInfo]:
        return self.aclient.get_queue(queue_name)

    def queue_stats(self, queue_name: str) -> Awaitable[QueueStats]:
        return self.aclient.queue_stats(queue_name)

    def lease(
        self,
        make: Callable[..., _LeasedBase],
        queue_name: str,
        batch_size: int,
        wait: Seconds,
        client_id: str,
        complete: Sequence[_LeasedBase] | None,
    ) -> Coroutine[Any, Any, list[_LeasedBase]]:
        return self._transport.run(ops.lease(self.config, make, queue_name, batch_size, wait, client_id, complete, ""))

    def complete(self, items: Sequence[_LeasedBase]) -> Awaitable[CompleteResult]:
        return self.aclient.complete(items)

    def retry(self, orders: list[tuple[_LeasedBase, datetime | None, bool, str]]) -> Awaitable[object]:
        """Retry (at a time, or now with None) or dead-letter (True) each item, with
        its error text ("" for none)."""
        return self._transport.run(ops.retry(self.config, orders, None))  # type: ignore[arg-type]

    def extend(self, items: Sequence[_LeasedBase] | _LeasedBase, lease_timeout: Seconds | None) -> Awaitable[Any]:
        return self.aclient.extend(items, lease_timeout=lease_timeout)
