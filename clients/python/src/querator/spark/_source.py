"""The data source Spark looks up as ``format("querator")``."""

from __future__ import annotations

from pyspark.sql.datasource import (
    DataSource,
    DataSourceReader,
    DataSourceStreamReader,
    DataSourceStreamWriter,
    DataSourceWriter,
)
from pyspark.sql.types import StructType

from ._options import OptionError, Options, ReadOptions, WriteOptions
from ._reader import QueratorStreamReader, SnapshotReader
from ._schema import READ_SCHEMA
from ._writer import QueratorStreamWriter, QueratorWriter


class QueratorDataSource(DataSource):
    """Reads and writes Querator queues: ``spark.read``, ``readStream``, ``write``, ``writeStream``.

    Options (case-insensitive): ``address`` (host:port, default ``$QUERATOR_ADDRESS`` or
    127.0.0.1:2319), ``queue`` (required), ``token``, ``tls``, ``rootCertificates``,
    ``timeout``, ``retries``; writes: ``batchSize``, ``inFlight``, ``keyColumn``;
    snapshot reads: ``mode`` (``snapshot``), ``pageSize``, ``includeScheduled``; stream
    reads: ``maxItemsPerTrigger``, ``numPartitions``, ``leaseBatchSize``, ``streamId``,
    ``keepAliveInterval``. See docs/spark.md.
    """

    @classmethod
    def name(cls) -> str:
        return "querator"

    def schema(self) -> StructType:
        return READ_SCHEMA

    def reader(self, schema: StructType) -> DataSourceReader:
        return SnapshotReader(ReadOptions.parse(Options(self.options), streaming=False))

    def streamReader(self, schema: StructType) -> DataSourceStreamReader:
        return QueratorStreamReader(ReadOptions.parse(Options(self.options), streaming=True))

    def writer(self, schema: StructType, overwrite: bool) -> DataSourceWriter:
        _append_only(overwrite)
        return QueratorWriter(WriteOptions.parse(Options(self.options)), schema)

    def streamWriter(self, schema: StructType, overwrite: bool) -> DataSourceStreamWriter:
        _append_only(overwrite)
        return QueratorStreamWriter(WriteOptions.parse(Options(self.options)), schema)


def _append_only(overwrite: bool) -> None:
    if overwrite:
        raise OptionError("a queue can only be appended to: use mode('append'), not 'overwrite'")
