"""querator.tracing: OpenTelemetry trace context from produce to the worker's span."""

from __future__ import annotations

import asyncio
import subprocess
import sys
import threading
from collections.abc import Iterator

import pytest

import querator
import querator.tracing
from querator.embedded import EmbeddedServer

from sdk_helpers import run, srv, unique, wait_until  # noqa: F401 (fixtures)

pytest.importorskip("opentelemetry.sdk.trace")

from opentelemetry import baggage, context, trace  # noqa: E402
from opentelemetry.sdk.trace import ReadableSpan, TracerProvider  # noqa: E402
from opentelemetry.sdk.trace.export import SimpleSpanProcessor  # noqa: E402
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter  # noqa: E402

_EXPORTER = InMemorySpanExporter()
_INSTALLED = False


@pytest.fixture
def spans() -> Iterator[InMemorySpanExporter]:
    """Finished spans of this test, from the global tracer provider (set once per process)."""
    global _INSTALLED
    if not _INSTALLED:
        provider = trace.get_tracer_provider()
        if not isinstance(provider, TracerProvider):
            provider = TracerProvider()
            trace.set_tracer_provider(provider)
        provider.add_span_processor(SimpleSpanProcessor(_EXPORTER))
        _INSTALLED = True
    _EXPORTER.clear()
    yield _EXPORTER
    _EXPORTER.clear()


def tracer() -> trace.Tracer:
    return trace.get_tracer("querator-tests")


def process_spans(exporter: InMemorySpanExporter, queue: str) -> list[ReadableSpan]:
    return [s for s in exporter.get_finished_spans() if s.name == f"{queue} process"]


def test_worker_span_continues_the_producers_trace(srv: EmbeddedServer, spans: InMemorySpanExporter) -> None:
    name = unique()
    seen: dict[str, tuple[trace.SpanContext, trace.SpanContext]] = {}
    lock = threading.Lock()

    def handler(item: querator.LeasedItem) -> None:
        if item.text == "boom":
            raise querator.DeadLetter("no")
        producer = trace.get_current_span(item.trace_context()).get_span_context()
        with lock:
            seen[item.text] = (trace.get_current_span().get_span_context(), producer)

    with srv.client(tracing=True) as client:
        client.create_queue(name)
        with tracer().start_as_current_span("send", kind=trace.SpanKind.PRODUCER) as send:
            client.produce(name, ["a", "boom"])
        with (
            tracer().start_as_current_span("send one") as send_one,
            querator.Producer(client, name, max_latency=0.001) as producer,
        ):
            producer.produce("b")
        client.produce(name, ["no span"])  # no current span: nothing to carry
        with querator.Worker(client, name, handler, concurrency=2, lease_wait=0.2) as worker:
            wait_until(lambda: worker.stats.completed + worker.stats.dead == 4, timeout=5)

    by_text = dict(seen)
    processed = {s.context.span_id: s for s in process_spans(spans, name)}
    assert len(processed) == 4
    for text, parent in (("a", send), ("b", send_one)):
        current, carried = by_text[text]
        span = processed[current.span_id]  # the handler ran inside the worker's span
        want = parent.get_span_context()
        assert carried.trace_id == current.trace_id == want.trace_id
        assert span.parent is not None and span.parent.span_id == want.span_id and span.parent.is_remote
        assert [link.context.span_id for link in span.links] == [want.span_id]
        assert span.kind is trace.SpanKind.CONSUMER
        assert span.attributes is not None
        assert span.attributes["messaging.system"] == "querator"
        assert span.attributes["messaging.destination.name"] == name
        assert span.attributes["messaging.operation.type"] == "process"
        assert span.attributes["messaging.destination.partition.id"] == "0"
        assert span.attributes["querator.item.attempts"] == 1
        assert str(span.attributes["messaging.message.id"])
        assert span.attributes["messaging.client.id"]
    current, carried = by_text["no span"]
    assert not carried.is_valid and processed[current.span_id].parent is None  # a new trace
    [failed] = [s for s in processed.values() if s.status.status_code is trace.StatusCode.ERROR]
    assert failed.context.trace_id == send.get_span_context().trace_id
    assert [e.name for e in failed.events] == ["exception"]


def test_async_worker_and_producer(srv: EmbeddedServer, spans: InMemorySpanExporter) -> None:
    name = unique()
    handled: list[trace.SpanContext] = []

    async def handler(item: querator.AsyncLeasedItem) -> None:
        handled.append(trace.get_current_span().get_span_context())

    async def main() -> trace.SpanContext:
        async with srv.async_client(tracing=True) as c:
            await c.create_queue(name)
            with tracer().start_as_current_span("send") as send:
                await c.produce(name, ["a"])
                async with querator.AsyncProducer(c, name, max_latency=0.001) as producer:
                    await producer.produce("b")
            async with querator.AsyncWorker(c, name, handler, concurrency=2, lease_wait=0.2) as worker:
                while worker.stats.completed < 2:
                    await asyncio.sleep(0.01)
            return send.get_span_context()

    send = run(main(), timeout=10)
    processed = process_spans(spans, name)
    assert len(processed) == 2 and {s.context.span_id for s in processed} == {c.span_id for c in handled}
    for span in processed:
        assert span.context.trace_id == send.trace_id
        assert span.parent is not None and span.parent.span_id == send.span_id
        assert span.kind is trace.SpanKind.CONSUMER


