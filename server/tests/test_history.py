"""The audit's history checker (bench/history.py) on histories written by hand: a clean
history passes, and each rule finds what it is for (and only that)."""

from __future__ import annotations

import itertools

import pytest

from history import (
    ABANDONED,
    AFTER_COMPLETE,
    COMPLETE,
    COMPLETE_REFUSED,
    COMPLETE_UNKNOWN,
    FAILED,
    LEASE,
    LOST,
    NOT_DEDUPLICATED,
    OK,
    PRODUCE,
    RESURRECTED,
    RETRIED,
    RETRY,
    RETRY_UNKNOWN,
    SENT_AGAIN,
    STORED_TWICE,
    UNEXPECTED,
    UNEXPLAINED,
    UNKNOWN,
    WHILE_LEASED,
    Delivery,
    History,
    Verdict,
    calls_by_outcome,
    check,
    outcome_of,
)

TIMEOUT = 2_000_000  # lease timeout, µs
T0 = 1_700_000_000_000_000


class Run:
    """A history built step by step: produce, lease (at a server time), settle."""

    def __init__(self) -> None:
        ticks = itertools.count()
        self.history = History(clock=lambda: float(next(ticks)))
        self.ids = itertools.count(1)

    def produce(self, *keys: str, outcome: str = OK, code: str = "", keyed: bool = False) -> None:
        call = self.history.invoke(PRODUCE, "p", "n1", keys=keys, keyed=keyed)
        self.history.end(call, outcome, code)

    def lease(self, key: str, at_us: int, partition: int = 0, message_id: str = "m1") -> Delivery:
        call = self.history.invoke(LEASE, "c", "n2")
        item = Delivery(key, partition, message_id, f"id{next(self.ids)}", at_us + TIMEOUT)
        (delivery,) = self.history.delivered(call, [item])
        self.history.end(call, OK)
        return delivery

    def settle(self, kind: str, delivery: Delivery, outcome: str = OK, code: str = "") -> None:
        call = self.history.invoke(kind, "c", "n3", deliveries=[delivery])
        if outcome != "pending":
            self.history.end(call, outcome, code)

    def verdict(self) -> Verdict:
        return check(self.history.calls(), TIMEOUT)


def rules(verdict: Verdict) -> list[str]:
    return [f.rule for f in verdict.findings]


def test_a_clean_history_passes_and_is_counted() -> None:
    run = Run()
    run.produce("a", "b")
    run.settle(COMPLETE, run.lease("a", T0))
    run.settle(COMPLETE, run.lease("b", T0))
    verdict = run.verdict()
    assert verdict.ok, verdict.findings
    assert (verdict.keys_sent, verdict.acknowledged, verdict.keys_delivered, verdict.finished) == (2, 2, 2, 2)
    assert not verdict.duplicates
    assert "lost 0" in verdict.figures()


@pytest.mark.parametrize(
    ("code", "outcome"),
    [
        (None, OK),
        ("OK", OK),
        ("INVALID_ARGUMENT", FAILED),
        ("RESOURCE_EXHAUSTED", FAILED),
        ("NOT_FOUND", FAILED),
        ("FAILED_PRECONDITION", FAILED),
        ("UNAVAILABLE", UNKNOWN),
        ("DEADLINE_EXCEEDED", UNKNOWN),
        ("CANCELLED", UNKNOWN),
        ("INTERNAL", UNKNOWN),
        ("UNKNOWN", UNKNOWN),
    ],
)
def test_a_status_code_means_an_outcome(code: str | None, outcome: str) -> None:
    assert outcome_of(code) == outcome


def test_an_acknowledged_item_never_delivered_is_lost() -> None:
    run = Run()
    run.produce("a", "b")
    run.settle(COMPLETE, run.lease("a", T0))
    verdict = run.verdict()
    assert rules(verdict) == [LOST] and verdict.findings[0].key == "b"


def test_an_item_whose_lease_ran_out_and_never_came_back_is_lost() -> None:
    run = Run()
    run.produce("a")
    run.lease("a", T0)  # abandoned; the drain never saw it again
    assert rules(run.verdict()) == [LOST]
    run = Run()
    run.produce("a")
    run.settle(COMPLETE, run.lease("a", T0), FAILED, "NOT_FOUND")  # refused: not completed
    assert rules(run.verdict()) == [LOST]


def test_a_complete_of_unknown_outcome_finishes_the_item() -> None:
    run = Run()
    run.produce("a", "b")
    run.settle(COMPLETE, run.lease("a", T0), UNKNOWN, "UNAVAILABLE")
    run.settle(COMPLETE, run.lease("b", T0), "pending")  # never ended: unknown
    verdict = run.verdict()
    assert verdict.ok, verdict.findings
    assert verdict.finished == 2


