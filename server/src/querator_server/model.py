"""Domain values shared by the manager, the actors and the gRPC layer."""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from dataclasses import dataclass

from .clock import MICROS
from .errors import InvalidArgument

DEFAULT_LEASE_TIMEOUT_US = 60 * MICROS
DEFAULT_EXPIRE_TIMEOUT_US = 24 * 3600 * MICROS
DEFAULT_DEDUP_WINDOW_US = 24 * 3600 * MICROS
DEFAULT_LEASE_KEY_TTL_US = 3600 * MICROS
MAX_KEY_BYTES = 512
# An imported item's source_id is stored raw in a key ("u" + source id, storage/record.py),
# and LMDB refuses keys over 511 bytes: a longer one used to fail the whole cycle.
MAX_SOURCE_ID_BYTES = 510
MAX_METADATA_PAIRS = 64
# Item priorities are 0 (the default) to this, higher leased first.
MAX_PRIORITY = 9
MAX_METADATA_BYTES = 16 * 1024
MAX_ATTEMPTS_LIMIT = 65_536
MAX_PARTITIONS = 1024
# Copies of a replicated queue (cluster mode): each on its own node.
MAX_REPLICAS = 7
MAX_QUEUE_NAME = 512
# Free text, in bytes of UTF-8: a queue's reference, and an item's reference, kind and
# encoding. Items carry them to every lease and listing; a bound keeps a reply's size
# a matter of payloads.
MAX_REFERENCE_BYTES = 1024
MAX_LABEL_BYTES = 256
# An item's last error (RetryItem.error): enough for an exception's type, message and
# last traceback frames, small enough that a page of dead letters stays a page.
MAX_ERROR_BYTES = 2048
MAX_BATCH = 1000
MAX_REQUEST_BYTES = 5_000_000
# The largest message the server receives or sends. Headroom over MAX_REQUEST_BYTES so
# an oversized request is answered RESOURCE_EXHAUSTED by us, with a message, rather
# than cut off by the transport; and above the largest reply (one item of nearly
# MAX_REQUEST_BYTES, see MAX_REPLY_BYTES). Channels between cluster nodes accept it
# too, so whatever one node may send another arrives.
MAX_MESSAGE_BYTES = MAX_REQUEST_BYTES + (4 << 20)
MAX_WAIT_US = 15 * 60 * MICROS
# The longest durations accepted, so that every time computed from one (a lease's
# deadline, an item's expiry, a due time) stays far inside what a protobuf Timestamp
# can hold (year 9999): INVALID_ARGUMENT beyond them.
MAX_LEASE_TIMEOUT_US = 24 * 3600 * MICROS
MAX_LONG_DURATION_US = 10 * 365 * 24 * 3600 * MICROS
DEFAULT_WAIT_US = 30 * MICROS
# The expire deadline of items that never expire (dead letters in their dead-letter
# queue): the last microsecond a protobuf Timestamp can hold, so every time computed
# from it stays valid, and it sorts after every real deadline in the expiry index.
NEVER_US = 253_402_300_799_999_999
SCHEDULE_MIN_US = 100_000
DEFAULT_PAGE_SIZE = 100
MAX_PAGE_SIZE = 1000

# The largest reply a Lease or a listing page is built to: gRPC's default receive limit,
# so that a client with default settings (grpcurl, another language's stub) can read
# every reply. A Lease stops before the item that would pass it and a page ends there,
# but one item is always answered, and Produce keeps an item below MAX_REQUEST_BYTES,
# which the server's send limit (MAX_MESSAGE_BYTES, about 9.2 MB) is set above.
MAX_REPLY_BYTES = 4 << 20
# Set aside for what a reply holds besides its items: the queue name, the partition,
# a page token, and the envelope of a stream's answer.
REPLY_FRAME_BYTES = 4096
# What the items of one reply may add up to.
REPLY_ITEMS_BYTES = MAX_REPLY_BYTES - REPLY_FRAME_BYTES
# LeaseStream answers made but not yet sent (grpc_api/send_room.py). Per stream: the
# answer being sent and the next one, both full; server-wide: 64 streams' worth.
STREAM_UNSENT_BYTES = 2 * MAX_REPLY_BYTES
SERVER_UNSENT_BYTES = 64 * MAX_REPLY_BYTES
# How long one answer may wait to be sent before its stream is ended and the items of
# its unsent answers given back: a reader that takes this long for 4 MiB is stuck.
STALL_SECONDS = 60.0
# A bound on what an item's reply entry adds to its stored record: its id, times,
# attempts and the tags and lengths around them (under 100 bytes; the stored header
# alone is 69), with room for fields to come.
ITEM_REPLY_OVERHEAD = 256
# Metadata is stored as compact JSON (at least 6 bytes around each pair) and sent as
# protobuf map entries (at most 11): this much more per pair, at most.
METADATA_PAIR_OVERHEAD = 5


