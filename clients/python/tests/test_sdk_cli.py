"""The querator command line, end to end against a real server."""

from __future__ import annotations

import io
import json
import os
import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from datetime import UTC, datetime, timedelta
from pathlib import Path

import pytest

import querator
from querator.cli import main, parse_duration
from querator.embedded import EmbeddedServer

from sdk_helpers import client, srv, unique  # noqa: F401 (fixtures)


def querator_cmd(address: str, *args: str, stdin: str | None = None) -> subprocess.CompletedProcess[str]:
    env = dict(os.environ, QUERATOR_ADDRESS=address)
    return subprocess.run(
        [sys.executable, "-m", "querator.cli", *args],
        env=env,
        input=stdin,
        capture_output=True,
        text=True,
        timeout=60,
    )


def cli(capsys: pytest.CaptureFixture[str], srv: EmbeddedServer, *args: str) -> tuple[int, str, str]:
    code = main([*args, "--address", srv.address])
    out, err = capsys.readouterr()
    return code, out, err


def test_produce_10000_lines_then_drain_with_lease_and_complete(
    capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch, srv: EmbeddedServer, tmp_path: Path
) -> None:
    name = unique()
    assert querator_cmd(srv.address, "queues", "create", name, "--lease-timeout", "5m").returncode == 0
    lines = tmp_path / "lines.txt"
    lines.write_text("".join(f"line-{i}\n" for i in range(10_000)))

    produced = querator_cmd(srv.address, "produce", name, "--file", str(lines))
    assert produced.returncode == 0, produced.stderr
    assert produced.stdout.strip() == f"produced 10000 items into {name}"
    assert "produced 10000 items" in produced.stderr  # progress on stderr for large inputs

    stats = json.loads(querator_cmd(srv.address, "queues", "stats", name, "--json").stdout)
    assert stats["total"] == 10_000

    def command(*args: str, stdin: str | None = None) -> tuple[int, str, str]:
        """The first round's commands run in processes of their own, the later rounds' in
        this one (the same main(), a second of interpreter start less each)."""
        if not drained:
            result = querator_cmd(srv.address, *args, stdin=stdin)
            return result.returncode, result.stdout, result.stderr
        monkeypatch.setattr(sys, "stdin", io.StringIO(stdin or ""))
        return cli(capsys, srv, *args)

    drained: list[str] = []
    for _ in range(30):  # bounded: 10 rounds are enough
        code, out, err = command("lease", name, "-n", "1000", "--json")
        assert code == 0, err
        batch = json.loads(out)
        if not batch["items"]:
            break
        ids = [item["id"] for item in batch["items"]]
        code, out, err = command("complete", name, "--partition", str(batch["partition"]), "--json", stdin="\n".join(ids))
        assert code == 0, err
        assert json.loads(out) == {"completed": len(ids)}
        drained.extend(item["payload"] for item in batch["items"])
    assert drained == [f"line-{i}" for i in range(10_000)]  # FIFO, each exactly once
    final = json.loads(querator_cmd(srv.address, "queues", "stats", name, "--json").stdout)
    assert (final["total"], final["total_leased"]) == (0, 0)


def test_produce_quiet_prints_nothing_not_even_progress(srv: EmbeddedServer, client: querator.Client, tmp_path: Path) -> None:
    """-q is "print nothing on success": the progress lines of a large input included."""
    name = unique()
    client.create_queue(name)
    lines = tmp_path / "lines.txt"
    lines.write_text("".join(f"q-{i}\n" for i in range(12_000)))
    produced = querator_cmd(srv.address, "produce", name, "--file", str(lines), "-q")
    assert produced.returncode == 0, produced.stderr
    assert (produced.stdout, produced.stderr) == ("", "")
    assert client.queue_stats(name).total == 12_000