def test_a_produce_of_unknown_outcome_may_or_may_not_be_delivered() -> None:
    run = Run()
    run.produce("a", outcome=UNKNOWN, code="UNAVAILABLE")
    run.produce("b", outcome=UNKNOWN, code="DEADLINE_EXCEEDED")
    run.settle(COMPLETE, run.lease("a", T0))
    verdict = run.verdict()
    assert verdict.ok, verdict.findings
    assert verdict.produce_unknown == 2 and verdict.acknowledged == 0


def test_delivered_again_after_an_acknowledged_complete() -> None:
    run = Run()
    run.produce("a")
    run.settle(COMPLETE, run.lease("a", T0))
    run.settle(COMPLETE, run.lease("a", T0 + 3 * TIMEOUT))
    verdict = run.verdict()
    assert rules(verdict) == [AFTER_COMPLETE], verdict.findings


def test_a_lease_invoked_after_an_acknowledged_complete_that_delivers_the_item_is_a_resurrection() -> None:
    """Read by the clients' clock alone: a new primary after a failover may stamp the
    redelivery with a deadline no later than the completed lease's (its clock is
    behind); the deadline rules then call it a duplicate of an unfinished lease, or
    blame the wrong lease, but the resurrection rule names the Lease that brought it
    back. A redelivery the deadline rule already calls "after complete" is not
    reported twice."""
    for deadline in (T0, T0 - 5 * TIMEOUT):
        run = Run()
        run.produce("a")
        run.settle(COMPLETE, run.lease("a", T0))
        run.settle(COMPLETE, run.lease("a", deadline))  # invoked after the OK above ended
        verdict = run.verdict()
        found = verdict.of(RESURRECTED)
        assert len(found) == 1, verdict.findings
        assert "lease call #4" in found[0].detail and "after Complete call #3" in found[0].detail
        assert "resurrected 1" in verdict.figures()
    run = Run()
    run.produce("a")
    run.settle(COMPLETE, run.lease("a", T0))
    run.settle(COMPLETE, run.lease("a", T0 + 3 * TIMEOUT))
    assert rules(run.verdict()) == [AFTER_COMPLETE]


def test_a_lease_invoked_before_the_complete_was_acknowledged_is_no_resurrection() -> None:
    """Concurrent: the Lease was sent before the Complete's OK arrived, so it may have
    been served first (its lease ran out meanwhile); and a Complete of unknown outcome
    or refused proves nothing."""
    run = Run()
    run.produce("a")
    first = run.lease("a", T0)
    complete = run.history.invoke(COMPLETE, "c", "n3", deliveries=[first])
    second = run.history.invoke(LEASE, "c2", "n2")
    run.history.end(complete, OK)
    (again,) = run.history.delivered(second, [Delivery("a", 0, "m1", "id9", T0 + TIMEOUT)])
    run.history.end(second, OK)
    run.settle(COMPLETE, again)
    assert RESURRECTED not in rules(run.verdict())
    for outcome, code in ((UNKNOWN, "UNAVAILABLE"), (FAILED, "NOT_FOUND")):
        run = Run()
        run.produce("a")
        run.settle(COMPLETE, run.lease("a", T0), outcome, code)
        run.settle(COMPLETE, run.lease("a", T0 + TIMEOUT))
        assert RESURRECTED not in rules(run.verdict())


def test_an_item_nobody_sent_or_whose_produce_failed_is_unexpected() -> None:
    run = Run()
    run.settle(COMPLETE, run.lease("ghost", T0))
    run.produce("refused", outcome=FAILED, code="INVALID_ARGUMENT")
    run.settle(COMPLETE, run.lease("refused", T0))
    run.produce("too-big", outcome=FAILED, code="RESOURCE_EXHAUSTED")  # never delivered: fine
    verdict = run.verdict()
    assert rules(verdict) == [UNEXPECTED, UNEXPECTED]
    assert {f.key for f in verdict.findings} == {"ghost", "refused"}
    assert verdict.produce_failed == 2


@pytest.mark.parametrize(
    ("settle", "cause"),
    [
        (None, ABANDONED),
        ((COMPLETE, FAILED, "NOT_FOUND"), COMPLETE_REFUSED),
        ((COMPLETE, UNKNOWN, "UNAVAILABLE"), COMPLETE_UNKNOWN),
    ],
)
def test_a_redelivery_after_the_lease_ran_out_is_explained_by_its_cause(
    settle: tuple[str, str, str] | None, cause: str
) -> None:
    run = Run()
    run.produce("a")
    first = run.lease("a", T0)
    if settle is not None:
        run.settle(settle[0], first, settle[1], settle[2])
    run.settle(COMPLETE, run.lease("a", T0 + TIMEOUT))  # granted as the first ran out
    verdict = run.verdict()
    assert verdict.ok, verdict.findings
    assert verdict.duplicates == {cause: 1}


