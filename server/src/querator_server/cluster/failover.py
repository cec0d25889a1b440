"""Failover of one shard: fence the old epoch on the in-sync copies, gather their
positions, and elect the most advanced through the shard record's compare-and-swap.

Run by every live copy that may take over once the primary's membership lapsed (the
one its ISR entry names, or one that primary rebuilt from a snapshot before etcd
recorded its new incarnation: ``replica_contract.why_not_electable``), and by a primary
that finds itself ineligible, its data lost, on behalf of the others. Each first promises, on itself and on every other
in-sync copy it reaches, to refuse epoch ``e`` (``fence(e + 1)``), so the positions it
gathers cannot grow behind its back: the old primary, paused or cut off, can have no
further change acked. Every acknowledged change is on every in-sync copy, so any of
them would lose nothing acknowledged; the most advanced (ties: the lowest node id) is
chosen so as to keep what it can of the rest and leave the others prefixes of it. Only
one ``elect`` can win the CAS; the others see the new record in the catalog.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from dataclasses import dataclass

from google.protobuf.wrappers_pb2 import BytesValue

from ..errors import FailedPrecondition, QueratorError
from ..logging import get_logger
from .etcd import EtcdError
from .forwarding import Peers
from .replica_contract import why_not_electable
from .replica_host import Shard
from .replica_wire import STATUS, CopyState, StatusAsk
from .shard_record import ShardRecord
from .shard_table import ShardTable

log = get_logger("cluster")

SERVICE = "querator.internal.Peer"
# How long a candidate waits for another copy's position: a copy that does not answer
# in time is left out of the new in-sync set (it catches up and is added back).
_GATHER_S = 2.0


@dataclass(frozen=True, slots=True)
class Candidate:
    node: str
    incarnation: str
    epoch: int
    lsn: int

    @property
    def rank(self) -> tuple[int, int, str]:
        # Higher position first; among equals the lowest node id (negated for max()).
        return (self.epoch, self.lsn, "".join(chr(0x10FFFF - ord(c)) for c in self.node))


@dataclass(frozen=True, slots=True)
class Promoted:
    """A copy out of the in-sync set made primary by a retire (``promote_behind``)."""

    queue: str
    node: str
    epoch: int  # its position: every change acknowledged after it is lost
    lsn: int
    new_epoch: int


async def ask(peers: Peers, node: str, uid: int, fence: int, timeout: float = _GATHER_S) -> CopyState:
    reply = await peers.forward(
        node, f"/{SERVICE}/{STATUS}", BytesValue(value=StatusAsk(uid, fence).encode()), BytesValue, None, timeout
    )
    return CopyState.decode(reply.value)


async def why_blocked(
    record: ShardRecord, node: str, shards: dict[int, Shard], peers: Peers, live: Callable[[str], bool]
) -> str:
    """Why no live copy can take over from ``record``'s primary, asked of each live
    copy (``node``: this node, whose copy is read here): "" while the primary is live or
    some live copy may (``why_not_electable``). For an operator: the election itself
    runs on the copies' nodes (replica_roles.py), which log the same reasons."""
    if live(record.primary):
        return ""
    others = [n for n in record.replicas if n != record.primary]
    copies = [n for n in others if live(n)]
    if not copies:
        gone = ", ".join(others)
        return f"no copy is live (copies on {gone})" if others else "the queue has no other copy"

    async def state(copy: str) -> CopyState:
        if copy == node:
            shard = shards.get(record.uid)
            if shard is None:
                raise QueratorError(f"this node holds no copy of shard {record.uid} (yet)")
            return shard.state()
        return await ask(peers, copy, record.uid, 0)

    answers = await asyncio.gather(*(state(n) for n in copies), return_exceptions=True)
    reasons: list[str] = []
    for copy, answer in zip(copies, answers, strict=True):
        if isinstance(answer, BaseException):
            reasons.append(f"node {copy!r} did not answer: {str(answer)[:120]}")
            continue
        why = why_not_electable(record, copy, answer.incarnation, answer.rebuilt)
        if not why:
            return ""  # it may take over: a failover is under way
        reasons.append(why)
    down = [n for n in others if n not in copies]
    if down:
        reasons.append(f"not live: {', '.join(down)}")
    return "; ".join(reasons)