def test_exit_codes(srv: EmbeddedServer) -> None:
    # Independent commands, run at once: each spends most of its time starting Python.
    with ThreadPoolExecutor(6) as pool:
        missing, bad, usage, bad_wait, nonsense, down = pool.map(
            lambda args: querator_cmd(*args),
            [
                (srv.address, "queues", "get", unique("missing")),
                (srv.address, "queues", "create", "bad name"),
                (srv.address, "lease"),
                (srv.address, "lease", "q", "--wait", "soon"),
                (srv.address, "nonsense"),
                ("127.0.0.1:1", "queues", "list", "--timeout", "2s"),
            ],
        )
    assert missing.returncode == 1 and "NOT_FOUND" in missing.stderr
    assert bad.returncode == 1 and "INVALID_ARGUMENT" in bad.stderr and "queue.queue_name" in bad.stderr
    assert usage.returncode == 2 and "usage:" in usage.stderr
    assert bad_wait.returncode == 2
    assert nonsense.returncode == 2
    assert down.returncode == 1 and "UNAVAILABLE" in down.stderr


def test_queues_commands(capsys: pytest.CaptureFixture[str], srv: EmbeddedServer) -> None:
    dlq, name = unique("dlq"), unique()
    assert cli(capsys, srv, "queues", "create", dlq)[0] == 0
    code, out, _ = cli(
        capsys, srv, "queues", "create", name, "--dead-queue", dlq, "--max-attempts", "4", "--lease-timeout", "90s",
        "--partitions", "2", "--json",
    )  # fmt: skip
    info = json.loads(out)
    assert code == 0 and info["name"] == name and info["dead_queue"] == dlq and info["lease_timeout"] == 90.0
    code, out, _ = cli(capsys, srv, "queues", "get", name)
    assert code == 0 and out.splitlines()[0].split()[:3] == ["NAME", "PARTITIONS", "LEASE"]
    assert out.splitlines()[1].split()[:3] == [name, "2", "90s"]
    code, out, _ = cli(capsys, srv, "queues", "update", name, "--max-attempts", "7", "--json")
    assert json.loads(out)["max_attempts"] == 7
    assert cli(capsys, srv, "queues", "update", name)[0] == 2
    code, out, _ = cli(capsys, srv, "queues", "list", "--json", "--page-size", "1")
    assert {name, dlq} <= {q["name"] for q in json.loads(out)}
    cli(capsys, srv, "produce", name, "a", "b", "-q")
    cli(capsys, srv, "produce", name, "later", "--delay", "1h", "-q")
    code, out, _ = cli(capsys, srv, "queues", "stats", name)
    assert code == 0 and "PARTITION" in out and "lease_waiting=0" in out
    code, out, _ = cli(capsys, srv, "queues", "stats", name, "--json")
    stats = json.loads(out)
    assert (stats["total"], stats["scheduled"]) == (2, 1)
    assert cli(capsys, srv, "queues", "clear", name)[0] == 0
    stats = json.loads(cli(capsys, srv, "queues", "stats", name, "--json")[1])
    assert (stats["total"], stats["scheduled"]) == (0, 1)
    assert cli(capsys, srv, "queues", "clear", name, "--scheduled")[0] == 0
    assert json.loads(cli(capsys, srv, "queues", "stats", name, "--json")[1])["scheduled"] == 0
    code, _, err = cli(capsys, srv, "queues", "delete", dlq)
    assert code == 1 and "FAILED_PRECONDITION" in err
    assert cli(capsys, srv, "queues", "delete", name)[0] == 0
    assert cli(capsys, srv, "queues", "delete", dlq)[0] == 0


