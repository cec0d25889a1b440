"""A queue's cycles against a model of the queue, by random sequences of steps.

Produce (compact, plain items, items with a kind), lease, complete (a leased batch as
handed out, a shuffled part of what is leased, or with an id that is not leased),
retry (at once, or as dead), the lifecycle (ended leases and expired items) and a
moving clock, applied to a real
LMDB partition through ``Cycle``. After every step the stored items, their lease
state and attempts, the expiry index (every item indexed exactly once, no entry left
without items) and the partition's counters must agree with the model.

The runs of completions, leases and expiry entries, and one lease record per lease of
plain items, are shortcuts of the item-by-item rules; this checks that both ways leave
the same queue: an item held by a lease record reads as its record written out would,
the actor's book of lease records is what storage holds, and a restart (the views read
again from storage) finds the same counts and leases. The same runs again with the
queue's databases in a commit group's shared environment, next to another queue's.
"""

from __future__ import annotations

import shutil
import tempfile
from dataclasses import dataclass

from hypothesis import HealthCheck, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, precondition, rule

from querator_server.actor.ids import item_id
from querator_server.actor.loading import load
from querator_server.actor.requests import CompleteRequest, LeaseRequest, ProduceRequest, RetryRequest
from querator_server.actor.view import PartitionView
from querator_server.errors import QueratorError
from querator_server.model import NewItem, QueueConfig, RetryOrder
from querator_server.storage import Item, QueueStore, lease_records
from querator_server.storage.group_layout import open_group_env, queue_prefix
from querator_server.storage.record import item_key

from cycle_helpers import SECOND, T0, request, run_cycle, seq_of, stored_keys

LEASE_S = 10
EXPIRE_S = 60
MAX_ATTEMPTS = 3


@dataclass
class Modelled:
    payload: bytes
    expire: int
    attempts: int = 0
    lease_deadline: int = 0  # 0: ready


