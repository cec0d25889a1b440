"""Server reflection that serves the querator/v1 files with their comments.

The descriptors compiled into the generated ``*_pb2`` modules carry no
SourceCodeInfo, so plain reflection gives clients such as ``grpcurl describe``
the API without its comments, which are the API reference. The client package
ships ``querator/v1/querator_v1.binpb`` (written by scripts/gen_proto.sh with
``--include_source_info``); this servicer hands out those richer
FileDescriptorProtos instead of the plain ones for our files.

It also finds the file of a method name (``package.Service.Method``), which
the upb descriptor pool does not index, and ends its open streams (OK) when the
server shuts down: a reflection stream (grpcurl, grpcui) stays open until its
client closes it, and would otherwise hold a SIGTERM for the whole grace period.

A file from the set is served only when it describes exactly what the running
server uses (compared without source info and json_name); a stale or missing
set falls back to the plain descriptors.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator, Iterable, Mapping
from importlib import resources
from typing import Any

from google.protobuf import descriptor_pb2, descriptor_pool
from grpc_reflection.v1alpha import reflection, reflection_pb2

from .logging import get_logger

log = get_logger("reflection")

DESCRIPTOR_SET_PACKAGE = "querator.v1"
DESCRIPTOR_SET_NAME = "querator_v1.binpb"


def load_source_descriptors() -> dict[str, descriptor_pb2.FileDescriptorProto]:
    """The FileDescriptorProtos with source info shipped in the client package, by file name."""
    try:
        data = resources.files(DESCRIPTOR_SET_PACKAGE).joinpath(DESCRIPTOR_SET_NAME).read_bytes()
    except (FileNotFoundError, ModuleNotFoundError, OSError) as exc:
        log.warning("reflection_source_info_missing", error=str(exc))
        return {}
    files = descriptor_pb2.FileDescriptorSet.FromString(data).file
    return {f.name: f for f in files}


def _clear_json_names(messages: Iterable[descriptor_pb2.DescriptorProto]) -> None:
    for message in messages:
        for field in (*message.field, *message.extension):
            field.ClearField("json_name")
        _clear_json_names(message.nested_type)


def _normalized(file: descriptor_pb2.FileDescriptorProto) -> descriptor_pb2.FileDescriptorProto:
    copy = descriptor_pb2.FileDescriptorProto()
    copy.CopyFrom(file)
    copy.ClearField("source_code_info")
    for field in copy.extension:
        field.ClearField("json_name")
    _clear_json_names(copy.message_type)
    return copy


class ReflectionServicer(reflection.aio.ReflectionServicer):  # type: ignore[name-defined,misc]
    """The grpc.aio reflection servicer, answering with source info for our files."""

    def __init__(
        self,
        service_names: Iterable[str],
        pool: descriptor_pool.DescriptorPool | None = None,
        source_descriptors: Mapping[str, descriptor_pb2.FileDescriptorProto] | None = None,
    ) -> None:
        super().__init__(service_names, pool)
        self._source = dict(load_source_descriptors() if source_descriptors is None else source_descriptors)
        # Plain serialized FileDescriptorProto -> what to send instead (itself when
        # there is nothing better). Bounded by the number of files in the pool.
        self._served: dict[bytes, bytes] = {}
        self._ending: asyncio.Event | None = None

    async def ServerReflectionInfo(  # noqa: N802 -- gRPC's name
        self, request_iterator: AsyncIterator[reflection_pb2.ServerReflectionRequest], context: Any
    ) -> AsyncIterator[reflection_pb2.ServerReflectionResponse]:
        if self._ending is None:
            self._ending = asyncio.Event()
        requests = _until(request_iterator, self._ending)
        async for response in super().ServerReflectionInfo(requests, context):
            yield response

    def end_streams(self) -> None:
        """End every open stream, and each one opened from now on, after the answer
        to the request it is handling (shutting down)."""
        if self._ending is None:
            self._ending = asyncio.Event()
        self._ending.set()

    def _enrich(self, serialized: bytes) -> bytes:
        served = self._served.get(serialized)
        if served is not None:
            return served
        served = serialized
        plain = descriptor_pb2.FileDescriptorProto.FromString(serialized)
        rich = self._source.get(plain.name)
        if rich is not None:
            if _normalized(plain) == _normalized(rich):
                served = rich.SerializeToString()
            else:
                log.warning("reflection_source_info_stale", file=plain.name)
        self._served[serialized] = served
        return served

    def _with_source_info(
        self, response: reflection_pb2.ServerReflectionResponse
    ) -> reflection_pb2.ServerReflectionResponse:
        if self._source and response.HasField("file_descriptor_response"):
            protos = response.file_descriptor_response.file_descriptor_proto
            protos[:] = [self._enrich(p) for p in protos]
        return response

    def _file_by_filename(
        self, request: reflection_pb2.ServerReflectionRequest, filename: str
    ) -> reflection_pb2.ServerReflectionResponse:
        return self._with_source_info(super()._file_by_filename(request, filename))

    def _file_containing_symbol(
        self, request: reflection_pb2.ServerReflectionRequest, fully_qualified_name: str
    ) -> reflection_pb2.ServerReflectionResponse:
        response = super()._file_containing_symbol(request, fully_qualified_name)
        if response.HasField("error_response"):
            # The upb descriptor pool does not index methods, so a method name
            # ("querator.v1.QueueService.Lease", as in grpcurl describe) is not
            # found; answer with the file of its service.
            service, _, method = fully_qualified_name.rpartition(".")
            try:
                found = method in self._pool.FindServiceByName(service).methods_by_name
            except KeyError:
                found = False
            if found:
                response = super()._file_containing_symbol(request, service)
        return self._with_source_info(response)

    def _file_containing_extension(
        self, request: reflection_pb2.ServerReflectionRequest, containing_type: str, extension_number: int
    ) -> reflection_pb2.ServerReflectionResponse:
        return self._with_source_info(
            super()._file_containing_extension(request, containing_type, extension_number)
        )


async def _until(messages: AsyncIterator[Any], ending: asyncio.Event) -> AsyncIterator[Any]:
    """``messages``, ending (as if the client had closed its side) once ``ending`` is set."""
    upcoming = messages.__aiter__()
    ended = asyncio.ensure_future(ending.wait())
    read: asyncio.Future[Any] | None = None
    try:
        while not ending.is_set():
            read = asyncio.ensure_future(upcoming.__anext__())
            await asyncio.wait((read, ended), return_when=asyncio.FIRST_COMPLETED)
            if not read.done():
                read.cancel()
                with contextlib.suppress(asyncio.CancelledError, StopAsyncIteration):
                    await read
                return
            try:
                yield read.result()
            except StopAsyncIteration:
                return
    finally:
        ended.cancel()
        # A client that hangs up cancels this generator while a read is pending; the
        # read then ends (StopAsyncIteration, or the call's error) with nobody to take
        # its outcome, and asyncio would print "Task exception was never retrieved".
        if read is not None and not read.done():
            read.cancel()
            read.add_done_callback(_outcome_taken)


def _outcome_taken(future: asyncio.Future[Any]) -> None:
    if not future.cancelled():
        future.exception()


__all__ = ["ReflectionServicer", "load_source_descriptors"]