def test_produce_jsonl_lease_retry_and_items(
    capsys: pytest.CaptureFixture[str], srv: EmbeddedServer, client: querator.Client, tmp_path: Path
) -> None:
    dlq, name = unique("dlq"), unique()
    client.create_queue(dlq)
    client.create_queue(name, dead_queue=dlq)
    at = (datetime.now(UTC) + timedelta(hours=3)).isoformat()
    jsonl = tmp_path / "items.jsonl"
    jsonl.write_text(
        json.dumps({"payload": "one", "kind": "k1", "reference": "r1"}) + "\n"
        + json.dumps({"payload_base64": "//4=", "encoding": "bin"}) + "\n"
        + json.dumps({"payload": {"nested": True}}) + "\n"
        + json.dumps({"payload": "scheduled", "enqueue_at": at}) + "\n"
    )  # fmt: skip
    code, out, _ = cli(capsys, srv, "produce", name, "--file", str(jsonl), "--json")
    assert code == 0 and json.loads(out)["count"] == 4

    code, out, _ = cli(capsys, srv, "lease", name, "-n", "10", "--json")
    leased = json.loads(out)["items"]
    assert [i.get("payload") for i in leased] == ["one", None, '{"nested":true}']
    assert leased[1]["payload_base64"] == "//4=" and leased[0]["kind"] == "k1"
    ids = [i["id"] for i in leased]

    assert cli(capsys, srv, "retry", name, ids[0])[0] == 0
    assert cli(capsys, srv, "retry", name, ids[1], "--in", "2h")[0] == 0
    code, out, _ = cli(capsys, srv, "retry", name, ids[2], "--dead", "--json")
    assert code == 0 and json.loads(out) == {"retried": 0, "dead_lettered": 1}
    code, _, err = cli(capsys, srv, "complete", name, ids[0])
    assert code == 1 and "NOT_FOUND" in err  # retried: it has a new id now

    code, out, _ = cli(capsys, srv, "items", "list", name, "--json")
    ready = [json.loads(line) for line in out.splitlines()]
    assert [r["payload"] for r in ready] == ["one"] and ready[0]["attempts"] == 1
    code, out, _ = cli(capsys, srv, "items", "scheduled", name)
    assert code == 0 and "scheduled" in out and "base64://4=" in out
    assert len(out.splitlines()) == 3  # header, the retried item, the scheduled one
    code, out, _ = cli(capsys, srv, "items", "list", dlq, "--json")
    dead = json.loads(out)
    assert dead["payload"] == '{"nested":true}'
    assert (dead["message_id"], dead["dead_reason"], dead["dead_attempts"]) == (ids[2], "retry_dead", 1)

    export = tmp_path / "export.jsonl"
    export.write_text(out)
    code, out, _ = cli(capsys, srv, "items", "import", name, str(export), "--json")
    assert code == 0 and json.loads(out)["count"] == 1
    code, out, _ = cli(capsys, srv, "items", "list", name, "--json", "--limit", "5")
    rows = [json.loads(line) for line in out.splitlines()]
    assert [r["payload"] for r in rows] == ["one", '{"nested":true}'] and rows[1]["source_id"] == ids[2]
    assert (rows[1]["message_id"], rows[1]["dead_reason"], rows[1]["dead_at"]) == (ids[2], "retry_dead", dead["dead_at"])
    assert cli(capsys, srv, "items", "delete", name, rows[1]["id"])[0] == 0
    assert [i.payload for i in client.list_items(name)] == [b"one"]

    code, out, _ = cli(capsys, srv, "lease", name)
    assert code == 0 and out.splitlines()[0].split() == ["PARTITION", "ID", "ATTEMPTS", "LEASE_DEADLINE", "PAYLOAD"]
    code, out, err = cli(capsys, srv, "lease", name, "--wait", "100ms")
    assert code == 0 and out == "" and "no items" in err


def test_pipeline_options(capsys: pytest.CaptureFixture[str], srv: EmbeddedServer, tmp_path: Path) -> None:
    name = unique()
    code, out, _ = cli(capsys, srv, "queues", "create", name, "--dedup-window", "10m", "--lease-key-ttl", "2h", "--json")
    info = json.loads(out)
    assert code == 0 and (info["dedup_window"], info["lease_key_ttl"]) == (600.0, 7200.0)
    jsonl = tmp_path / "keyed.jsonl"
    jsonl.write_text("".join(json.dumps({"payload": f"p{i % 2}", "idempotency_key": f"k{i % 2}"}) + "\n" for i in range(4)))
    code, out, _ = cli(capsys, srv, "produce", name, "--file", str(jsonl), "--json")
    produced = json.loads(out)
    assert code == 0 and produced["duplicates"] == 2 and produced["ids"][2:] == produced["ids"][:2]

    first = json.loads(cli(capsys, srv, "lease", name, "-n", "5", "--lease-key", "job-1", "--json")[1])["items"]
    again = json.loads(cli(capsys, srv, "lease", name, "-n", "5", "--lease-key", "job-1", "--json")[1])["items"]
    assert [i["id"] for i in again] == [i["id"] for i in first] and len(first) == 2
    code, out, _ = cli(capsys, srv, "complete", name, "--lease-key", "job-1", "--json")
    assert code == 0 and json.loads(out) == {"completed_keys": 1}
    assert json.loads(cli(capsys, srv, "queues", "stats", name, "--json")[1])["total"] == 0