class QueueModel(RuleBasedStateMachine):
    def __init__(self) -> None:
        super().__init__()
        self.dir = tempfile.mkdtemp(prefix="querator-model-")
        self.store = QueueStore(self.dir + "/q", 1, map_size=1 << 24, sync=False)
        self.config = QueueConfig(
            name="q",
            uid=1,
            lease_timeout_us=LEASE_S * SECOND,
            expire_timeout_us=EXPIRE_S * SECOND,
            max_attempts=MAX_ATTEMPTS,
        )
        self.views = [PartitionView()]
        self.now = T0
        self.next_seq = 1
        # Seqs completed: a Complete naming them again counts them as done (the model's
        # cycles never run the forgetting of those records).
        self.completed: set[int] = set()
        self.items: dict[int, Modelled] = {}
        self.batches: list[list[str]] = []  # lease results, as handed out

    def teardown(self) -> None:
        self.store.close()
        shutil.rmtree(self.dir, ignore_errors=True)

    def _run(self, steps: object) -> object:
        return run_cycle(self.store, self.config, self.views, self.now, steps)

    def _dying(self, item: Modelled) -> bool:
        return item.expire <= self.now or item.attempts >= MAX_ATTEMPTS

    # -- steps ------------------------------------------------------------------------

    @rule(count=st.integers(1, 25), form=st.sampled_from(["compact", "items", "kinds"]))
    def produce(self, count: int, form: str) -> None:
        payloads = [b"%d-%d" % (self.next_seq, i) for i in range(count)]
        if form == "compact":
            message = ProduceRequest([], payloads)
        else:
            kind = "k" if form == "kinds" else ""
            message = ProduceRequest([NewItem(payload=p, kind=kind if i % 3 == 1 else "") for i, p in enumerate(payloads)])
        produce = request(message)
        cycle = self._run(lambda c, t: c.produce(t, produce))
        ids = cycle.results[0][1].ids  # type: ignore[attr-defined]
        assert [seq_of(text) for text in ids] == list(range(self.next_seq, self.next_seq + count))
        for payload in payloads:
            self.items[self.next_seq] = Modelled(payload, self.now + EXPIRE_S * SECOND)
            self.next_seq += 1

    @rule(quota=st.integers(1, 40))
    def lease(self, quota: int) -> None:
        expected: list[int] = []
        dropped: list[str] = []
        for seq in sorted(self.items):
            item = self.items[seq]
            if item.lease_deadline:
                continue
            if len(expected) == quota:
                break
            if self._dying(item):
                dropped.append(item_id(1, 0, seq))
                continue
            expected.append(seq)
        lease = request(LeaseRequest(quota, "", self.now))
        cycle = self._run(lambda c, t: c.lease(t, [lease]))
        assert [text for text, _reason, _error in cycle.dropped] == dropped  # type: ignore[attr-defined]
        for text in dropped:
            del self.items[seq_of(text)]
        if not expected:
            assert cycle.results == []  # type: ignore[attr-defined]
            return
        result = cycle.results[0][1]  # type: ignore[attr-defined]
        assert [seq_of(text) for text in result.ids] == expected
        assert result.payloads == [self.items[seq].payload for seq in expected]
        for seq in expected:
            self.items[seq].attempts += 1
            self.items[seq].lease_deadline = self.now + LEASE_S * SECOND
        assert result.attempts == [self.items[seq].attempts for seq in expected]
        self.batches.append(list(result.ids))

    @precondition(lambda self: self.batches)
    @rule(data=st.data(), how=st.sampled_from(["batch", "part", "bad"]))
    def complete(self, data: st.DataObject, how: str) -> None:
        batch = data.draw(st.sampled_from(self.batches))
        leased = [text for text in batch if self.items.get(seq_of(text), Modelled(b"", 0)).lease_deadline]
        if how == "batch":
            ids = batch
        elif how == "part":
            ids = data.draw(st.permutations(leased)) if leased else batch
            ids = ids[: data.draw(st.integers(1, max(1, len(ids))))]
        else:
            ids = batch + [item_id(1, 0, self.next_seq + 5)]  # never produced
        done = [text for text in ids if seq_of(text) in self.completed]
        ok = all(self.items.get(seq_of(text), Modelled(b"", 0)).lease_deadline for text in ids if text not in done)
        complete = request(CompleteRequest(0, list(ids)))
        before = stored_keys(self.store), self.views[0].ready, self.views[0].leased
        try:
            cycle = self._run(lambda c, t: c.complete(t, complete))
        except QueratorError:
            assert not ok
            assert (stored_keys(self.store), self.views[0].ready, self.views[0].leased) == before
            return
        assert ok
        assert cycle.results[0][1].already_completed == done  # type: ignore[attr-defined]
        for text in ids:
            if text not in done:
                del self.items[seq_of(text)]
                self.completed.add(seq_of(text))

    @precondition(lambda self: any(item.lease_deadline for item in self.items.values()))
    @rule(data=st.data(), dead=st.booleans())
    def retry(self, data: st.DataObject, dead: bool) -> None:
        leased = sorted(seq for seq, item in self.items.items() if item.lease_deadline)
        chosen = data.draw(st.lists(st.sampled_from(leased), min_size=1, max_size=5, unique=True))
        retry = request(RetryRequest(0, [RetryOrder(item_id(1, 0, seq), dead=dead) for seq in chosen]))
        cycle = self._run(lambda c, t: c.retry(t, retry))
        dropped: list[str] = []
        for seq in chosen:
            item = self.items.pop(seq)
            item.lease_deadline = 0
            if dead or self._dying(item):
                dropped.append(item_id(1, 0, seq))
            else:
                self.items[self.next_seq] = item  # back at the tail under a new id
                self.next_seq += 1
        assert [text for text, _reason, _error in cycle.dropped] == dropped  # type: ignore[attr-defined]

    @rule()
    def lifecycle(self) -> None:
        ended = sorted(
            (item.lease_deadline, 0, seq) for seq, item in self.items.items() if 0 < item.lease_deadline <= self.now
        )
        cycle = self._run(lambda c, t: c.lifecycle(t, ended))
        dropped: list[str] = []
        for _deadline, _p, seq in ended:
            item = self.items.pop(seq)
            item.lease_deadline = 0
            if self._dying(item):
                dropped.append(item_id(1, 0, seq))
            else:
                self.items[self.next_seq] = item  # put back at the tail under a new id
                self.next_seq += 1
        for seq in sorted(self.items):
            item = self.items[seq]
            if not item.lease_deadline and item.expire <= self.now:
                dropped.append(item_id(1, 0, seq))
                del self.items[seq]
        assert sorted(text for text, _reason, _error in cycle.dropped) == sorted(dropped)  # type: ignore[attr-defined]

    @rule()
    def restart(self) -> None:
        before = self.views[0]
        self.views = load(self.store).views
        after = self.views[0]
        assert (after.ready, after.leased, after.created_sum, after.leased_at_sum) == (
            before.ready,
            before.leased,
            before.created_sum,
            before.leased_at_sum,
        )
        assert after.leases.records == before.leases.records
        assert after.ready_hint <= min((seq for seq, item in self.items.items() if not item.lease_deadline), default=1 << 62)

    @rule(seconds=st.integers(1, 40))
    def tick(self, seconds: int) -> None:
        self.now += seconds * SECOND

    # -- what must hold after every step ------------------------------------------------

    @invariant()
    def storage_agrees(self) -> None:
        seqs, indexed, _entries = stored_keys(self.store)
        assert seqs == set(self.items)
        assert indexed == {seq: item.expire for seq, item in self.items.items()}
        with self.store.env.begin() as txn:
            records = lease_records.read_all(txn, self.store.db(0))
            held = {seq: record for record in records for seq in record.seqs()}
            for seq, item in self.items.items():
                stored = Item.decode(txn.get(item_key(seq), db=self.store.db(0)))
                record = held.get(seq)
                if record is not None:  # read as the record written out
                    assert not stored.is_leased and not stored.kind and stored.expiry_run
                    stored.is_leased, stored.attempts, stored.lease_deadline = True, stored.attempts + 1, record.deadline
                assert (stored.payload, stored.attempts, stored.is_leased) == (
                    item.payload,
                    item.attempts,
                    bool(item.lease_deadline),
                )
                if item.lease_deadline:
                    assert stored.lease_deadline == item.lease_deadline
        v = self.views[0]
        assert v.leases.records == {record.first: record for record in records}
        assert v.leases.held == {seq: record.first for seq, record in held.items()}
        leased = sum(1 for item in self.items.values() if item.lease_deadline)
        assert (v.ready, v.leased) == (len(self.items) - leased, leased)