def test_injection_keeps_the_callers_keys(srv: EmbeddedServer, spans: InMemorySpanExporter) -> None:
    own = "00-0af7651916cd43dd8448eb211c80319c-b7ad6b7169203331-01"
    name = unique()
    token = context.attach(baggage.set_baggage("tenant", "t1"))
    try:
        with srv.client(tracing=True) as client:
            client.create_queue(name)
            with tracer().start_as_current_span("send") as send:
                client.produce(
                    name, [querator.Item("own", metadata={"traceparent": own, "k": "v"}), querator.Item("mine")]
                )
            leased = client.lease(name, batch_size=2, wait=0)
    finally:
        context.detach(token)
    mine = send.get_span_context()
    assert leased[0].metadata == {"traceparent": own, "k": "v", "baggage": "tenant=t1"}
    assert (
        leased[1].metadata["traceparent"] == f"00-{mine.trace_id:032x}-{mine.span_id:016x}-{int(mine.trace_flags):02x}"
    )
    extracted = leased[1].trace_context()
    assert trace.get_current_span(extracted).get_span_context().span_id == mine.span_id
    assert baggage.get_baggage("tenant", extracted) == "t1"


def test_nothing_is_added_without_tracing(srv: EmbeddedServer, spans: InMemorySpanExporter) -> None:
    name = unique()
    with srv.client() as client:
        assert client.config.tracing is False
        client.create_queue(name)
        with tracer().start_as_current_span("send"):
            client.produce(name, ["plain", querator.Item("own", metadata={"k": "v"})])
            with querator.Producer(client, name, max_latency=0.001) as producer:
                producer.produce("producer")
        assert [i.metadata for i in client.list_items(name)] == [{}, {"k": "v"}, {}]
        with querator.Worker(client, name, lambda item: None, lease_wait=0.2) as worker:
            wait_until(lambda: worker.stats.completed == 3, timeout=5)
    assert process_spans(spans, name) == []


def test_inject_extract_and_process_span_by_hand(spans: InMemorySpanExporter) -> None:
    assert querator.tracing.available()
    assert querator.tracing.inject({"k": "v"}) == {"k": "v"}  # no span: nothing to add
    with tracer().start_as_current_span("send") as send:
        carried = querator.tracing.inject()
    assert set(carried) == {"traceparent"}
    context_ = querator.tracing.extract(carried)
    assert trace.get_current_span(context_).get_span_context().trace_id == send.get_span_context().trace_id
    # A traceparent or tracestate of the caller keeps the whole pair out.
    assert querator.tracing._merge_trace(
        {"tracestate": "a=1"}, {"traceparent": "x", "tracestate": "b=2", "baggage": "c=3"}
    ) == {
        "tracestate": "a=1",
        "baggage": "c=3",
    }


def test_no_opentelemetry_import_and_no_hard_dependency(srv: EmbeddedServer) -> None:
    script = f"""
import sys
import time
import querator, querator.cli, querator.tracing
loaded = sorted(m for m in sys.modules if m.startswith("opentelemetry"))
assert not loaded, loaded
sys.modules["opentelemetry"] = None  # as if the otel extra were not installed
assert not querator.tracing.available()
with querator.Client({srv.address!r}) as c:
    c.create_queue("plain")
    c.produce("plain", [querator.Item("a", metadata={{"k": "v"}})])
    [item] = c.lease("plain", wait=0)
    assert item.metadata == {{"k": "v"}}
    try:
        item.trace_context()
    except ImportError as exc:
        assert "querator-client[otel]" in str(exc)
    else:
        raise AssertionError("trace_context() without opentelemetry")
    worker = querator.Worker(c, "plain", lambda item: None, lease_wait=0.1)
    c.produce("plain", ["b"])
    with worker:
        deadline = time.monotonic() + 10
        while worker.stats.completed < 1 and time.monotonic() < deadline:
            time.sleep(0.01)
    assert worker.stats.completed == 1
try:
    querator.Client({srv.address!r}, tracing=True)
except ImportError as exc:
    assert "pip install 'querator-client[otel]'" in str(exc)
else:
    raise AssertionError("tracing=True without opentelemetry")
print("ok")
"""
    done = subprocess.run([sys.executable, "-c", script], check=False, capture_output=True, text=True, timeout=30)
    assert done.returncode == 0 and done.stdout.strip() == "ok", done.stderr
