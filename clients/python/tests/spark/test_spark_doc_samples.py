"""docs/spark.md's samples marked ``<!-- run by the Spark tests ... -->``, run as written.

They run in order, in one SparkSession (a session per sample would cost 7-14 s each),
with the names the page gives them: ``spark`` the session, ``df`` a DataFrame of orders
(an ``order_id`` column among others). The server is a real one; the samples name no
address, so they reach it through ``$QUERATOR_ADDRESS``, the default docs/spark.md
documents for the ``address`` option.
"""

from __future__ import annotations

import json
import os
import re
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from querator.embedded import EmbeddedServer

from spark_helpers import Stubs, session_fixture, srv, stubs  # noqa: F401 - fixtures

SPARK_MD = Path(__file__).resolve().parents[4] / "docs" / "spark.md"
_MARKED = re.compile(r"^<!--\s*run by the Spark tests[^>]*-->\n```python\n(.*?)^```", re.S | re.M)


@pytest.fixture(scope="module")
def address(srv: EmbeddedServer) -> Iterator[str]:  # noqa: F811 - the fixture
    """$QUERATOR_ADDRESS set before the session starts, so its Python workers see it too."""
    before = os.environ.get("QUERATOR_ADDRESS")
    os.environ["QUERATOR_ADDRESS"] = srv.address
    yield srv.address
    if before is None:
        del os.environ["QUERATOR_ADDRESS"]
    else:
        os.environ["QUERATOR_ADDRESS"] = before


_session = session_fixture()


@pytest.fixture(scope="module")
def spark(address: str, _session: Any) -> Any:
    return _session


def test_the_marked_spark_samples_run_in_order(spark: Any, stubs: Stubs, capsys: pytest.CaptureFixture[str]) -> None:  # noqa: F811
    blocks = _MARKED.findall(SPARK_MD.read_text())
    assert len(blocks) == 3, blocks  # register, batch write, snapshot read
    stubs.create("orders")  # the queue the page writes to and reads from
    orders = [("o-1", "alice", 30), ("o-2", "bob", 12), ("o-3", "carol", 7)]
    namespace: dict[str, Any] = {"spark": spark, "df": spark.createDataFrame(orders, ["order_id", "customer", "amount"])}
    for block in blocks:
        exec(compile(block, str(SPARK_MD), "exec"), namespace)  # noqa: S102 - the sample, as written
    stored = stubs.items("orders")
    assert sorted(i.reference for i in stored) == ["o-1", "o-2", "o-3"]
    assert {i.kind for i in stored} == {"order"}
    assert sorted(json.loads(i.payload)["customer"] for i in stored) == ["alice", "bob", "carol"]
    shown = capsys.readouterr().out  # items.groupBy("kind").count().show()
    assert re.search(r"\|\s*order\|\s*3\|", shown), shown
