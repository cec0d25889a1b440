"""A Spark driver that streams a queue into a file, for the kill -9 test.

    python stream_driver.py ADDRESS QUEUE CHECKPOINT SINK_DIR MAX_ITEMS STALL_AT_BATCH [OPTION=VALUE ...]

Each micro-batch writes its payloads to SINK_DIR/batch-<id>-<n>.txt (the "sink"); at
batch STALL_AT_BATCH it writes the sink file, then SINK_DIR/stalled and sleeps, so the
test can kill the driver in the middle of that batch. Further OPTION=VALUE arguments
are passed to the reader as options.
"""

from __future__ import annotations

import os
import sys
import time
from typing import Any

from spark_helpers import build_session


def main() -> None:
    address, queue, checkpoint, sink, max_items, stall_at = sys.argv[1:7]
    options = dict(arg.split("=", 1) for arg in sys.argv[7:])
    spark = build_session("local[2]", app="querator-killed-driver")

    def sink_batch(df: Any, batch_id: int) -> None:
        payloads = [r.payload.decode() for r in df.select("payload").collect()]
        path = os.path.join(sink, f"batch-{batch_id}-{time.monotonic_ns()}.txt")
        with open(path, "w") as f:
            f.write("\n".join(payloads))
        if batch_id == int(stall_at):
            with open(os.path.join(sink, "stalled"), "w") as f:
                f.write(str(os.getpid()))
            time.sleep(600)

    query = (
        spark.readStream.format("querator")
        .option("address", address)
        .option("queue", queue)
        .option("maxItemsPerTrigger", max_items)
        .options(**options)
        .load()
        .writeStream.foreachBatch(sink_batch)
        .option("checkpointLocation", checkpoint)
        .trigger(availableNow=True)
        .start()
    )
    query.awaitTermination()


if __name__ == "__main__":
    main()
