"""What a new user meets first: optional extras, durations as text, submodules reachable."""

from __future__ import annotations

import subprocess
import sys
from datetime import timedelta

import pytest

import querator

from sdk_helpers import client, srv, unique  # noqa: F401 (fixtures)


def _python(code: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)


@pytest.mark.parametrize("missing", ["pyarrow", "pyspark"])
def test_import_querator_spark_without_its_extra_names_the_extra(missing: str) -> None:
    # None in sys.modules makes the import fail as it does when the package is absent.
    result = _python(f"import sys; sys.modules[{missing!r}] = None; import querator.spark")
    assert result.returncode == 1
    last = result.stderr.strip().splitlines()[-1]
    assert last == (
        f"ImportError: querator.spark needs {missing}, which is not installed: pip install 'querator-client[spark]'"
    )


def test_querator_testing_and_embedded_need_no_import_of_their_own() -> None:
    result = _python(
        "import sys, querator\n"
        "assert 'querator.testing' not in sys.modules\n"
        "with querator.testing.server() as srv, srv.client() as c:\n"
        "    c.create_queue('q')\n"
        "    print(type(srv).__name__, querator.embedded.EmbeddedServer.__name__)\n"
    )
    assert result.returncode == 0, result.stderr
    assert result.stdout == "EmbeddedServer EmbeddedServer\n"
    with pytest.raises(AttributeError):
        querator.no_such_module  # noqa: B018


def test_durations_as_text_work_in_the_sdk_as_in_the_cli(client: querator.Client) -> None:
    name = unique()
    info = client.create_queue(name, lease_timeout="30s", expire_timeout="1h30m", dedup_window="2d")
    assert (info.lease_timeout, info.expire_timeout, info.dedup_window) == (
        timedelta(seconds=30),
        timedelta(hours=1, minutes=30),
        timedelta(days=2),
    )
    assert client.update_queue(name, lease_timeout="1500ms").lease_timeout == timedelta(seconds=1.5)
    client.produce(name, ["a"])
    [item] = client.lease(name, wait="0s")
    before = item.lease_deadline
    item.extend("90s")
    assert item.lease_deadline - before >= timedelta(seconds=60)
    item.retry(in_="10m")
    assert client.queue_stats(name).scheduled == 1
    with pytest.raises(ValueError, match="not a duration: '30 parsecs'"):
        client.create_queue(unique(), lease_timeout="30 parsecs")
    with querator.Client(client.address, timeout="5s") as other:
        assert other.config.timeout == timedelta(seconds=5)


def test_a_worker_takes_durations_as_text(client: querator.Client) -> None:
    import time

    name = unique()
    client.create_queue(name)
    client.produce(name, ["a", "b"])
    done: list[str] = []
    worker = querator.Worker(client, name, lambda item: done.append(item.text), lease_wait="200ms", shutdown_timeout="5s")
    worker.start(timeout="10s")
    try:
        deadline = time.monotonic() + 30
        while len(done) < 2 and time.monotonic() < deadline:
            time.sleep(0.02)
    finally:
        worker.stop(timeout="10s")
    assert sorted(done) == ["a", "b"]


def test_an_unknown_queue_setting_is_a_type_error(client: querator.Client) -> None:
    with pytest.raises(TypeError, match="unknown queue setting 'max_attempt'"):
        client.create_queue(unique(), max_attempt=3)  # type: ignore[call-arg]
    with pytest.raises(TypeError, match="unknown queue setting 'lease'"):
        client.update_queue(unique(), lease=None)  # type: ignore[call-arg]
