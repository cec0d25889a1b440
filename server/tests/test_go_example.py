"""examples/go, the Go caller of docs/other-languages.md, built and run against a real server.

examples/go/build.sh generates the Go stubs from proto/ (buf, local protoc-gen-go and
protoc-gen-go-grpc) and builds the program offline from Debian's Go packages. The
program creates a queue, produces, leases, completes and retries; the Python client then
reads what it left. The page's code blocks marked with a file name are that file, so the
program run here is the one the page shows.

Without the Go toolchain the tests are skipped with the reason, except in CI (CI=true),
where they fail: ./dev test installs the packages when it runs as root.
"""

from __future__ import annotations

import json
import os
import re
import subprocess
from datetime import timedelta
from pathlib import Path

import pytest

import querator

from conftest import ThreadServer

ROOT = Path(__file__).resolve().parents[2]
EXAMPLE = ROOT / "examples" / "go"
PAGE = ROOT / "docs" / "other-languages.md"
# A fenced block right after `<!-- file: PATH -->` is the content of PATH.
_FILE_BLOCK = re.compile(r"^<!-- file: (\S+) -->\n```\w*\n(.*?)^```$", re.MULTILINE | re.DOTALL)
@pytest.fixture(scope="module")
def queuedemo(tmp_path_factory: pytest.TempPathFactory) -> Path:
    out = tmp_path_factory.mktemp("go")
    build = subprocess.run(
        [str(EXAMPLE / "build.sh"), str(out)], capture_output=True, text=True, timeout=100, check=False
    )
    if build.returncode == 3:  # a package is missing; build.sh names it
        message = f"the Go example cannot be built: {build.stderr.strip()}"
        if os.environ.get("CI", "").lower() == "true":
            pytest.fail(message, pytrace=False)
        pytest.skip(message)
    assert build.returncode == 0, f"build.sh failed ({build.returncode}):\n{build.stdout}\n{build.stderr}"
    return out / "bin" / "queuedemo"


def _run(binary: Path, address: str, queue: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [str(binary), "-addr", address, "-queue", queue], capture_output=True, text=True, timeout=60, check=False
    )


def test_page_shows_the_example_files() -> None:
    blocks = _FILE_BLOCK.findall(PAGE.read_text())
    assert sorted(path for path, _ in blocks) == ["examples/go/buf.gen.yaml", "examples/go/main.go"]
    for path, body in blocks:
        assert body == (ROOT / path).read_text(), f"docs/other-languages.md: the block for {path} differs from the file"


def test_go_program_produces_leases_completes_and_retries(queuedemo: Path, server: ThreadServer) -> None:
    result = _run(queuedemo, server.address, "go-demo")
    assert result.returncode == 0, result.stderr
    steps = {line["step"]: line for line in map(json.loads, result.stdout.splitlines())}
    assert list(steps) == ["created", "produced", "leased", "completed", "retried", "leased again", "retried again"]
    ids = steps["produced"]["ids"]
    assert len(ids) == 3
    assert steps["leased"]["payloads"] == ["alice", "bob", "carol"]
    assert steps["completed"]["payloads"] == ["alice", "bob"]
    # carol keeps the id it was produced with as its message_id across retries.
    assert steps["retried"]["message_id"] == ids[2]
    assert steps["leased again"] == {
        "step": "leased again", "payload": "carol", "message_id": ids[2], "attempts": 2, "id_changed": True
    }

    with querator.Client(server.address) as client:
        info = client.get_queue("go-demo")
        assert (info.max_attempts, info.lease_timeout) == (5, timedelta(minutes=1))
        stats = client.queue_stats("go-demo")
        assert (stats.total, stats.total_leased, stats.scheduled) == (1, 0, 0)
        items = client.lease("go-demo", batch_size=10, wait=0)
        # The item the Go program retried twice, on its third lease; alice and bob are gone.
        assert [(i.payload, i.message_id, i.attempts, i.kind) for i in items] == [(b"carol", ids[2], 3, "email")]
        client.complete(items)
        assert client.lease("go-demo", batch_size=10, wait=0) == []


def test_go_program_fails_on_an_error_answer(queuedemo: Path, server: ThreadServer) -> None:
    with querator.Client(server.address) as client:
        client.create_queue("taken")
    result = _run(queuedemo, server.address, "taken")
    assert result.returncode == 1
    assert result.stdout == ""
    assert "create queue" in result.stderr and "AlreadyExists" in result.stderr, result.stderr
