"""A history of queue calls made under faults, and the checker that reads it.

Clients record every call when they send it (``invoke``) and when it ends (``end``): OK,
FAILED (a definite error: the server applied nothing) or UNKNOWN (no answer, or an answer
that does not say: it may have been applied). Items are named by a key the producer
chose and carried in the payload, so identity never depends on ids the server issues;
each stored copy of an item by ``(partition, message_id)``, which the server keeps across
redeliveries while the item's ``id`` changes with each. A Lease records what it delivered,
with each lease's deadline (the partition home's clock); a Complete or Retry names the
deliveries it settles.

``check`` reads a finished history (every call ended, the queue drained by consumers that
complete what they get) and finds:

- lost: a key a Produce acknowledged that was never delivered, or a copy that was
  delivered and never finished (no Complete with an OK or unknown outcome);
- delivered after complete: a copy leased again after a lease of it whose Complete was
  acknowledged (a later lease deadline on the same partition);
- resurrected: a copy delivered by a Lease that was invoked after a Complete of that copy
  had been acknowledged (the Complete's OK received first, by the clients' one clock).
  Unlike the rule above it reads no server clock, so it holds across a failover to a
  node whose clock differs: an OK'd Complete lost by the new primary shows here;
- unexpected: a key delivered that no Produce sent, or whose every Produce failed;
- duplicates (every delivery of a key beyond its first), explained by their cause: the
  previous lease ran out before it was completed (abandoned, its Complete refused, or of
  unknown outcome), it was retried, or an unknown Produce was sent again; or unexplained:
  leased again while an earlier lease still held it, stored more often than sent, or
  stored twice although every send carried the key as its idempotency key (within the
  queue's dedup window, which the run must not outlast).

Pure: no I/O, no gRPC. The audit run (``audit.py``) feeds it; its tests are
server/tests/test_history.py.
"""

from __future__ import annotations

import threading
import time
from collections import Counter, defaultdict
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field

OK = "ok"
FAILED = "failed"
UNKNOWN = "unknown"
PENDING = "pending"  # never ended: read as unknown

PRODUCE = "produce"
LEASE = "lease"
COMPLETE = "complete"
RETRY = "retry"

# Status codes that say the request was refused before it was applied. Every other
# error (UNAVAILABLE, DEADLINE_EXCEEDED, CANCELLED, a lost connection, INTERNAL, ...)
# leaves the outcome unknown: a node may have applied it and died before answering, or
# a forwarding node may have lost the home's answer.
DEFINITE_ERRORS = frozenset(
    {
        "INVALID_ARGUMENT",
        "NOT_FOUND",
        "ALREADY_EXISTS",
        "FAILED_PRECONDITION",
        "RESOURCE_EXHAUSTED",
        "PERMISSION_DENIED",
        "UNAUTHENTICATED",
        "OUT_OF_RANGE",
        "UNIMPLEMENTED",
    }
)

# Causes of a duplicate delivery.
ABANDONED = "lease ran out (never settled)"
COMPLETE_REFUSED = "lease ran out (its Complete refused)"
COMPLETE_UNKNOWN = "lease ran out (its Complete of unknown outcome)"
RETRY_REFUSED = "lease ran out (its Retry refused)"
RETRIED = "retried"
RETRY_UNKNOWN = "Retry of unknown outcome"
SENT_AGAIN = "stored again (a Produce of unknown outcome sent again)"
# Unexplained ones.
WHILE_LEASED = "leased again while an earlier lease held it"
STORED_TWICE = "stored more often than sent"
NOT_DEDUPLICATED = "stored again although every send carried its idempotency key"


def outcome_of(code: str | None) -> str:
    """OK, FAILED or UNKNOWN for a call that ended with status ``code`` (None or "OK": OK)."""
    if code is None or code == "OK":
        return OK
    return FAILED if code in DEFINITE_ERRORS else UNKNOWN