def test_produce_from_stdin(srv: EmbeddedServer, client: querator.Client) -> None:
    name = unique()
    client.create_queue(name)
    done = querator_cmd(srv.address, "produce", name, "--kind", "line", stdin="x\ny\n\nz\n")
    assert done.returncode == 0 and len(done.stdout.splitlines()) == 4  # header + 3 (blank lines skipped)
    assert [(i.text, i.kind) for i in client.lease(name, batch_size=5, wait=0)] == [("x", "line"), ("y", "line"), ("z", "line")]


def test_serve_still_delegates_to_the_server() -> None:
    help_text = subprocess.run(
        [sys.executable, "-m", "querator.cli", "serve", "--help"], capture_output=True, text=True, timeout=60
    )
    assert help_text.returncode == 0
    assert "--data-dir" in help_text.stdout and "--log-level" in help_text.stdout
    top = subprocess.run([sys.executable, "-m", "querator.cli", "--help"], capture_output=True, text=True, timeout=60)
    for command in ("serve", "queues", "produce", "lease", "complete", "retry", "items", "keys"):
        assert command in top.stdout


def test_parse_duration() -> None:
    assert parse_duration("1.5") == timedelta(seconds=1.5)
    assert parse_duration("500ms") == timedelta(milliseconds=500)
    assert parse_duration("1h30m") == timedelta(minutes=90)
    assert parse_duration("2d") == timedelta(days=2)


def test_dlq_redrive_moves_dead_letters_back(capsys: pytest.CaptureFixture[str], srv: EmbeddedServer, client: querator.Client) -> None:
    dlq, name = unique("dlq"), unique()
    client.create_queue(dlq)
    client.create_queue(name, dead_queue=dlq)
    client.produce(name, ["one", "two", "three"])
    for item in client.lease(name, batch_size=3, wait=0):
        item.dead()
    produced = {i.payload: i.message_id for i in client.list_items(dlq)}
    assert len(produced) == 3

    code, out, _ = cli(capsys, srv, "dlq", "redrive", dlq, "--limit", "2", "--reason", "retry_dead", "--json")
    answer = json.loads(out)
    assert code == 0 and (answer["moved"], answer["skipped"]) == (2, 0)
    code, out, _ = cli(capsys, srv, "dlq", "redrive", dlq)
    assert code == 0 and out.strip() == f"moved 1 items from {dlq} to their source queues"
    assert list(client.list_items(dlq)) == []
    assert sorted((i.payload, i.message_id) for i in client.list_items(name)) == sorted(produced.items())
    with pytest.raises(SystemExit) as exited:
        cli(capsys, srv, "dlq", "redrive", dlq, "--reason", "bogus")
    assert exited.value.code == 2 and "invalid choice" in capsys.readouterr().err


def test_ids_and_payloads_after_options(capsys: pytest.CaptureFixture[str], srv: EmbeddedServer, client: querator.Client) -> None:
    name = unique()
    client.create_queue(name, partitions=1)
    code, out, err = cli(capsys, srv, "produce", name, "--kind", "K", "a", "b", "--json")
    assert code == 0, err
    assert [(i.text, i.kind) for i in client.lease(name, batch_size=2, wait=0)] == [("a", "K"), ("b", "K")]

    ids = [i.id for i in client.list_items(name)]
    code, out, err = cli(capsys, srv, "retry", name, "-p", "0", *ids)  # -p before the ids
    assert (code, out) == (0, "retried 2 items\n"), err
    keyed = client.lease(name, batch_size=2, wait=0, lease_key="K1")
    code, out, err = cli(capsys, srv, "complete", name, "--lease-key", "K1", keyed[0].id)  # a key, then an id
    assert code == 0, err
    assert client.queue_stats(name).total == 0  # the key completed both; the id was one of them
    client.produce(name, ["c"])
    [stored] = list(client.list_items(name))
    code, out, err = cli(capsys, srv, "items", "delete", name, "-p", "0", stored.id)
    assert (code, out) == (0, "deleted 1 items\n"), err
    assert client.queue_stats(name).total == 0


