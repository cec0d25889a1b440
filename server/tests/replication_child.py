"""A process that serves a replicated queue from node n1's manager, shipping each
change set to node n2's copy, under load until it is killed (tests only).

Every change set is written to ``changes.log`` (length-prefixed) before it is
applied to the copy, so the test can rebuild any position from scratch. Meanwhile a
copy of another queue on n2 is fenced at epoch 1, 2, 3, ..., each written to
``fences.log`` once ``fence`` returned (durable).

Usage: python replication_child.py ROOT
"""

from __future__ import annotations

import asyncio
import os
import struct
import sys

from querator_server.actor import CompleteRequest, LeaseRequest, ProduceRequest
from querator_server.actor.replication import Replication
from querator_server.errors import QueratorError
from querator_server.manager import QueuesManager
from querator_server.model import NewItem, QueueConfig
from querator_server.storage.change_set import ChangeSet
from querator_server.storage.replica_copy import ReplicaCopy

SHARD_UID = (1 << 40) + 5
CONFIG = QueueConfig(name="q", uid=SHARD_UID, partitions=2, lease_timeout_us=300_000, dedup_window_us=500_000)


class Logged(Replication):
    def __init__(self, target: ReplicaCopy, fd: int) -> None:
        self.target = target
        self.fd = fd
        self.order = asyncio.Lock()

    async def replicated(self, change: ChangeSet) -> None:
        data = change.encode()
        os.write(self.fd, struct.pack(">I", len(data)) + data)  # as handed over, in lsn order
        async with self.order:
            await self.target.apply(ChangeSet.decode(data))


async def load(manager: QueuesManager, seed: int) -> None:
    n = 0
    while True:
        actor = manager.actor("q")
        try:
            items = [NewItem(payload=b"%d-%d" % (seed, n + i), idempotency_key=f"k{(n + i) % 50}") for i in range(5)]
            await actor.submit(ProduceRequest(items=items))
            lease = await actor.submit(LeaseRequest(batch_size=4, client_id="", wait_until_us=0, lease_key=f"L{n % 7}"))
            if lease.ids and n % 3:
                await actor.submit(CompleteRequest(partition=lease.partition, ids=lease.ids))
        except QueratorError:
            pass
        n += 5


async def fences(copy: ReplicaCopy, path: str) -> None:
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o600)
    epoch = 0
    while True:
        epoch += 1
        await copy.fence(epoch)
        os.write(fd, b"%d\n" % epoch)


async def main(root: str) -> None:
    m1 = QueuesManager(os.path.join(root, "n1"), workers=2, commit_groups=False)
    m2 = QueuesManager(os.path.join(root, "n2"), workers=2, commit_groups=True)
    await m1.start()
    await m2.start()
    await m1.open_copy(CONFIG)
    c2 = await m2.open_copy(CONFIG)
    fd = os.open(os.path.join(root, "changes.log"), os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o600)
    await m1.promote("q", 1, Logged(c2, fd))
    fenced = await m2.open_copy(CONFIG.replace(name="f", uid=SHARD_UID + 1))
    print("ready", flush=True)
    await asyncio.gather(fences(fenced, os.path.join(root, "fences.log")), *(load(m1, seed) for seed in range(3)))


if __name__ == "__main__":
    asyncio.run(main(sys.argv[1]))