@dataclass(frozen=True)
class Delivery:
    """One item in one Lease answer."""

    key: str
    partition: int
    message_id: str
    item_id: str
    deadline_us: int
    lease_call: int = 0  # set by History.delivered

    @property
    def copy(self) -> tuple[int, str]:
        return (self.partition, self.message_id)


@dataclass
class Call:
    id: int
    kind: str
    client: str
    node: str
    invoked: float
    keys: tuple[str, ...] = ()
    deliveries: tuple[Delivery, ...] = ()  # Lease: what it delivered; Complete, Retry: what it settles
    outcome: str = PENDING
    code: str = ""
    ended: float = 0.0
    keyed: bool = False  # Produce: each item carried its key as its idempotency_key
    note: str = ""  # what else a reader of the history needs (a lease key, ...)

    def describe(self) -> str:
        took = f"{self.ended - self.invoked:.3f}s" if self.ended else "never ended"
        code = f" {self.code}" if self.code else ""
        kind = f"{self.kind} (keyed)" if self.keyed else self.kind
        note = f" [{self.note}]" if self.note else ""
        return (
            f"#{self.id} {kind}{note} by {self.client} via {self.node or '?'} at {self.invoked:.3f}: "
            f"{self.outcome}{code} ({took})"
        )


class History:
    """Calls as clients saw them. Thread-safe: clients on threads and event loops share one."""

    def __init__(self, clock: Callable[[], float] = time.monotonic) -> None:
        self._clock = clock
        self._lock = threading.Lock()
        self._calls: list[Call] = []

    def _now(self) -> float:
        return self._clock()

    def invoke(
        self,
        kind: str,
        client: str,
        node: str = "",
        *,
        keys: Iterable[str] = (),
        deliveries: Iterable[Delivery] = (),
        keyed: bool = False,
        note: str = "",
    ) -> Call:
        settled = tuple(deliveries)
        with self._lock:
            call = Call(
                len(self._calls) + 1,
                kind,
                client,
                node,
                self._now(),
                tuple(keys) or tuple(d.key for d in settled),
                settled,
                keyed=keyed,
                note=note,
            )
            self._calls.append(call)
        return call

    def delivered(self, call: Call, deliveries: Iterable[Delivery]) -> list[Delivery]:
        """Record what Lease ``call`` delivered; returns the deliveries, tagged with the call."""
        tagged = [
            Delivery(d.key, d.partition, d.message_id, d.item_id, d.deadline_us, lease_call=call.id) for d in deliveries
        ]
        with self._lock:
            call.deliveries = tuple(tagged)
            call.keys = tuple(d.key for d in tagged)
        return tagged

    def end(self, call: Call, outcome: str, code: str = "") -> None:
        with self._lock:
            call.outcome, call.code, call.ended = outcome, code, self._now()

    def ended(self, call: Call, code: str | None) -> str:
        """End ``call`` with the outcome its status ``code`` means; returns that outcome."""
        outcome = outcome_of(code)
        self.end(call, outcome, "" if code in (None, "OK") else str(code))
        return outcome

    def calls(self) -> list[Call]:
        with self._lock:
            return list(self._calls)

    def story(self, key: str) -> list[str]:
        """Every call that named ``key``, in the order they were sent, for a report."""
        lines = []
        for call in self.calls():
            if key not in call.keys:
                continue
            line = call.describe()
            held = [d for d in call.deliveries if d.key == key]
            if held:
                line += "; " + ", ".join(
                    f"partition {d.partition} message {d.message_id} id {d.item_id} deadline {d.deadline_us}" for d in held
                )
            lines.append(line)
        return lines


@dataclass(frozen=True)
class Finding:
    rule: str
    key: str
    detail: str

    def __str__(self) -> str:
        return f"{self.rule}: {self.key}: {self.detail}"


LOST = "lost"
AFTER_COMPLETE = "delivered after its Complete was acknowledged"
RESURRECTED = "resurrected (a Lease invoked after its Complete's OK delivered it)"
UNEXPECTED = "unexpected"
UNEXPLAINED = "unexplained duplicate"