@pytest.mark.parametrize(("outcome", "cause"), [(OK, RETRIED), (UNKNOWN, RETRY_UNKNOWN)])
def test_a_retried_item_may_come_back_before_its_lease_would_have_run_out(outcome: str, cause: str) -> None:
    run = Run()
    run.produce("a")
    run.settle(RETRY, run.lease("a", T0), outcome)
    run.settle(COMPLETE, run.lease("a", T0 + 1000))
    verdict = run.verdict()
    assert verdict.ok, verdict.findings
    assert verdict.duplicates == {cause: 1}


def test_leased_again_while_an_earlier_lease_held_it_is_unexplained() -> None:
    run = Run()
    run.produce("a")
    run.lease("a", T0)
    run.settle(COMPLETE, run.lease("a", T0 + TIMEOUT - 1))  # 1 µs before the first ran out
    verdict = run.verdict()
    assert rules(verdict) == [UNEXPLAINED] and WHILE_LEASED in verdict.findings[0].detail
    run = Run()  # a refused Retry does not give it back either
    run.produce("a")
    run.settle(RETRY, run.lease("a", T0), FAILED, "NOT_FOUND")
    run.settle(COMPLETE, run.lease("a", T0 + 1000))
    assert rules(run.verdict()) == [UNEXPLAINED]


def test_two_copies_need_two_sends_one_of_unknown_outcome() -> None:
    run = Run()
    run.produce("a")
    run.settle(COMPLETE, run.lease("a", T0, partition=0, message_id="m1"))
    run.settle(COMPLETE, run.lease("a", T0, partition=1, message_id="m1"))  # same id, other partition: a copy
    verdict = run.verdict()
    assert rules(verdict) == [UNEXPLAINED] and STORED_TWICE in verdict.findings[0].detail
    run = Run()
    run.produce("a", outcome=UNKNOWN, code="UNAVAILABLE")
    run.produce("a")  # sent again after the unknown outcome
    run.settle(COMPLETE, run.lease("a", T0, partition=0, message_id="m1"))
    run.settle(COMPLETE, run.lease("a", T0, partition=1, message_id="m7"))
    verdict = run.verdict()
    assert verdict.ok, verdict.findings
    assert verdict.duplicates == {SENT_AGAIN: 1} and verdict.finished == 2


def test_an_idempotency_key_allows_one_copy_however_often_it_is_sent() -> None:
    run = Run()
    run.produce("a", outcome=UNKNOWN, code="UNAVAILABLE", keyed=True)
    run.produce("a", keyed=True)
    run.settle(COMPLETE, run.lease("a", T0, partition=0, message_id="m1"))
    assert run.verdict().ok  # one copy: deduplicated
    assert (run.verdict().sent_again, run.verdict().sent_again_keyed) == (1, 1)
    run.settle(COMPLETE, run.lease("a", T0, partition=1, message_id="m7"))
    verdict = run.verdict()
    assert rules(verdict) == [UNEXPLAINED] and NOT_DEDUPLICATED in verdict.findings[0].detail
    assert "(keyed)" in run.history.story("a")[0]


def test_each_copy_must_be_finished() -> None:
    run = Run()
    run.produce("a", outcome=UNKNOWN, code="UNAVAILABLE")
    run.produce("a")
    run.settle(COMPLETE, run.lease("a", T0, partition=0, message_id="m1"))
    run.lease("a", T0, partition=1, message_id="m2")  # stored, delivered, then gone
    verdict = run.verdict()
    assert rules(verdict) == [LOST] and "(1, 'm2')" in verdict.findings[0].detail


def test_the_story_of_an_item_and_the_calls_by_outcome() -> None:
    run = Run()
    run.produce("a", outcome=UNKNOWN, code="UNAVAILABLE")
    run.produce("a")
    run.settle(COMPLETE, run.lease("a", T0, message_id="m9"), FAILED, "NOT_FOUND")
    story = run.history.story("a")
    assert len(story) == 4
    assert "produce" in story[0] and "unknown UNAVAILABLE" in story[0]
    assert "lease" in story[2] and "message m9" in story[2] and f"deadline {T0 + TIMEOUT}" in story[2]
    assert "complete" in story[3] and "failed NOT_FOUND" in story[3]
    counts = calls_by_outcome(run.history.calls())
    assert counts[PRODUCE] == {"unknown UNAVAILABLE": 1, "ok": 1} and counts[COMPLETE] == {"failed NOT_FOUND": 1}
