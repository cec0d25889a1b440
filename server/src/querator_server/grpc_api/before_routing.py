"""What a call is refused for before a cluster routes it.

A node in cluster mode looks a call's queue up in the catalog, and may forward the call,
before the handler that checks the request runs (cluster/router.py). Without these
checks first, a queue name no queue can have answered NOT_FOUND ("queue 'a b' does not
exist") where a single node answers INVALID_ARGUMENT naming ``queue_name``, and a
Lease's ``request_timeout`` out of range was never refused: the router rewrites it into
its slices of waiting; a Lease with ``batch_size`` 0, or a Produce with no items, for a
queue that does not exist answered NOT_FOUND, not INVALID_ARGUMENT naming the field. The
checks are the handlers' own (convert.py, and the ``checks`` a service gives), run once
more here, and only those that need no queue: the rest stay where they are.
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable
from typing import Any

import grpc

from ..model import MAX_WAIT_US
from . import convert as c

Behavior = Callable[[Any, grpc.aio.ServicerContext[Any, Any]], Awaitable[Any]]


def checked_before_routing(
    methods: dict[str, Any], checks: dict[str, Callable[[Any], None]] | None = None
) -> dict[str, Any]:
    """``methods`` (name -> (behavior, request type, response type, action), as for
    handlers.generic_handler, routed by the cluster) with each behavior checking the
    request's ``queue_name`` and ``request_timeout`` (where its message has them) first,
    then the method's own check in ``checks`` (the one its handler runs)."""
    out = dict(methods)
    for name, (behavior, request_type, response_type, action) in methods.items():
        fields = request_type.DESCRIPTOR.fields_by_name
        named, timed = "queue_name" in fields, "request_timeout" in fields
        own = (checks or {}).get(name)
        if named or timed or own is not None:
            out[name] = (_checked(behavior, named, timed, own), request_type, response_type, action)
    return out


def _checked(behavior: Behavior, named: bool, timed: bool, own: Callable[[Any], None] | None) -> Behavior:
    async def checked(request: Any, context: grpc.aio.ServicerContext[Any, Any]) -> Any:
        if named:
            c.queue_name(request.queue_name)
        if timed:
            c.optional_duration_us(request, "request_timeout", "request_timeout", maximum_us=MAX_WAIT_US)
        if own is not None:
            own(request)
        return await behavior(request, context)

    return checked