@dataclass
class Verdict:
    keys_sent: int = 0
    acknowledged: int = 0
    produce_unknown: int = 0  # keys with no OK Produce and one of unknown outcome
    produce_failed: int = 0  # keys whose every Produce failed
    sent_again: int = 0  # keys sent more than once (after an unknown outcome)
    sent_again_keyed: int = 0  # of which every send carried the idempotency key
    keys_delivered: int = 0
    deliveries: int = 0
    finished: int = 0  # copies completed with an OK or unknown Complete
    duplicates: Counter[str] = field(default_factory=Counter)  # explained, by cause
    findings: list[Finding] = field(default_factory=list)

    def of(self, rule: str) -> list[Finding]:
        return [f for f in self.findings if f.rule == rule]

    @property
    def ok(self) -> bool:
        return not self.findings

    def figures(self) -> str:
        dup = ", ".join(f"{cause}: {n}" for cause, n in sorted(self.duplicates.items())) or "none"
        return (
            f"items: sent {self.keys_sent}, acknowledged {self.acknowledged}, unknown {self.produce_unknown}, "
            f"failed {self.produce_failed}, sent again {self.sent_again} ({self.sent_again_keyed} keyed); delivered {self.keys_delivered} in {self.deliveries} deliveries, "
            f"{self.finished} copies finished; lost {len(self.of(LOST))}, "
            f"delivered after complete {len(self.of(AFTER_COMPLETE))}, resurrected {len(self.of(RESURRECTED))}, "
            f"unexpected {len(self.of(UNEXPECTED))}, "
            f"unexplained duplicates {len(self.of(UNEXPLAINED))}; explained duplicates: {dup}"
        )


