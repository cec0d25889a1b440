"""Every ``python`` block of README.md and docs/*.md, run as written.

Each block runs alone in a fresh interpreter (this venv's python), against a real
``querator serve`` started fresh for the block on a free port of its own: in the copy
that runs, the address the samples write, 127.0.0.1:2319, is replaced by that one (also
given as $QUERATOR_ADDRESS, the clients' default), so that the suite's other processes
beside it never find the docs' port taken or take it. What the page tells the reader
to have made before (a queue, items in it) the test makes first; the sample itself is
otherwise never changed. A block the docs mark with
``<!-- not run: reason -->`` on the line before is skipped and counted (those marked
``<!-- run by the Spark tests ... -->`` run in tests/spark, in one SparkSession); a worker sample
that runs "until SIGTERM" gets SIGTERM once it has drained its queue and must exit 0.
The pytest sample of docs/quickstart.md runs under pytest, as the page says.
"""

from __future__ import annotations

import os
import re
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest

import querator
from querator.testing import make_certificates

from conftest import free_port

ROOT = Path(__file__).resolve().parents[3]
DOCS = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
DOC_ADDRESS = "127.0.0.1:2319"  # the address every sample writes
MAX_NOT_RUN = 1  # sdk.md's first: an example server elsewhere, with the system's CA roots

_BLOCK = re.compile(
    r"(?:^<!--\s*(?:not run:\s*(?P<why>[^>]*?)|(?P<spark>run by the Spark tests)[^>]*?)\s*-->\n)?^```python\n(?P<text>.*?)^```",
    re.S | re.M,
)


@dataclass
class Sample:
    path: Path
    line: int
    text: str
    not_run: str | None
    by_spark: bool = False  # run by tests/spark/test_spark_doc_samples.py, in one SparkSession

    @property
    def name(self) -> str:
        return f"{self.path.name}:{self.line}"


def samples() -> list[Sample]:
    out = []
    for path in DOCS:
        content = path.read_text()
        for match in _BLOCK.finditer(content):
            line = content.count("\n", 0, match.start("text"))
            out.append(Sample(path, line, match.group("text"), match.group("why"), bool(match.group("spark"))))
    return out


def _queue(name: str, *payloads: str, kind: str = "") -> Callable[[querator.Client], None]:
    def make(client: querator.Client) -> None:
        client.create_queue(name)
        if payloads:
            client.produce(name, list(payloads), kind=kind or None)

    return make


def _notifications(client: querator.Client) -> None:
    client.create_queue("notifications")
    client.produce("notifications", ["e1"], kind="email")
    client.produce("notifications", ["s1"], kind="sms")


# What the page has the reader make before a block (keyed by the block's first lines).
SETUP: dict[str, Callable[[querator.Client], None]] = {
    "import asyncio\nimport querator\n\nasync def main": _queue("jobs"),
    'import querator\n\nclient = querator.Client("127.0.0.1:2319")\nwith querator.Producer': _queue("events"),
    "import querator\n\ndef send_email": _queue("emails", '{"to": "a@example.com"}', '{"to": "b@example.com"}'),
    'import querator\n\ndef handle(item: querator.LeasedItem) -> None:\n    print(f"handled': _queue("jobs", "j1", "j2", "j3"),
    'import querator\n\nclient = querator.Client("127.0.0.1:2319")\nworker = querator.Worker(client, "notifications")': _notifications,
    "from datetime import timedelta": _queue("orders"),
    "import querator\nfrom opentelemetry": _queue("jobs"),
    "import querator\n\ndef do_the_work": _queue("jobs", "traced"),
    'import querator\n\ntasks = querator.Tasks("mail")': _queue("mail"),
    "import asyncio\nfrom datetime import UTC": _queue("reports"),
    'import time\n\nimport querator\n\ntasks = querator.Tasks("renders")': _queue("renders"),
    'import time\nfrom datetime import timedelta\n\nimport querator\n\ntasks = querator.Tasks("heartbeats")': _queue("heartbeats"),
}

# A block that needs a server with auth and TLS (the quickstart's step 5): the files and
# the bootstrap token it reads are made by the test.
SECURE = "import os\n\nimport querator\n\naddress ="
ADMIN_TOKEN = "a-bootstrap-token-of-at-least-43-characters-0123"