def test_unknown_options_get_the_commands_own_usage(srv: EmbeddedServer) -> None:
    bad = querator_cmd(srv.address, "queues", "create", "x", "--bogus", "1")
    assert bad.returncode == 2
    assert bad.stderr.startswith("usage: querator queues create ")
    assert "querator queues create: error: unrecognized arguments: --bogus" in bad.stderr
    extra = querator_cmd(srv.address, "queues", "get", "x", "y")  # no list to take a second word
    assert extra.returncode == 2 and extra.stderr.startswith("usage: querator queues get ")


def test_version() -> None:
    result = subprocess.run([sys.executable, "-m", "querator.cli", "--version"], capture_output=True, text=True, timeout=60)
    assert result.returncode == 0
    assert result.stdout == f"querator (querator-client {querator.__version__}, querator-server 0.1.0)\n"


def test_retry_says_when_the_server_dead_lettered(capsys: pytest.CaptureFixture[str], srv: EmbeddedServer, client: querator.Client) -> None:
    name, dlq = unique(), unique("dlq")
    client.create_queue(dlq)
    client.create_queue(name, max_attempts=1, dead_queue=dlq)
    client.produce(name, ["x", "y"])
    ids = [i.id for i in client.lease(name, batch_size=2, wait=0)]
    code, out, err = cli(capsys, srv, "retry", name, *ids)
    assert (code, out) == (0, "dead-lettered 2 items (out of attempts)\n"), err
    deadline = time.monotonic() + 30  # the dead-letter queue takes them after the commit
    while client.queue_stats(dlq).total < 2 and time.monotonic() < deadline:
        time.sleep(0.05)
    assert client.queue_stats(dlq).total == 2
    client.produce(name, ["z"])
    [item] = client.lease(name, wait=0)
    code, out, _ = cli(capsys, srv, "retry", name, item.id, "--json")
    assert json.loads(out) == {"retried": 0, "dead_lettered": 1}


def test_deleting_a_queue_with_items_names_the_flag(srv: EmbeddedServer, client: querator.Client) -> None:
    name = unique()
    client.create_queue(name)
    client.produce(name, ["x"])
    result = querator_cmd(srv.address, "queues", "delete", name)
    assert result.returncode == 1
    assert result.stderr == f"querator: FAILED_PRECONDITION: queue {name!r} still holds items; add --force to delete it\n"
    assert querator_cmd(srv.address, "queues", "delete", name, "--force").returncode == 0


def test_items_list_shows_progress_on_stderr(srv: EmbeddedServer, client: querator.Client) -> None:
    name = unique()
    client.create_queue(name)
    client.produce(name, [b"p"] * 12_000)
    listed = querator_cmd(srv.address, "items", "list", name, "--json")
    assert listed.returncode == 0, listed.stderr
    assert len(listed.stdout.splitlines()) == 12_000
    assert listed.stderr == "listed 10000 items\nlisted 12000 items\n"


def test_serve_on_a_client_only_install_says_what_to_install() -> None:
    code = "import sys; sys.modules['querator_server'] = None\nfrom querator.cli import main\nsys.exit(main(sys.argv[1:]))"
    for argv in (["serve", "--address", "127.0.0.1:0"], ["--json", "serve", "--data-dir", "d"], ["serve", "--help"]):
        result = subprocess.run([sys.executable, "-c", code, *argv], capture_output=True, text=True, timeout=60)
        assert result.returncode == 2, argv
        assert result.stderr == (
            "querator: 'serve' runs the server, which is not installed here: pip install querator-server\n"
        )