async def promote_behind(
    record: ShardRecord,
    leaving: str,
    node: str,
    shards: dict[int, Shard],
    table: ShardTable,
    peers: Peers,
    live: Callable[[str], bool],
) -> tuple[ShardRecord, Promoted]:
    """Elect the most advanced live copy of ``record``'s queue other than ``leaving``'s
    although none is in the in-sync set: ``leaving`` (dead, being retired) held the
    only in-sync copy, so every change it acknowledged after that copy's position is
    lost. An operator's explicit choice (a retire with promote_copies_behind), never a
    failover's. Each copy is fenced at the new epoch first, as an election fences, so
    the positions compared cannot move. The new record and the promoted copy; raises
    FailedPrecondition when no live copy holds anything."""
    fence = record.epoch + 1
    copies = [n for n in record.replicas if n != leaving and live(n)]

    async def state(copy: str) -> CopyState:
        if copy == node:
            shard = shards.get(record.uid)
            if shard is None:
                raise QueratorError(f"this node holds no copy of shard {record.uid} (yet)")
            async with shard.lock:
                if shard.copy.fenced_epoch() < fence:
                    await shard.copy.fence(fence)
            return shard.state()
        return await ask(peers, copy, record.uid, fence)

    answers = await asyncio.gather(*(state(n) for n in copies), return_exceptions=True)
    candidates: list[Candidate] = []
    left_out: list[str] = [f"{n}: not live" for n in record.replicas if n != leaving and n not in copies]
    for copy, answer in zip(copies, answers, strict=True):
        if isinstance(answer, BaseException):
            left_out.append(f"{copy}: did not answer ({str(answer)[:120]})")
        elif answer.primary:
            left_out.append(f"{copy}: serves the queue as primary already")
        elif not answer.incarnation or answer.lsn <= 0:
            # Empty, or half-way through installing a snapshot (its position is 0 then).
            left_out.append(f"{copy}: holds nothing")
        else:
            candidates.append(Candidate(copy, answer.incarnation, answer.epoch, answer.lsn))
    if not candidates:
        raise FailedPrecondition(
            f"queue {record.queue!r}: node {leaving!r} held its only in-sync copy and no other copy can be promoted "
            f"({'; '.join(left_out) or 'it has no other copy'}); nothing was retired (bring the node back, or delete the queue)"
        )
    best = max(candidates, key=lambda c: c.rank)
    try:
        elected = await table.elect(record, best.node, [(best.node, best.incarnation)], primary_gone=True)
    except (EtcdError, QueratorError) as exc:
        raise FailedPrecondition(f"queue {record.queue!r} changed meanwhile ({str(exc)[:200]}); retry") from None
    log.error(
        "shard_promoted_behind",
        uid=record.uid,
        queue=record.queue,
        old_primary=leaving,
        primary=best.node,
        epoch=elected.epoch,
        position=[best.epoch, best.lsn],
        detail="the retired node held the only in-sync copy: changes it acknowledged after this position are lost",
    )
    return elected, Promoted(record.queue, best.node, best.epoch, best.lsn, elected.epoch)


async def run(
    node: str,
    record: ShardRecord,
    shard: Shard,
    table: ShardTable,
    deposed_error: type[Exception],
    peers: Peers,
    live: Callable[[str], bool],
    include_self: bool = True,
) -> ShardRecord | None:
    """One attempt: the record this node's ``elect`` wrote (this node or another chosen
    by it is the new primary), or None when it did not elect (another candidate is more
    advanced, or its CAS lost: the catalog watch brings the outcome)."""
    fence = record.epoch + 1
    candidates: list[Candidate] = []
    if include_self:
        async with shard.lock:
            if shard.copy.fenced_epoch() < fence:
                await shard.copy.fence(fence)
        position = shard.copy.position()
        candidates.append(Candidate(node, shard.copy.incarnation, position.epoch, position.lsn))
    others = [n for n, _ in record.isr if n not in (node, record.primary) and live(n)]
    answers = await asyncio.gather(*(ask(peers, n, record.uid, fence) for n in others), return_exceptions=True)
    left_out: dict[str, str] = {n: "not live" for n, _ in record.isr if n not in (node, record.primary) and not live(n)}
    for other, answer in zip(others, answers, strict=True):
        if isinstance(answer, BaseException):
            if not isinstance(answer, QueratorError):
                log.warning("failover_ask_failed", uid=record.uid, node=other, error=repr(answer)[:200])
            left_out[other] = f"did not answer: {str(answer)[:120]}"
            continue
        if answer.primary:
            left_out[other] = "took over meanwhile"
            continue
        why = why_not_electable(record, other, answer.incarnation, answer.rebuilt)
        if why:
            left_out[other] = why  # wiped, half-rebuilt: it may lack an acknowledged change
            continue
        candidates.append(Candidate(other, answer.incarnation, answer.epoch, answer.lsn))
    if not candidates:
        log.error(
            "failover_no_copy",
            uid=record.uid,
            queue=record.queue,
            primary=record.primary,
            epoch=record.epoch,
            left_out=left_out,
            detail="no live copy holds every acknowledged change: the queue waits for one (its primary, or an in-sync copy)",
        )
        return None
    best = max(candidates, key=lambda c: c.rank)
    if include_self and best.node != node:
        return None  # the more advanced one elects itself; the watch brings its record
    isr = [(best.node, best.incarnation)] + [(c.node, c.incarnation) for c in candidates if c.node != best.node]
    try:
        # Taking over from another node: only while it is still gone (its membership
        # lapsed), so its acknowledgements under the old epoch have surely ended.
        elected = await table.elect(record, best.node, isr, primary_gone=record.primary != node)
    except EtcdError as exc:
        log.warning("failover_elect_failed", uid=record.uid, error=str(exc)[:200])
        return None
    except deposed_error as exc:  # the CAS lost: another candidate won, or the record moved on
        log.info("failover_elect_lost", uid=record.uid, node=node, error=str(exc)[:200])
        return None
    log.warning(
        "shard_failover",
        uid=record.uid,
        queue=record.queue,
        old_primary=record.primary,
        primary=best.node,
        epoch=elected.epoch,
        lsn=best.lsn,
        isr=[c.node for c in candidates],
    )
    return elected
