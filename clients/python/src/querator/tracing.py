"""OpenTelemetry trace context from produce to lease, carried in item metadata.

Needs the ``otel`` extra (``pip install 'querator-client[otel]'``, which brings
``opentelemetry-api``). Nothing here imports OpenTelemetry until it is used, and the
rest of the SDK works without it. Turn it on per client::

    client = querator.Client(address, tracing=True)     # a ClientConfig field

With ``tracing=True``:

- every produce (``Client.produce``, ``AsyncClient.produce``, ``Producer``,
  ``AsyncProducer``) writes the current context into each item's metadata with the
  globally configured propagator (W3C ``traceparent`` / ``tracestate`` by default).
  Keys the item already has are kept; an item that carries its own ``traceparent`` or
  ``tracestate`` gets neither from the current context;
- ``Worker`` / ``AsyncWorker`` run each handler inside a CONSUMER span named
  ``"<queue> process"`` (:func:`process_span`): a child of the producer's context,
  linked to it, with the ``messaging.*`` attributes.

Without a configured tracer provider and with no span active, this adds nothing to
the metadata and the spans are no-ops. Whatever the setting, a consumer can read the
producer's context itself: ``item.trace_context()`` (:func:`extract`), and
``with querator.tracing.process_span(item): ...`` around hand-written lease loops.
"""

from __future__ import annotations

from collections.abc import Iterator, Mapping
from contextlib import contextmanager
from typing import TYPE_CHECKING, Any, Protocol

if TYPE_CHECKING:
    from opentelemetry.context import Context
    from opentelemetry.trace import Span, Tracer

#: The instrumentation scope name of the spans made here.
TRACER_NAME = "querator"
#: The ``messaging.system`` attribute of those spans.
MESSAGING_SYSTEM = "querator"

# The W3C Trace Context fields, set together or not at all.
_TRACE_CONTEXT = ("traceparent", "tracestate")
_MISSING = "querator tracing needs OpenTelemetry: pip install 'querator-client[otel]' (opentelemetry-api)"

_tracer: Tracer | None = None


class TracedItem(Protocol):
    """What :func:`process_span` reads: a leased item (LeasedItem or AsyncLeasedItem)."""

    @property
    def queue_name(self) -> str: ...
    @property
    def partition(self) -> int: ...
    @property
    def id(self) -> str: ...
    @property
    def attempts(self) -> int: ...
    @property
    def payload(self) -> bytes: ...
    @property
    def metadata(self) -> Mapping[str, str]: ...


def available() -> bool:
    """True when OpenTelemetry (the ``otel`` extra) can be imported."""
    try:
        import opentelemetry.propagate  # noqa: F401
        import opentelemetry.trace  # noqa: F401
    except ImportError:
        return False
    return True


def require() -> None:
    """Raise ImportError, saying what to install, when OpenTelemetry is missing."""
    if not available():
        raise ImportError(_MISSING)


def inject(metadata: Mapping[str, str] | None = None, *, context: Context | None = None) -> dict[str, str]:
    """``metadata`` plus the trace context, as the global propagator writes it.

    The context is the current one unless ``context`` is given. Keys ``metadata``
    already has are kept (see the module docs). What ``tracing=True`` does to each
    produced item; use it to fill ``Item(metadata=...)`` by hand.
    """
    return _merge_trace(metadata or {}, _carrier(context))


def extract(metadata: Mapping[str, str]) -> Context:
    """The context that ``metadata`` carries (an empty Context when it carries none)."""
    try:
        from opentelemetry import propagate
    except ImportError:
        raise ImportError(_MISSING) from None
    return propagate.extract(metadata)


@contextmanager
def process_span(item: TracedItem, *, client_id: str = "") -> Iterator[Span]:
    """A current CONSUMER span ``"<queue> process"`` for handling ``item``.

    Its parent is the producer's context from ``item.metadata`` (the current context
    when the item carries none) and it links to that context. Attributes:
    ``messaging.system`` (``"querator"``), ``messaging.operation.type`` and
    ``messaging.operation.name`` (``"process"``), ``messaging.destination.name`` (the
    queue), ``messaging.destination.partition.id``, ``messaging.message.id``,
    ``messaging.message.body.size``, ``messaging.client.id`` (when given) and
    ``querator.item.attempts``. An exception raised in the block is recorded on the
    span, which then has status ERROR, and propagates.
    """
    from opentelemetry import trace

    parent = extract(item.metadata) if item.metadata else None
    producer = trace.get_current_span(parent).get_span_context() if parent is not None else None
    if producer is None or not producer.is_valid:
        parent, links = None, None
    else:
        links = [trace.Link(producer)]
    attributes: dict[str, Any] = {
        "messaging.system": MESSAGING_SYSTEM,
        "messaging.operation.type": "process",
        "messaging.operation.name": "process",
        "messaging.destination.name": item.queue_name,
        "messaging.destination.partition.id": str(item.partition),
        "messaging.message.id": item.id,
        "messaging.message.body.size": len(item.payload),
        "querator.item.attempts": item.attempts,
    }
    if client_id:
        attributes["messaging.client.id"] = client_id
    with _get_tracer().start_as_current_span(
        f"{item.queue_name} process",
        context=parent,
        kind=trace.SpanKind.CONSUMER,
        attributes=attributes,
        links=links,
    ) as span:
        yield span


# -- used by the clients, producers and workers -------------------------------------------


def _get_tracer() -> Tracer:
    global _tracer
    if _tracer is None:
        from opentelemetry import trace

        from . import __version__

        # A tracer taken before the application sets its provider follows it later.
        _tracer = trace.get_tracer(TRACER_NAME, __version__)
    return _tracer


def _carrier(context: Context | None = None) -> dict[str, str]:
    """The trace context as the global propagator writes it (empty without a span)."""
    try:
        from opentelemetry import propagate
    except ImportError:
        raise ImportError(_MISSING) from None
    carrier: dict[str, str] = {}
    propagate.inject(carrier, context=context)
    return carrier


def _merge_trace(own: Mapping[str, str], carrier: Mapping[str, str]) -> dict[str, str]:
    """``own`` plus the pairs of ``carrier`` it lacks (a traceparent/tracestate pair
    given in ``own``, even half of it, keeps both out of ``carrier``)."""
    if not own:
        return dict(carrier)
    out = dict(own)
    own_context = any(key in own for key in _TRACE_CONTEXT)
    for key, value in carrier.items():
        if key in out or (own_context and key in _TRACE_CONTEXT):
            continue
        out[key] = value
    return out


__all__ = [
    "MESSAGING_SYSTEM",
    "TRACER_NAME",
    "TracedItem",
    "available",
    "extract",
    "inject",
    "process_span",
    "require",
]
