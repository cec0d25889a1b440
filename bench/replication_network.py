"""Replicated queues under flapping network faults: the long mode of
server/tests/test_replication_network_faults.py (issue 28, case 6).

An etcd and three ``querator serve --cluster`` nodes (``--cluster-lease-ttl 2``) whose
every node-to-node and node-to-etcd connection goes through a loopback proxy of its own
(server/tests/network_chaos.py). Under the audit's recorded load (plain stubs, every call
recorded), one node's links at a time (the primary's more often than not; etcd only,
peers only or both) are cut, blackholed, broken one way or delayed, for 0.5-3.5 s, then
restored for as long, over ``--seconds``. Then every link is restored, the copies come
back in sync, the queue is drained, and:

- the history checker (bench/history.py) must find nothing lost, nothing delivered after
  its Complete was acknowledged, nothing resurrected or unexplained;
- at most one epoch's primary acknowledged at a time: every cycle a primary answered is
  logged by its node with its epoch, and each epoch's acknowledgements (one node only)
  end before the next epoch's begin (the smallest gap between them is printed);
- the in-sync copies' digests are equal.

    .venv/bin/python bench/replication_network.py --seconds 60 --seed 1
    .venv/bin/python bench/replication_network.py --seconds 300 --seed 7 --replicas 2

Exit status 1 when any check fails. The seed fixes the fault schedule, not the threads'
timing.
"""

from __future__ import annotations

import argparse
import os
import shutil
import sys
import tempfile
import time

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path[:0] = [HERE, os.path.join(os.path.dirname(HERE), "server", "tests")]

from test_replication_network_faults import flap_run  # noqa: E402


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--seconds", type=float, default=60.0, help="how long the faults flap (default 60)")
    parser.add_argument("--seed", type=int, default=1)
    parser.add_argument("--replicas", type=int, default=3, choices=(2, 3))
    parser.add_argument("--keep", action="store_true", help="keep the data directories (printed)")
    args = parser.parse_args(argv)
    root = tempfile.mkdtemp(prefix="querator-network-")
    started = time.monotonic()
    try:
        figures = flap_run(root, args.seconds, args.seed, args.replicas)
    except AssertionError as exc:
        print(f"FAILED after {time.monotonic() - started:.0f} s (seed {args.seed}):\n{exc}")
        return 1
    finally:
        if args.keep:
            print(f"data directories: {root}")
        else:
            shutil.rmtree(root, ignore_errors=True)
    print(f"## Network faults, R = {args.replicas}, {args.seconds:g} s of flapping, seed {args.seed}\n")
    print(f"- faults: {figures['faults']} ({figures['fault_kinds']})")
    print(f"- epochs that acknowledged (epoch, node, cycles, answers): {figures['epochs']}")
    print(f"- acknowledged cycles: {figures['acknowledged_cycles']}; acknowledged Produce calls: {figures['acknowledged_produces']}")
    print(f"- gap between one epoch's last acknowledgement and the next one's first: {figures['gaps_s']} s")
    print(f"- checker: {figures['verdict']}")
    print(f"- wall time: {time.monotonic() - started:.0f} s\n")
    print("fault schedule:")
    for line in figures["log"]:  # type: ignore[attr-defined]
        print(f"    {line}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
