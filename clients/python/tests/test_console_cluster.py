"""The console pointed at a real 3-node cluster (a real etcd, node processes): the
cluster page's members, liveness and partitions per node, a queue's home nodes, and
what both show once a node is killed with kill -9."""

from __future__ import annotations

import json
import re
import time
from pathlib import Path

import pytest

pytest.importorskip("starlette", reason="the console extra (querator-client[console]) is not installed")

from cluster_helpers import Cluster  # noqa: E402
from console_helpers import Visitor, console, count, csrf, flash  # noqa: E402

import querator  # noqa: E402

from sdk_helpers import wait_until  # noqa: E402


def _members(html: str) -> dict[str, tuple[str, int]]:
    body = html.split('id="members"')[1].split("<tbody>")[1].split("</tbody>")[0]
    rows = re.findall(r"<tr>(.*?)</tr>", body, re.S)
    out = {}
    for row in rows:
        node = re.search(r"<code>(n\d)</code>", row)
        cells = re.findall(r"<td[^>]*>(.*?)</td>", row, re.S)
        assert node is not None
        live = "live" if ">down<" not in cells[2] else "down"
        out[node.group(1)] = (live, int(cells[4]))
    return out


def test_console_against_a_cluster(tmp_path: Path) -> None:
    with Cluster(str(tmp_path), size=3, ttl=2) as cluster:
        addresses = ",".join(n.address for n in cluster.nodes)
        with querator.Client(addresses) as c:
            c.create_queue("spread-dlq", partitions=3)
            c.create_queue("spread", partitions=3, dead_queue="spread-dlq")
            c.produce("spread", [json.dumps({"n": i}) for i in range(30)])
            dead = c.lease("spread", batch_size=4, wait=5)
            c.retry(dead, dead=True)
            wait_until(lambda: c.queue_stats("spread-dlq").ready == 4)  # the hand-over follows the answer
            homes = c.cluster_info().homes["spread"]
            # Each node counts its partitions' items; any node answers for all of them.
            assert sum(p.produced for p in c.queue_stats("spread").partitions) == 30
        assert sorted(homes) == ["n1", "n2", "n3"]
        with console(addresses) as url:
            v = Visitor(url)
            page = v.get("/cluster")
            members = _members(page.text)
            assert {n: live for n, (live, _) in members.items()} == {"n1": "live", "n2": "live", "n3": "live"}
            assert sum(parts for _, parts in members.values()) == 6  # 3 + 3 partitions
            queue = v.get("/q/spread")
            for p, home in enumerate(homes):
                assert re.search(rf'items\?partition={p}">{p}</a></td>\s*<td>{home}</td>', queue.text), queue.text

            # Redrive all through the cluster: RedriveItems visits each node.
            dl = v.get("/q/spread-dlq")
            assert count(dl.text, "ready") == 4
            moved = v.post("/q/spread-dlq/action/redrive-all", {"csrf": csrf(dl.text), "back": "/q/spread-dlq"})
            assert "Redrove 4 item(s)" in flash(moved.text, "ok") and count(moved.text, "ready") == 0

            victim = next(n for n in cluster.nodes if n.node_id == homes[2])
            victim.kill9()
            deadline = time.monotonic() + 30
            while _members(v.get("/cluster").text)[victim.node_id][0] != "down":
                assert time.monotonic() < deadline, "the killed node still shows live"
                time.sleep(0.5)
            queue = v.get("/q/spread")
            assert re.search(rf"<td>{victim.node_id} <span class=\"bad\">down</span></td>", queue.text)
            assert "faulty</span> since" in queue.text
