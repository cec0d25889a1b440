"""docs/spark.md's samples marked ``<!-- run by the Spark tests ... -->``, run as written.

They run in order, in one SparkSession (a session per sample would cost 7-14 s each),
with the names the page gives them: ``spark`` the session, ``df`` a DataFrame of orders
(an ``order_id`` column among others), ``events`` a streaming DataFrame with a
``payload`` column. A streaming sample's query is stopped once its effect is seen
(items in the queue, rows in the parquet output). The server is a real one; the samples name no
address, so they reach it through ``$QUERATOR_ADDRESS``, the default docs/spark.md
documents for the ``address`` option.
"""

from __future__ import annotations

import json
import os
import re
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pyarrow.parquet as pq
import pytest

from querator.embedded import EmbeddedServer

from spark_helpers import Stubs, session_fixture, srv, stubs  # noqa: F401 - fixtures

SPARK_MD = Path(__file__).resolve().parents[4] / "docs" / "spark.md"
_MARKED = re.compile(r"^<!--\s*run by the Spark tests[^>]*-->\n```python\n(.*?)^```", re.S | re.M)


@pytest.fixture(scope="module")
def address(srv: EmbeddedServer, tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:  # noqa: F811
    """$QUERATOR_ADDRESS and the working directory, set before the session starts.

    The JVM resolves the samples' relative checkpoints/ and data/ against the directory
    it started in, and its Python workers inherit the environment.
    """
    before, cwd = os.environ.get("QUERATOR_ADDRESS"), os.getcwd()
    os.environ["QUERATOR_ADDRESS"] = srv.address
    os.chdir(tmp_path_factory.mktemp("spark-samples"))
    yield srv.address
    os.chdir(cwd)
    if before is None:
        del os.environ["QUERATOR_ADDRESS"]
    else:
        os.environ["QUERATOR_ADDRESS"] = before


_session = session_fixture()


@pytest.fixture(scope="module")
def spark(address: str, _session: Any) -> Any:
    return _session


def test_the_marked_spark_samples_run_in_order(
    spark: Any,
    stubs: Stubs,  # noqa: F811
    capsys: pytest.CaptureFixture[str],
) -> None:
    blocks = _MARKED.findall(SPARK_MD.read_text())
    assert len(blocks) == 5, blocks  # register, batch write, streaming write, snapshot read, streaming read
    stubs.create("orders")  # the queues the page writes to and reads from
    stubs.create("events")
    orders = [("o-1", "alice", 30), ("o-2", "bob", 12), ("o-3", "carol", 7)]
    parquet = Path.cwd() / "data" / "orders"  # where the streaming read's sample writes
    namespace: dict[str, Any] = {
        "spark": spark,
        "df": spark.createDataFrame(orders, ["order_id", "customer", "amount"]),
        "events": spark.readStream.format("rate").option("rowsPerSecond", 2).load().selectExpr("'event ' || value as payload"),
    }
    for block in blocks:
        exec(compile(block, str(SPARK_MD), "exec"), namespace)  # noqa: S102 - the sample, as written
        if ".start()" in block:  # a streaming query: let it do its work, then stop it
            query = namespace.pop("query")
            try:
                if "events" in block:
                    _wait(lambda: len(stubs.items("events")) >= 2, query, "2 items in events")
                else:
                    _wait(lambda: parquet.exists() and len(pq.read_table(parquet)) >= 3, query, "3 rows in data/orders")
            finally:
                query.stop()
            assert query.exception() is None, query.exception()
        if "write.format" in block:  # the batch write
            stored = stubs.items("orders")
            assert sorted(i.reference for i in stored) == ["o-1", "o-2", "o-3"]
            assert {i.kind for i in stored} == {"order"}
            assert sorted(json.loads(i.payload)["customer"] for i in stored) == ["alice", "bob", "carol"]
    assert sorted(stubs.payloads("events"))[:2] == [b"event 0", b"event 1"]
    shown = capsys.readouterr().out  # items.groupBy("kind").count().show()
    assert re.search(r"\|\s*order\|\s*3\|", shown), shown
    written = spark.read.parquet(str(parquet))
    assert sorted(json.loads(r.payload)["customer"] for r in written.collect()) == ["alice", "bob", "carol"]


def _wait(done: Callable[[], bool], query: Any, what: str) -> None:
    deadline = time.monotonic() + 120
    while not done():
        assert query.isActive, query.exception()
        assert time.monotonic() < deadline, f"not {what} within 120 s; last progress: {query.lastProgress}"
        time.sleep(0.5)