def _runs(examples: int) -> settings:
    return settings(
        max_examples=examples,
        stateful_step_count=50,
        deadline=None,
        derandomize=True,
        suppress_health_check=[HealthCheck.too_slow],
    )


QueueModel.TestCase.settings = _runs(80)
test_queue_against_its_model = QueueModel.TestCase


class GroupedQueueModel(QueueModel):
    """The same queue in a commit group's shared environment, beside a neighbour
    whose items must stay as they are."""

    def __init__(self) -> None:
        super().__init__()
        self.store.close()
        self.env = open_group_env(self.dir + "/g", map_size=1 << 24, sync=False)
        self.neighbour = QueueStore(self.dir + "/g", 1, shared=self.env, prefix=queue_prefix(2))
        self.neighbour.write(lambda txn: [txn.put(item_key(seq), b"theirs", db=self.neighbour.db(0)) for seq in (1, 2)])
        self.store = QueueStore(self.dir + "/g", 1, shared=self.env, prefix=queue_prefix(1))

    def teardown(self) -> None:
        self.env.close()
        shutil.rmtree(self.dir, ignore_errors=True)

    @invariant()
    def neighbour_untouched(self) -> None:
        with self.env.begin() as txn:
            assert dict(txn.cursor(db=self.neighbour.db(0))) == {item_key(1): b"theirs", item_key(2): b"theirs"}


GroupedQueueModel.TestCase.settings = _runs(30)
test_grouped_queue_against_its_model = GroupedQueueModel.TestCase