@dataclass(frozen=True, slots=True)
class QueueConfig:
    """A queue's settings as stored in the catalog."""

    name: str
    uid: int = 0
    # A copy of a replicated queue's shard (cluster mode): ``uid`` is the shard's, the
    # same on every node, and the storage keeps a replication position. Node-local,
    # like ``group``: whether this node serves it is the cluster's to say.
    shard_copy: bool = False
    dead_queue: str = ""
    reference: str = ""
    lease_timeout_us: int = DEFAULT_LEASE_TIMEOUT_US
    expire_timeout_us: int = DEFAULT_EXPIRE_TIMEOUT_US
    max_attempts: int = 0
    partitions: int = 1
    created_at_us: int = 0
    updated_at_us: int = 0
    dedup_window_us: int = DEFAULT_DEDUP_WINDOW_US
    lease_key_ttl_us: int = DEFAULT_LEASE_KEY_TTL_US
    # The commit group whose environment holds the queue's storage; -1: a directory of
    # its own (queues/<uid>). Not part of the API: where the server keeps the items.
    group: int = -1
    # Cluster mode: the nodes keeping a full copy (1: each partition on one node; 0 in a
    # CreateQueue: the server's default) and the fewest in-sync copies writes need (0:
    # the default rule). Kept in the cluster catalog, never in a node's own.
    replicas: int = 1
    min_in_sync: int = 0
    # PauseQueue / ResumeQueue: no items handed out while paused (leases wait); with
    # produce_paused, Produce is refused too. Stored with the rest, so a pause
    # outlives a restart and, in a cluster, reaches every node through the catalog.
    paused: bool = False
    produce_paused: bool = False

    def replace(self, **changes: object) -> QueueConfig:
        return dataclasses.replace(self, **changes)  # type: ignore[arg-type]


@dataclass(slots=True)
class NewItem:
    """An item as a producer (or an import) hands it to a queue."""

    payload: bytes
    encoding: str = ""
    kind: str = ""
    reference: str = ""
    enqueue_at_us: int = 0
    idempotency_key: str = ""
    metadata: dict[str, str] = dataclasses.field(default_factory=dict)
    # The ordered group (storage/ordered_groups.py); "" for none.
    group_key: str = ""
    # 0 to 9, higher leased first (MAX_PRIORITY).
    priority: int = 0


@dataclass(slots=True)
class ImportedItem:
    """An item given to ImportItems: stored fields kept as given."""

    payload: bytes
    encoding: str = ""
    kind: str = ""
    reference: str = ""
    is_leased: bool = False
    lease_deadline_us: int = 0
    expire_deadline_us: int = 0
    enqueue_at_us: int = 0
    created_at_us: int = 0
    attempts: int = 0
    source_id: str = ""
    metadata: dict[str, str] = dataclasses.field(default_factory=dict)
    # The history (storage/record.py): kept as given.
    message_id: str = ""
    dead_reason: int = 0
    dead_at_us: int = 0
    dead_attempts: int = 0
    last_error: str = ""
    last_error_at_us: int = 0
    priority: int = 0


@dataclass(slots=True)
class RetryOrder:
    """What to do with one leased item given back by Retry."""

    item_id: str
    retry_at_us: int = 0
    dead: bool = False
    # The failure text to keep as the item's last error ("" keeps the one it has).
    error: str = ""


@dataclass(slots=True)
class PartitionStats:
    partition: int
    total: int
    total_leased: int
    scheduled: int
    average_age_us: int
    average_leased_age_us: int
    # Why the partition is faulty and since when (wall µs); "" and 0 while it serves.
    failure: str = ""
    faulty_since_us: int = 0
    # Items produced and completed since the partition was loaded (counters).
    produced: int = 0
    completed: int = 0
    # Ordered groups whose first item is leased, and when the item waiting longest
    # behind its group's first was produced (wall µs; 0: none waits).
    groups_in_flight: int = 0
    oldest_waiting_at_us: int = 0


@dataclass(slots=True)
class QueueTotals:
    """A queue's counts summed over its partitions (what a metrics scrape reports)."""

    partitions: int
    ready: int
    leased: int
    scheduled: int
    created_sum: int  # of the ready, leased and waiting items' created_at, for their average age
    lease_waiting: int
    produce_waiting: int
    faulty: int = 0  # partitions
    # Items of ordered groups waiting behind their group's first; groups with one leased.
    waiting: int = 0
    groups_in_flight: int = 0


@dataclass(slots=True)
class QueueStats:
    partitions: list[PartitionStats]
    lease_waiting: int
    produce_waiting: int
    in_flight: int


def cut_error(text: str) -> str:
    """Failure text as stored: at most MAX_ERROR_BYTES bytes of UTF-8. Longer text is
    cut at a character boundary and ends with a marker saying how many bytes went, so
    a reader sees that it was cut (the start of a message says most)."""
    if len(text) <= MAX_ERROR_BYTES // 4:
        return text  # at most 4 bytes a character: fits, without encoding it
    data = text.encode()
    if len(data) <= MAX_ERROR_BYTES:
        return text
    keep = MAX_ERROR_BYTES
    while True:
        marker = f"... [cut {len(data) - keep} bytes]"
        head = data[: MAX_ERROR_BYTES - len(marker)].decode(errors="ignore")  # drops a split character
        kept = len(head.encode())
        if kept == keep:
            return head + marker
        keep = kept  # the marker's count changed with what is kept; once more


def check_key(value: str, field: str) -> str:
    """An optional idempotency or lease key: at most MAX_KEY_BYTES bytes of UTF-8."""
    if len(value) > MAX_KEY_BYTES or len(value.encode()) > MAX_KEY_BYTES:
        raise InvalidArgument(field, f"must be at most {MAX_KEY_BYTES} bytes")
    return value


def check_lease_keys(keys: Sequence[str]) -> list[str]:
    """The lease_keys of a Complete or Extend: at most MAX_BATCH keys, each a valid key.
    Checked whole before a cluster splits them over their homes, so a bad key changes
    nothing anywhere."""
    checked = [check_key(k, f"lease_keys[{i}]") for i, k in enumerate(keys)]
    if len(checked) > MAX_BATCH:
        raise InvalidArgument("lease_keys", f"must hold at most {MAX_BATCH} keys, got {len(checked)}")
    return checked
