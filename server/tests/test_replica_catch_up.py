"""How a copy catches up (cluster/change_ring.py) and what the replication calls carry
(cluster/replica_wire.py): pure parts, no server."""

from __future__ import annotations

import pytest

from querator_server.cluster.change_ring import ChangeRing, Path
from querator_server.cluster.replica_wire import CopyState, Ship, SnapshotHead, StatusAsk, pack, unpack
from querator_server.errors import InvalidArgument


def ring_of(*positions: tuple[int, int], **limits: int) -> ChangeRing:
    ring = ChangeRing(**limits)
    for epoch, lsn in positions:
        ring.add(epoch, lsn, f"{epoch}.{lsn}".encode())
    return ring


def test_a_copy_at_the_primarys_position_is_in_step() -> None:
    ring = ring_of((1, 1), (1, 2))
    assert ring.path((1, 2), (1, 2)) is Path.IN_STEP


def test_a_copy_on_the_history_is_tailed_from_after_its_position() -> None:
    ring = ring_of((1, 1), (1, 2), (2, 3), (2, 4))
    assert ring.path((1, 2), (2, 4)) is Path.TAIL
    assert [e.lsn for e in ring.after(2, 1 << 20)] == [3, 4]
    # Just before the ring's first change: on the history when that change is of its epoch.
    assert ring.path((0, 0), (2, 4)) is Path.TAIL  # an empty copy is on every history
    assert ring_of((1, 4), (1, 5)).path((1, 3), (1, 5)) is Path.TAIL
    assert ring_of((2, 5), (2, 6)).path((1, 4), (2, 6)) is Path.SNAPSHOT


def test_a_copy_on_another_epochs_history_gets_a_snapshot() -> None:
    # The old primary wrote (1, 3) that nobody acked; the new primary's lsn 3 is of epoch 2.
    ring = ring_of((1, 1), (1, 2), (2, 3), (2, 4))
    assert ring.path((1, 3), (2, 4)) is Path.SNAPSHOT


def test_a_copy_ahead_of_the_primary_gets_a_snapshot() -> None:
    ring = ring_of((1, 1), (1, 2))
    assert ring.path((1, 3), (2, 2)) is Path.SNAPSHOT
    assert ring.path((1, 2), (2, 2)) is Path.SNAPSHOT  # level, on another history


def test_a_copy_older_than_the_ring_gets_a_snapshot() -> None:
    ring = ring_of(*((1, n) for n in range(1, 11)), max_changes=4)
    assert len(ring) == 4 and ring.first_lsn == 7
    assert ring.path((1, 5), (1, 10)) is Path.SNAPSHOT
    assert ring.path((1, 6), (1, 10)) is Path.TAIL
    assert ring_of().path((1, 1), (1, 2)) is Path.SNAPSHOT  # nothing kept: a snapshot


def test_the_ring_is_bounded_by_bytes_and_never_has_holes() -> None:
    ring = ChangeRing(max_bytes=10)
    for n in range(1, 6):
        ring.add(1, n, b"xxxx")
    assert [e.lsn for e in ring.after(0, 1 << 20)] == [4, 5]
    ring.add(1, 9, b"y")  # after a snapshot installed here: starts again
    assert [e.lsn for e in ring.after(0, 1 << 20)] == [9]


def test_a_tail_batch_is_bounded_but_never_empty() -> None:
    ring = ChangeRing()
    for n in range(1, 4):
        ring.add(1, n, b"z" * 100)
    assert [e.lsn for e in ring.after(0, 150)] == [1]
    assert [e.lsn for e in ring.after(0, 10)] == [1]
    assert [e.lsn for e in ring.after(0, 250)] == [1, 2]


def test_the_messages_survive_the_wire() -> None:
    ship = Ship(1 << 40, 3, "n1", "inc", (b"a", b"", b"\x00" * 5))
    assert Ship.decode(ship.encode()) == ship
    assert StatusAsk.decode(StatusAsk(7, 4).encode()) == StatusAsk(7, 4)
    state = CopyState(2, 9, "inc", 3, True, "fenced", "why", 2)
    assert CopyState.decode(state.encode()) == state
    # A node before the ``rebuilt`` field sends none: never rebuilt, as far as it says.
    older = pack({"epoch": 2, "lsn": 9, "incarnation": "inc", "fenced_epoch": 3, "primary": False})
    assert CopyState.decode(older).rebuilt == 0
    with pytest.raises(InvalidArgument, match="rebuilt"):
        CopyState.decode(pack({"epoch": 2, "lsn": 9, "incarnation": "inc", "fenced_epoch": 3, "rebuilt": -1}))
    assert SnapshotHead.decode(SnapshotHead(5, 2, "n2").encode()) == SnapshotHead(5, 2, "n2")


@pytest.mark.parametrize(
    ("data", "field"),
    [
        (b"\x00\x00", "value"),
        (b"\x00\x00\x00\x05[1,2]", "value"),
        (pack({"uid": 1}, [b"abc"])[:-1], "value"),
        (pack({"uid": -1, "epoch": 1, "primary": "n1", "incarnation": ""}), "uid"),
        (pack({"uid": 1, "epoch": "x", "primary": "n1", "incarnation": ""}), "epoch"),
        (pack({"uid": 1, "epoch": 1, "primary": 5, "incarnation": ""}), "primary"),
    ],
)
def test_a_malformed_message_names_what_is_wrong(data: bytes, field: str) -> None:
    with pytest.raises(InvalidArgument) as caught:
        Ship.decode(data)
    assert caught.value.violations[0][0] == field


def test_pack_keeps_empty_blobs() -> None:
    assert unpack(pack({"a": 1}, [b"", b"x"])) == ({"a": 1}, [b"", b"x"])