# What a block's output must show (it ran, not just exited 0), keyed by the block's first lines.
EXPECT = {
    "import querator\n\nwith querator.Client": ["handled by hand: job 0 attempt 1", "done: 95 completed by the worker"],
    "import asyncio\nimport querator\n\nasync def main": ["a\nb\nc\n"],
    "import querator\n\ndef send_email": ["email to a@example.com", "email to b@example.com"],
    'import querator\n\ndef handle(item: querator.LeasedItem) -> None:\n    print(f"handled': ["handled j1", "3 completed"],
    "import querator\n\ndef do_the_work": ["working on traced"],
    SECURE: ["qk_"],
    'import querator\n\ntasks = querator.Tasks("mail")': ["email to a@example.com: hello (attempt 1)", "no task of kind 'emial'"],
    "import asyncio\nfrom datetime import UTC": ["report daily: 10 bytes", "report later: 0 bytes"],
    "from datetime import timedelta\n\nimport querator\n\ntasks": ["charged order 1: 1999 cents", "audit: order 1 charged"],
    'import time\n\nimport querator\n\ntasks = querator.Tasks("renders")': [
        "rendered 0 frames",
        "1 completed, 1 killed at the time limit",
    ],
    'import time\nfrom datetime import timedelta\n\nimport querator\n\ntasks = querator.Tasks("heartbeats")': ["beat of api for "],
    'import querator\n\nqueue = "invoices"': ["done before: ()", "dead: [] retried before: ()", "by key: 2"],
    'import querator\n\nclient = querator.Client("127.0.0.1:2319")\nclient.create_queue("order-events")': [
        "[('order-17', 'created'), ('order-18', 'created')]\n[('order-17', 'paid')]\n",
    ],
    'import querator\n\nqueue = "newsletters"': [
        "paused: True\nwhile paused: []\nresumed: [b'kept for later']\nrefused: ",
        "paused for produce",
    ],
}


# Put on PYTHONPATH as sitecustomize for every sample: a write to stdout from a thread
# other than the main one that is not whole lines can interleave with another thread's
# (print(a, b) is four writes, print(a) two), and readers of the docs copy the samples.
_WHOLE_LINES = """
import sys, threading


class _WholeLines:
    def __init__(self, out):
        self._out = out

    def write(self, text):
        if text and not text.endswith("\\n") and threading.current_thread() is not threading.main_thread():
            sys.__stderr__.write(f"PARTIAL LINE from thread {threading.current_thread().name}: {text!r}\\n")
        return self._out.write(text)

    def __getattr__(self, name):
        return getattr(self._out, name)


sys.stdout = _WholeLines(sys.stdout)
"""


def _listening(address: str) -> bool:
    host, port = address.rsplit(":", 1)
    with socket.socket() as s:
        return s.connect_ex((host, int(port))) == 0


def _serve(directory: Path, address: str, env: dict[str, str], *extra: str) -> subprocess.Popen[bytes]:
    assert not _listening(address), f"{address} is taken"
    log = open(directory / "serve.log", "wb")  # noqa: SIM115 - the child's
    proc = subprocess.Popen(
        [str(Path(sys.executable).parent / "querator"), "serve", "--address", address, "--data-dir", str(directory / "data"), *extra],
        cwd=directory, env=env, stderr=log,
    )  # fmt: skip
    deadline = time.monotonic() + 60
    while not _listening(address):
        assert proc.poll() is None, (directory / "serve.log").read_text()
        assert time.monotonic() < deadline, "querator serve did not listen within 60 s"
        time.sleep(0.1)
    return proc


def _drained_and_waiting(client: querator.Client, queue: str) -> bool:
    """The worker has handled everything and is long-polling for more."""
    try:
        stats = client.queue_stats(queue)
    except querator.NotFound:
        return False
    return stats.total == 0 and stats.scheduled == 0 and stats.lease_waiting > 0


RUNNABLE = [s for s in samples() if s.not_run is None and not s.by_spark]