def check(calls: Sequence[Call], lease_timeout_us: int) -> Verdict:
    """The verdict on a finished history whose leases all last ``lease_timeout_us``."""
    produces: dict[str, list[Call]] = defaultdict(list)
    delivered: dict[str, list[Delivery]] = defaultdict(list)
    settled: dict[Delivery, list[Call]] = defaultdict(list)
    by_id = {call.id: call for call in calls}
    for call in calls:
        if call.kind == PRODUCE:
            for key in call.keys:
                produces[key].append(call)
        elif call.kind == LEASE:
            for d in call.deliveries:
                delivered[d.key].append(d)
        elif call.kind in (COMPLETE, RETRY):
            for d in call.deliveries:
                settled[d].append(call)

    def outcome(d: Delivery, kind: str) -> str | None:
        """The best outcome of the ``kind`` calls that settled ``d`` (OK over UNKNOWN over FAILED)."""
        seen = {UNKNOWN if c.outcome == PENDING else c.outcome for c in settled.get(d, []) if c.kind == kind}
        return next((o for o in (OK, UNKNOWN, FAILED) if o in seen), None)

    verdict = Verdict(keys_sent=len(produces))
    for key in sorted(produces.keys() | delivered.keys()):
        sent = produces.get(key, [])
        ok = sum(1 for c in sent if c.outcome == OK)
        maybe = sum(1 for c in sent if c.outcome in (UNKNOWN, PENDING))
        if ok:
            verdict.acknowledged += 1
        elif maybe:
            verdict.produce_unknown += 1
        elif sent:
            verdict.produce_failed += 1
        if len(sent) > 1:
            verdict.sent_again += 1
            verdict.sent_again_keyed += all(c.keyed for c in sent)
        ds = delivered.get(key, [])
        if not ds:
            if ok:
                verdict.findings.append(Finding(LOST, key, f"acknowledged by {ok} Produce, never delivered"))
            continue
        verdict.keys_delivered += 1
        verdict.deliveries += len(ds)
        if not ok and not maybe:
            why = "no Produce sent it" if not sent else f"its {len(sent)} Produce failed ({', '.join(c.code for c in sent)})"
            verdict.findings.append(Finding(UNEXPECTED, key, f"delivered {len(ds)} times; {why}"))
            continue
        copies: dict[tuple[int, str], list[Delivery]] = defaultdict(list)
        for d in ds:
            copies[d.copy].append(d)
        if len(copies) > ok + maybe:
            verdict.findings.append(
                Finding(UNEXPLAINED, key, f"{STORED_TWICE}: {len(copies)} copies {sorted(copies)}, sent {ok + maybe} times")
            )
        elif len(copies) > 1 and all(c.keyed for c in sent):
            verdict.findings.append(
                Finding(UNEXPLAINED, key, f"{NOT_DEDUPLICATED}: {len(copies)} copies {sorted(copies)}")
            )
        elif len(copies) > 1:
            verdict.duplicates[SENT_AGAIN] += len(copies) - 1
        for copy, held in copies.items():
            held.sort(key=lambda d: (d.deadline_us, d.lease_call))
            if any(outcome(d, COMPLETE) in (OK, UNKNOWN) for d in held):
                verdict.finished += 1
            else:
                verdict.findings.append(
                    Finding(LOST, key, f"copy {copy} delivered {len(held)} times, never completed, not delivered again")
                )
            after_complete: set[int] = set()
            for i in range(1, len(held)):
                prev, nxt = held[i - 1], held[i]
                done = [d for d in held[:i] if outcome(d, COMPLETE) == OK and d.deadline_us < nxt.deadline_us]
                if done:
                    after_complete.add(nxt.lease_call)
                    verdict.findings.append(
                        Finding(
                            AFTER_COMPLETE,
                            key,
                            f"copy {copy}: leased (lease call #{nxt.lease_call}, deadline {nxt.deadline_us}) after "
                            f"the lease of call #{done[0].lease_call} (deadline {done[0].deadline_us}) was completed",
                        )
                    )
                    continue
                retried = outcome(prev, RETRY)
                if retried in (OK, UNKNOWN):
                    verdict.duplicates[RETRIED if retried == OK else RETRY_UNKNOWN] += 1
                    continue
                if nxt.deadline_us - lease_timeout_us < prev.deadline_us:
                    verdict.findings.append(
                        Finding(
                            UNEXPLAINED,
                            key,
                            f"{WHILE_LEASED}: copy {copy}, lease call #{nxt.lease_call} (deadline {nxt.deadline_us}) "
                            f"while call #{prev.lease_call}'s lease ran to {prev.deadline_us}",
                        )
                    )
                    continue
                completed = outcome(prev, COMPLETE)
                cause = {None: ABANDONED, FAILED: COMPLETE_REFUSED, UNKNOWN: COMPLETE_UNKNOWN}[completed]
                if completed is None and retried == FAILED:
                    cause = RETRY_REFUSED
                verdict.duplicates[cause] += 1
            _resurrections(verdict, key, copy, held, settled, by_id, after_complete)
    return verdict


def _resurrections(
    verdict: Verdict,
    key: str,
    copy: tuple[int, str],
    held: list[Delivery],
    settled: dict[Delivery, list[Call]],
    by_id: dict[int, Call],
    reported: set[int],
) -> None:
    """Deliveries of ``copy`` by a Lease invoked once a Complete of it had been OK'd (those
    the deadline rule ``reported`` already left out)."""
    completes = [c for d in held for c in settled.get(d, []) if c.kind == COMPLETE and c.outcome == OK]
    if not completes:
        return
    first = min(completes, key=lambda c: c.ended)
    for d in held:
        lease = by_id.get(d.lease_call)
        if lease is None or d.lease_call in reported or lease.invoked <= first.ended:
            continue
        verdict.findings.append(
            Finding(
                RESURRECTED,
                key,
                f"copy {copy}: lease call #{lease.id} invoked at {lease.invoked:.3f} delivered it (id {d.item_id}, "
                f"deadline {d.deadline_us}) after Complete call #{first.id} was acknowledged at {first.ended:.3f}",
            )
        )


def calls_by_outcome(calls: Iterable[Call]) -> dict[str, Counter[str]]:
    """kind -> outcome (with the code of errors) -> number of calls, for the figures."""
    out: dict[str, Counter[str]] = defaultdict(Counter)
    for call in calls:
        out[call.kind][f"{call.outcome} {call.code}".strip()] += 1
    return dict(out)
