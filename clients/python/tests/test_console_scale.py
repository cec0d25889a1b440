"""The console with 10,000 queues and 1,000,000 items: every page reads one page of the
listing it shows, so each is drawn from a bounded number of calls. The times are
printed (run with -s), never asserted; what is asserted is that each page shows one
page's worth, and that the queues page's "next" walks the whole list."""

from __future__ import annotations

import asyncio
import os
import re
import time

import pytest

pytest.importorskip("starlette", reason="the console extra (querator-client[console]) is not installed")

from console_helpers import Visitor, console  # noqa: E402

import querator  # noqa: E402
from querator.testing import server  # noqa: E402

# The scale with QUERATOR_CONSOLE_SCALE=full (the figures in docs/console.md:
# about 60-90 s on 2 cores). The test suite runs a fifth of it: 41 pages of queues and
# 200,000 items still check that every page reads one page of its listing.
FULL = os.environ.get("QUERATOR_CONSOLE_SCALE") == "full"
QUEUES = 10_000 if FULL else 2_000
ITEMS = 1_000_000 if FULL else 200_000


async def _fill(address: str) -> tuple[float, float]:
    async with querator.AsyncClient(address) as c:
        started = time.monotonic()
        limit = asyncio.Semaphore(64)

        async def create(i: int) -> None:
            async with limit:
                # Every tenth queue sends its dead letters to dlq-00000.
                await c.create_queue(f"q-{i:05d}", dead_queue="dlq-00000" if i % 10 == 1 else None)

        await c.create_queue("dlq-00000")
        await asyncio.gather(*(create(i) for i in range(1, QUEUES)))
        queues_s = time.monotonic() - started
        started = time.monotonic()
        await c.create_queue("big", partitions=4)
        payload = b'{"n": 1, "text": "a small json payload"}'
        await c.produce("big", (payload for _ in range(ITEMS)), max_in_flight=8)
        return queues_s, time.monotonic() - started


def _timed(v: Visitor, path: str) -> tuple[float, str]:
    started = time.perf_counter()
    reply = v.get(path)
    elapsed = (time.perf_counter() - started) * 1000
    assert reply.status == 200, (path, reply.text[:500])
    return elapsed, reply.text


@pytest.mark.timeout(400)
def test_pages_with_many_queues_and_items_each_read_one_page() -> None:
    with server() as srv:
        queues_s, items_s = asyncio.run(_fill(srv.address))
        print(f"\nmade {QUEUES} queues in {queues_s:.1f} s, {ITEMS} items in {items_s:.1f} s")
        with console(srv.address) as url:
            v = Visitor(url)
            times: dict[str, float] = {}
            times["queues, first page"], first = _timed(v, "/")
            assert first.count("<tr data-queue=") == 50
            # Walk every page by its "next" link: QUEUES + 1 queues, 50 a page.
            path, pages, walk = "/", 0, time.perf_counter()
            names: set[str] = set()
            while True:
                elapsed, text = _timed(v, path)
                pages += 1
                names.update(re.findall(r'<tr data-queue="([^"]+)"', text))
                match = re.search(r'id="next" href="([^"]+)"', text)
                if match is None:
                    break
                path = match.group(1).replace("&amp;", "&")
            times["queues, every page (mean)"] = (time.perf_counter() - walk) * 1000 / pages
            times["queues, last page"] = elapsed
            assert len(names) == QUEUES + 1 and pages == (QUEUES + 1 + 49) // 50
            times["queues, first page again (sampled)"], _ = _timed(v, "/")
            times["queue big"], text = _timed(v, "/q/big")
            assert int(re.findall(r'id="count-ready">(\d+)<', text)[0]) == ITEMS
            times["items of big, first page"], text = _timed(v, "/q/big/items?partition=3")
            assert text.count('class="item"') == 50
            times["items of big, ready filter"], _ = _timed(v, "/q/big/items?state=ready&partition=2")
            times[f"dead-letter view (scans {QUEUES + 1} queues for sources)"], _ = _timed(v, "/q/dlq-00000/dead")
            times[f"cluster ({QUEUES + 1} placements)"], _ = _timed(v, "/cluster")
            for name, ms in times.items():
                print(f"{name:55s} {ms:8.1f} ms")