def test_the_docs_have_samples_and_few_are_not_run() -> None:
    found = samples()
    names = {s.path.name for s in found}
    assert {"quickstart.md", "sdk.md", "tracing.md"} <= names
    skipped = [f"{s.name}: {s.not_run}" for s in found if s.not_run is not None]
    assert len(skipped) <= MAX_NOT_RUN, skipped
    assert len(RUNNABLE) >= 11, [s.name for s in RUNNABLE]
    for key in [*SETUP, *EXPECT]:  # each names a block the docs still have
        assert any(s.text.startswith(key) for s in RUNNABLE), f"no sample starts with {key!r}"


@pytest.mark.parametrize("sample", RUNNABLE, ids=lambda s: s.name)
def test_every_python_sample_in_the_docs_runs_as_written(sample: Sample, tmp_path: Path) -> None:
    address = f"127.0.0.1:{free_port()}"
    env = {k: v for k, v in os.environ.items() if not k.startswith("QUERATOR_")}
    env["QUERATOR_ADDRESS"] = address
    probe = tmp_path / "whole-lines"
    probe.mkdir()
    (probe / "sitecustomize.py").write_text(_WHOLE_LINES)
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(probe), env.get("PYTHONPATH")]))
    script = tmp_path / "sample.py"
    script.write_text(sample.text.replace(DOC_ADDRESS, address))
    assert ":2319" not in script.read_text(), f"{sample.name} reaches the docs' port by another name than {DOC_ADDRESS}"
    if re.search(r"^def test_\w+\(querator_client\)", sample.text, re.M):  # a pytest test: run by pytest
        script = script.rename(tmp_path / "test_sample.py")
        result = subprocess.run(
            [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", script.name],
            cwd=tmp_path, env=env, capture_output=True, text=True, timeout=180,
        )  # fmt: skip
        assert result.returncode == 0, result.stdout + result.stderr
        assert "1 passed" in result.stdout, result.stdout
        return
    options: dict[str, Any] = {}
    if sample.text.startswith(SECURE):
        make_certificates(tmp_path)  # ca.pem, server.pem, server.key
        env["ADMIN_TOKEN"] = ADMIN_TOKEN
        server = _serve(
            tmp_path,
            address,
            {**env, "QUERATOR_ADMIN_TOKEN": ADMIN_TOKEN},
            "--auth",
            "--tls-cert",
            "server.pem",
            "--tls-key",
            "server.key",
        )
        options = {"root_certificates": (tmp_path / "ca.pem").read_bytes(), "bearer_token": ADMIN_TOKEN}
    else:
        server = _serve(tmp_path, address, env)
    try:
        with querator.Client(address, **options) as client:
            setup = next((fn for key, fn in SETUP.items() if sample.text.startswith(key)), None)
            if setup is not None:
                setup(client)
            until_signal = re.search(r"^(?:\w+ = )?(?:querator\.)?\w*Worker\(.*\)\.run\(\)|^worker\.run\(\)", sample.text, re.M)
            proc = subprocess.Popen(
                [sys.executable, script.name], cwd=tmp_path, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
            )  # fmt: skip
            if until_signal:  # documented to run until SIGTERM: stop it once its queue is drained
                queue = re.search(r"Worker\(client, \"([\w-]+)\"", sample.text)
                assert queue, sample.text
                deadline = time.monotonic() + 90
                while not _drained_and_waiting(client, queue.group(1)):
                    assert proc.poll() is None, proc.communicate()
                    assert time.monotonic() < deadline, f"{sample.name}: the worker did not drain {queue.group(1)}"
                    time.sleep(0.2)
                proc.send_signal(signal.SIGTERM)
            try:
                out, err = proc.communicate(timeout=120)
            except subprocess.TimeoutExpired:
                proc.kill()
                out, err = proc.communicate()
                pytest.fail(f"{sample.name} did not end within 120 s\n{out}\n{err}")
        assert proc.returncode == 0, f"{sample.name}: exit {proc.returncode}\n{out}\n{err}"
        assert "PARTIAL LINE" not in err, f"{sample.name}: a thread printed less than a line per write\n{err}"
        for text in next((want for key, want in EXPECT.items() if sample.text.startswith(key)), []):
            assert text in out, f"{sample.name}: {text!r} not in\n{out}"
    finally:
        server.send_signal(signal.SIGTERM)
        assert server.wait(60) == 0
