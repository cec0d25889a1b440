"""The stored item record: encode/decode and the in-place rewrites used on hot paths."""

from __future__ import annotations

from hypothesis import given
from hypothesis import strategies as st

from querator_server.storage.record import (
    Item,
    plain_header,
    plain_leaser,
    read_state,
    with_lease,
    with_lease_key,
    without_lease,
)

text = st.text(max_size=40)
items = st.builds(
    Item,
    payload=st.binary(max_size=200),
    encoding=text,
    kind=text,
    reference=text,
    source_id=text,
    created_at=st.integers(0, 2**62),
    expire_deadline=st.integers(0, 2**62),
    enqueue_at=st.integers(0, 2**62),
    attempts=st.integers(0, 2**31),
    is_leased=st.booleans(),
    lease_deadline=st.integers(0, 2**62),
    leased_at=st.integers(0, 2**62),
    lease_key=text,
    metadata=st.dictionaries(st.text(min_size=1, max_size=10), text, max_size=4),
    expiry_run=st.booleans(),
    # The history: absent from most items, so drawn empty half the time.
    message_id=st.one_of(st.just(""), text),
    dead_reason=st.integers(0, 3),
    dead_at=st.integers(0, 2**62),
    dead_attempts=st.integers(0, 2**31),
    # The last error: absent from most items too.
    last_error=st.one_of(st.just(""), st.text(max_size=300)),
    last_error_at=st.one_of(st.just(0), st.integers(0, 2**62)),
)


@given(items)
def test_records_round_trip(item: Item) -> None:
    raw = item.encode()
    assert Item.decode(raw) == item
    state = read_state(raw)
    assert (state.is_leased, state.attempts, state.source_id, state.lease_key, state.expiry_run) == (
        item.is_leased,
        item.attempts,
        item.source_id,
        item.lease_key,
        item.expiry_run,
    )


@given(items, st.integers(0, 2**31), st.integers(0, 2**62), st.integers(0, 2**62), text)
def test_lease_rewrites_change_only_the_lease_fields(
    item: Item, attempts: int, deadline: int, leased_at: int, key: str
) -> None:
    raw = item.encode()
    expected = Item.decode(raw)
    expected.is_leased, expected.attempts, expected.lease_deadline, expected.leased_at = True, attempts, deadline, leased_at
    assert Item.decode(with_lease(raw, read_state(raw), attempts=attempts, deadline=deadline, leased_at=leased_at)) == (
        expected
    )
    expected.lease_key = key
    assert Item.decode(with_lease_key(raw, attempts=attempts, deadline=deadline, leased_at=leased_at, lease_key=key)) == (
        expected
    )


@given(items, st.integers(0, 2**31))
def test_giving_a_lease_back_changes_only_the_lease_fields(item: Item, attempts: int) -> None:
    raw = item.encode()
    expected = Item.decode(raw)
    expected.is_leased, expected.attempts, expected.lease_deadline, expected.leased_at = False, attempts, 0, 0
    assert Item.decode(without_lease(raw, read_state(raw), attempts=attempts)) == expected


payload_only = st.builds(
    Item,
    payload=st.binary(max_size=200),
    created_at=st.integers(0, 2**62),
    expire_deadline=st.integers(0, 2**62),
    attempts=st.integers(0, 7),
    expiry_run=st.booleans(),
)


@given(st.one_of(items, payload_only), st.integers(0, 2**62), st.integers(0, 5), st.integers(0, 2**62), text)
def test_the_plain_lease_matches_the_general_path_or_declines(
    item: Item, now: int, max_attempts: int, deadline: int, key: str
) -> None:
    raw = item.encode()
    plain = plain_leaser(now=now, max_attempts=max_attempts, deadline=deadline, key_bytes=key.encode())(raw)
    payload_only = not (
        item.source_id or item.reference or item.encoding or item.kind or item.lease_key or item.metadata
    ) and not (item.message_id or item.dead_reason or item.dead_at or item.dead_attempts or item.last_error or item.last_error_at)
    dying = item.expire_deadline <= now or bool(max_attempts and item.attempts >= max_attempts)
    if not payload_only or dying:
        assert plain is None
        return
    assert plain is not None
    leased, payload, attempts, created = plain
    general = with_lease_key(raw, attempts=item.attempts + 1, deadline=deadline, leased_at=now, lease_key=key)
    assert leased == general
    decoded = Item.decode(general)
    assert (payload, attempts, created) == (decoded.payload, decoded.attempts, decoded.created_at)


@given(st.binary(max_size=200), st.integers(0, 2**62), st.integers(0, 2**62), st.booleans())
def test_the_shared_header_of_bare_payloads_is_their_encoding(payload: bytes, created: int, expire: int, run: bool) -> None:
    item = Item(payload, created_at=created, expire_deadline=expire, expiry_run=run)
    assert plain_header(created, expire, expiry_run=run) + payload == item.encode()


def test_an_item_without_history_stores_none_and_reads_back_empty() -> None:
    """Fresh items (nearly all) pay nothing for the history: the same bytes as before."""
    plain = Item(b"p", created_at=5, expire_deadline=9)
    with_history = Item(b"p", created_at=5, expire_deadline=9, message_id="1.0.a")
    assert len(with_history.encode()) > len(plain.encode()) == len(plain_header(5, 9)) + 1
    assert Item.decode(plain.encode()).message_id == ""
