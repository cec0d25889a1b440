"""The connector's options: parsed once on the driver, case-insensitive, validated.

Spark hands a data source its options as strings in a case-insensitive mapping; the
dataclasses here hold them typed, and are pickled to the executors with the readers
and writers (they hold no connection).
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from dataclasses import dataclass

from .._config import ADDRESS_ENV, DEFAULT_ADDRESS, MAX_BATCH

#: Read modes: a batch read lists the stored items; a streaming read leases them.
SNAPSHOT = "snapshot"
STREAM = "stream"


class OptionError(ValueError):
    """An option is missing or has a value the connector cannot use."""


class Options:
    """Lower-cased view of Spark's options with typed getters that name the option on error."""

    def __init__(self, raw: Mapping[str, str]) -> None:
        self._raw = {str(k).lower(): str(v) for k, v in raw.items() if v is not None}

    def text(self, name: str, default: str = "") -> str:
        return self._raw.get(name.lower(), default).strip()

    def required(self, name: str) -> str:
        value = self.text(name)
        if not value:
            raise OptionError(f"option {name!r} is required")
        return value

    def integer(self, name: str, default: int, *, low: int = 0, high: int | None = None) -> int:
        value = self.text(name)
        if not value:
            return default
        try:
            number = int(value)
        except ValueError:
            raise OptionError(f"option {name!r} must be an integer, got {value!r}") from None
        if number < low or (high is not None and number > high):
            bounds = f"{low}..{high}" if high is not None else f">= {low}"
            raise OptionError(f"option {name!r} must be {bounds}, got {number}")
        return number

    def number(self, name: str, default: float, *, low: float = 0.0) -> float:
        value = self.text(name)
        if not value:
            return default
        try:
            number = float(value)
        except ValueError:
            raise OptionError(f"option {name!r} must be a number, got {value!r}") from None
        if number < low:
            raise OptionError(f"option {name!r} must be >= {low}, got {number}")
        return number

    def flag(self, name: str, default: bool = False) -> bool:
        value = self.text(name).lower()
        if not value:
            return default
        if value in ("true", "1", "yes", "on"):
            return True
        if value in ("false", "0", "no", "off"):
            return False
        raise OptionError(f"option {name!r} must be true or false, got {value!r}")


@dataclass(frozen=True, slots=True)
class Connection:
    """Where the server is and how to talk to it (options shared by every mode)."""

    address: str
    queue: str
    token: str = ""
    tls: bool = False
    root_certificates: bytes | None = None
    #: Deadline of each call, seconds.
    timeout: float = 30.0
    #: Retries of a call that failed with UNAVAILABLE (every call the connector makes is
    #: safe to repeat: produces carry idempotency keys, leases carry lease keys).
    retries: int = 3

    @classmethod
    def parse(cls, options: Options) -> Connection:
        root: bytes | None = None
        path = options.text("rootCertificates")
        if path:
            try:
                with open(path, "rb") as f:
                    root = f.read()
            except OSError as exc:
                raise OptionError(f"option 'rootCertificates': cannot read {path!r}: {exc}") from None
        return cls(
            address=options.text("address") or os.environ.get(ADDRESS_ENV) or DEFAULT_ADDRESS,
            queue=options.required("queue"),
            token=options.text("token"),
            tls=options.flag("tls") or root is not None,
            root_certificates=root,
            timeout=options.number("timeout", 30.0, low=0.001),
            retries=options.integer("retries", 3),
        )


@dataclass(frozen=True, slots=True)
class WriteOptions:
    connection: Connection
    #: Items per Produce request (the server takes at most 1,000 and 5 MB).
    batch_size: int = MAX_BATCH
    #: Produce requests each task keeps in flight.
    in_flight: int = 4
    #: A column whose values are the items' idempotency keys (re-running a job adds nothing).
    key_column: str = ""

    @classmethod
    def parse(cls, options: Options) -> WriteOptions:
        return cls(
            connection=Connection.parse(options),
            batch_size=options.integer("batchSize", MAX_BATCH, low=1, high=MAX_BATCH),
            in_flight=options.integer("inFlight", 4, low=1, high=64),
            key_column=options.text("keyColumn"),
        )


@dataclass(frozen=True, slots=True)
class ReadOptions:
    connection: Connection
    mode: str
    #: Snapshot: items per ListItems page.
    page_size: int = MAX_BATCH
    #: Snapshot: list scheduled items too.
    include_scheduled: bool = False
    #: Stream: the most items one micro-batch takes (0: everything ready).
    max_items_per_trigger: int = 0
    #: Stream: Spark partitions per micro-batch (0: one per queue partition).
    num_partitions: int = 0
    #: Stream: items per keyed Lease call (recorded in each offset, so changing it
    #: never changes how a planned batch is replayed).
    lease_batch_size: int = MAX_BATCH
    #: Stream: keyed Lease calls each task keeps in flight. Enough that the server
    #: always finds calls waiting when a cycle ends: with 2 its loop idled while the
    #: tasks turned replies into rows (1 M items of 100 B: 84,888 items/s; with 8:
    #: 94,798). A task holds up to this many replies of ``lease_batch_size`` items.
    leases_in_flight: int = 8
    #: Stream: the stream's identity in lease keys; default: a random id made when the
    #: query first starts and kept in its checkpoint.
    stream_id: str = ""
    #: Stream: seconds between the driver's lease extensions (0: a third of the
    #: queue's lease_timeout).
    keep_alive_interval: float = 0.0

    @classmethod
    def parse(cls, options: Options, *, streaming: bool) -> ReadOptions:
        mode = options.text("mode", STREAM if streaming else SNAPSHOT).lower()
        if streaming and mode != STREAM:
            raise OptionError(f"option 'mode': a streaming read leases items (mode 'stream'), got {mode!r}")
        if not streaming and mode != SNAPSHOT:
            raise OptionError(
                f"option 'mode': a batch read lists the stored items (mode 'snapshot'), got {mode!r}; "
                "use spark.readStream to consume a queue"
            )
        stream_id = options.text("streamId")
        if ":" in stream_id:
            raise OptionError(f"option 'streamId' must not contain ':', got {stream_id!r}")
        return cls(
            connection=Connection.parse(options),
            mode=mode,
            page_size=options.integer("pageSize", MAX_BATCH, low=1, high=MAX_BATCH),
            include_scheduled=options.flag("includeScheduled"),
            max_items_per_trigger=options.integer("maxItemsPerTrigger", 0),
            num_partitions=options.integer("numPartitions", 0, high=10_000),
            lease_batch_size=options.integer("leaseBatchSize", MAX_BATCH, low=1, high=MAX_BATCH),
            leases_in_flight=options.integer("leasesInFlight", 8, low=1, high=64),
            stream_id=stream_id,
            keep_alive_interval=options.number("keepAliveInterval", 0.0),
        )