def test_client_options_before_serve_are_refused() -> None:
    result = subprocess.run(
        [sys.executable, "-m", "querator.cli", "--token", "t", "serve", "--help"], capture_output=True, text=True, timeout=60
    )
    assert result.returncode == 2
    assert "querator: error: --token before 'serve': only --address and --json apply to the server" in result.stderr


def test_serve_after_top_level_options(tmp_path: Path) -> None:
    """``querator --json serve ...`` runs the server, logging JSON lines; ``--address``
    before ``serve`` is where it listens."""
    import signal
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    log = tmp_path / "stderr.log"
    env = {k: v for k, v in os.environ.items() if not k.startswith("QUERATOR_")}
    with open(log, "wb") as err:
        proc = subprocess.Popen(
            [sys.executable, "-m", "querator.cli", "--json", "--address", f"127.0.0.1:{port}", "serve", "--data-dir", "d"],
            cwd=tmp_path, env=env, stderr=err,
        )  # fmt: skip
        try:
            with querator.Client(f"127.0.0.1:{port}") as c:
                c.wait_ready(60)
                c.create_queue("served")
        finally:
            proc.send_signal(signal.SIGTERM)
            assert proc.wait(60) == 0
    events = [json.loads(line) for line in log.read_text().splitlines()]
    assert "server_started" in [e["event"] for e in events]
    assert (tmp_path / "d").is_dir()


@pytest.mark.parametrize("where", ["before", "after"])
def test_json_before_or_after_serve_logs_json_lines_even_on_a_terminal(tmp_path: Path, where: str) -> None:
    """``--json`` goes before or after ``serve``, as for every other command (docs/sdk.md)."""
    import pty
    import signal
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    env = {k: v for k, v in os.environ.items() if not k.startswith("QUERATOR_")}
    master, terminal = pty.openpty()  # the server's stderr is a terminal: coloured text by default
    proc = subprocess.Popen(
        [sys.executable, "-m", "querator.cli", *(["--json", "serve"] if where == "before" else ["serve", "--json"]),
         "--address", f"127.0.0.1:{port}", "--data-dir", "d"],
        cwd=tmp_path, env=env, stderr=terminal, stdout=subprocess.DEVNULL,
    )  # fmt: skip
    os.close(terminal)
    try:
        with querator.Client(f"127.0.0.1:{port}") as c:
            c.wait_ready(60)
    finally:
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(60) == 0
    out = b""
    while True:
        try:
            chunk = os.read(master, 65536)
        except OSError:  # the terminal's other end is closed: all read
            break
        if not chunk:
            break
        out += chunk
    os.close(master)
    lines = [line for line in out.decode().splitlines() if line.strip()]
    events = [json.loads(line) for line in lines]  # JSON, not coloured text
    assert "server_started" in [e["event"] for e in events]


def test_dlq_show_of_an_id_two_partitions_hold_names_them_rather_than_showing_one(
    capsys: pytest.CaptureFixture[str], srv: EmbeddedServer, client: querator.Client
) -> None:
    """In a cluster ids and message ids are unique per partition only (each home issues
    its own), so one ID can name an item in each of two partitions. ``dlq show`` without
    ``-p`` then names the partitions instead of printing whichever it read first. Here
    two imported dead letters share a message_id, as two homes' items share an id."""
    dlq = unique("dlq")
    client.create_queue(dlq, partitions=2)
    for partition in (0, 1):
        item = querator.StoredItem(payload=f"p{partition}".encode(), message_id="m-1")
        client.import_items(dlq, [item], partition=partition)
    assert main(["dlq", "show", dlq, "m-1", "--address", srv.address]) == 1
    err = capsys.readouterr().err
    assert "2 items match 'm-1'" in err and "partitions 0, 1" in err and "-p" in err
    assert main(["dlq", "show", dlq, "m-1", "-p", "1", "--json", "--address", srv.address]) == 0
    shown = json.loads(capsys.readouterr().out)
    assert (shown["partition"], shown["message_id"]) == (1, "m-1")
