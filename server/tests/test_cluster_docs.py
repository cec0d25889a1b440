"""docs/cluster.md, "Try it on a laptop": the etcd command line and the three nodes run as
written (ports moved to free ones), and ``querator cluster status`` prints what the page
shows; then the page's claim about a stopped node."""

from __future__ import annotations

import os
import re
import shlex
import signal
import subprocess
import sys
from pathlib import Path

import grpc
from cluster_helpers import etcd_binary

from conftest import free_port, wait_for_server, wait_until

ROOT = Path(__file__).resolve().parents[2]
PAGE = ROOT / "docs" / "cluster.md"
BIN = Path(sys.executable).parent


def recipe() -> list[list[str]]:
    """The indented blocks of the section, each a list of logical lines."""
    text = PAGE.read_text()
    section = text.split("### Try it on a laptop\n", 1)[1].split("\n### ", 1)[0]
    blocks: list[list[str]] = []
    current: list[str] | None = None
    for line in section.splitlines():
        if line.startswith("    "):
            if current is None:
                current = []
                blocks.append(current)
            current.append(line[4:])
        elif line.strip():
            current = None
    out = []
    for block in blocks:
        joined = re.sub(r"\\\n\s*", "", "\n".join(block))
        out.append(joined.splitlines())
    return out


def test_the_laptop_recipe_runs_as_written(tmp_path: Path) -> None:
    etcd_block, nodes_block, client_block, shown = recipe()
    (etcd_line,) = etcd_block
    assert etcd_line.startswith("etcd ") and len(nodes_block) == 3
    ports = {port: str(free_port()) for port in ("2379", "2380", "2321", "2322", "2323")}

    def local(line: str) -> str:
        for old, new in ports.items():
            line = line.replace(f"127.0.0.1:{old}", f"127.0.0.1:{new}")
        return line

    env = {k: v for k, v in os.environ.items() if not k.startswith("QUERATOR_")}
    env["PATH"] = f"{BIN}{os.pathsep}{env.get('PATH', '')}"
    argv = shlex.split(local(etcd_line))
    argv[0] = etcd_binary()
    procs: dict[str, subprocess.Popen[bytes]] = {}
    logs = tmp_path / "logs"
    logs.mkdir()

    def start(name: str, args: list[str]) -> subprocess.Popen[bytes]:
        with (logs / f"{name}.log").open("ab") as log:
            proc = subprocess.Popen(args, cwd=tmp_path, env=env, stdin=subprocess.DEVNULL, stdout=log, stderr=log)
        procs[name] = proc
        return proc

    def run(line: str) -> subprocess.CompletedProcess[str]:
        return subprocess.run(
            ["bash", "-c", local(line)], cwd=tmp_path, env=env, capture_output=True, text=True, timeout=60, check=False
        )

    try:
        start("etcd", argv)
        etcd_address = f"127.0.0.1:{ports['2379']}"
        with grpc.insecure_channel(etcd_address) as channel:
            grpc.channel_ready_future(channel).result(timeout=30)
        for line in nodes_block:
            args = shlex.split(local(line))
            name = args[args.index("--node-id") + 1]
            proc = start(name, [str(BIN / args[0]), *args[1:]])
            address = args[args.index("--address") + 1]
            wait_for_server(address, proc, 60, lambda name=name: (logs / f"{name}.log").read_text())

        create, status = client_block
        assert run(create).returncode == 0
        shown_status = run(status)
        assert shown_status.returncode == 0, shown_status.stdout + shown_status.stderr
        # The page's output, word by word: the revision varies, the addresses moved.
        expected = [local(line).split() for line in shown]
        actual = [line.split() for line in shown_status.stdout.splitlines()]
        assert len(actual) == len(expected), shown_status.stdout
        for got, want in zip(actual, expected, strict=True):
            if want[:1] == ["cluster:"]:  # "catalog revision 9,"
                at = want.index("revision") + 1
                assert re.fullmatch(r"\d+,", got[at]), shown_status.stdout
                got, want = got[:at] + got[at + 1 :], want[:at] + want[at + 1 :]
            assert got == want, shown_status.stdout

        # "Stop a node with Ctrl-C": LIVE no, its partitions faulty, exit 3.
        procs["n1"].send_signal(signal.SIGINT)
        assert procs["n1"].wait(30) == 0

        def down() -> bool:
            return run(status).returncode == 3

        wait_until(down, timeout=30, interval=0.5)
        stopped = run(status)
        n1 = next(line.split() for line in stopped.stdout.splitlines() if line.startswith("n1 "))
        assert n1[2] == "no" and n1[5] == n1[4] == "2", stopped.stdout
        # "Start it again with the same line".
        args = shlex.split(local(nodes_block[0]))
        proc = start("n1", [str(BIN / args[0]), *args[1:]])
        wait_for_server(args[args.index("--address") + 1], proc, 60, lambda: (logs / "n1.log").read_text())
        wait_until(lambda: run(status).returncode == 0, timeout=30, interval=0.5)
    finally:
        for proc in procs.values():
            if proc.poll() is None:
                proc.send_signal(signal.SIGTERM)
        for proc in procs.values():
            try:
                proc.wait(20)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait(10)
