"""Spark connector: read and write Querator queues with Spark's Python Data Source API.

Needs ``pip install 'querator-client[spark]'`` (PySpark >= 4.2 and pyarrow). Register the
data source once per session, then use the short name ``querator``::

    import querator.spark

    querator.spark.register(spark)
    df.write.format("querator").option("queue", "jobs").mode("append").save()
    items = spark.read.format("querator").option("queue", "jobs").load()          # snapshot
    stream = spark.readStream.format("querator").option("queue", "jobs").load()   # leases

See docs/spark.md for the modes, the delivery guarantees and tuning.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

try:
    import pyarrow  # type: ignore[import-untyped,unused-ignore]  # noqa: F401
    import pyspark  # noqa: F401
except ModuleNotFoundError as exc:  # only the extra's own packages get the hint
    if exc.name not in ("pyarrow", "pyspark"):
        raise
    raise ImportError(
        f"querator.spark needs {exc.name}, which is not installed: pip install 'querator-client[spark]'"
    ) from exc

from ._options import OptionError
from ._schema import READ_SCHEMA
from ._source import QueratorDataSource

if TYPE_CHECKING:
    from pyspark.sql import SparkSession

#: The short name to pass to ``format()``.
FORMAT = QueratorDataSource.name()


def register(spark: SparkSession) -> None:
    """Make ``format("querator")`` available in ``spark`` (once per session is enough)."""
    spark.dataSource.register(QueratorDataSource)


__all__ = ["FORMAT", "READ_SCHEMA", "OptionError", "QueratorDataSource", "register"]
