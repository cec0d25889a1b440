"""``querator serve`` as a real child process: flags and their environment twins,
health checking, SIGTERM/SIGINT shutdown and JSON logs."""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Iterator

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection_pb2, reflection_pb2_grpc

from querator.v1 import queue_pb2, queues_pb2, storage_pb2
from querator_server.config import ServerConfig

from conftest import ProcessServer, Stubs, free_port, wait_for_server, wait_until

SERVICES = ("querator.v1.QueueService", "querator.v1.QueuesService", "querator.v1.StorageService")
# The server's shutdown grace period (ServerConfig.shutdown_grace_s): how long a first
# signal lets open calls run on. Time limits below are fractions of it: they tell "at
# once" from "after the grace period" and leave a loaded machine seconds to spare.
GRACE_S = ServerConfig().shutdown_grace_s


class Serve:
    """``querator serve ARGS`` with its own environment, cwd and a stderr log file."""

    def __init__(self, tmp_path: object, args: list[str], env: dict[str, str] | None = None) -> None:
        self.cwd = str(tmp_path)
        self.log_path = os.path.join(self.cwd, "stderr.log")
        base = {k: v for k, v in os.environ.items() if not k.startswith("QUERATOR_")}
        self.env = {**base, **(env or {})}
        self.args = args
        self.proc: subprocess.Popen[bytes] | None = None

    def start(self, address: str, timeout: float = 30) -> None:
        with open(self.log_path, "ab") as log:
            self.proc = subprocess.Popen(
                [sys.executable, "-m", "querator.cli", "serve", *self.args],
                cwd=self.cwd,
                env=self.env,
                stdin=subprocess.DEVNULL,
                stdout=subprocess.DEVNULL,
                stderr=log,
            )
        wait_for_server(address, self.proc, timeout, self.log)

    def signal(self, sig: int) -> None:
        assert self.proc is not None
        self.proc.send_signal(sig)

    def wait(self, timeout: float) -> int:
        assert self.proc is not None
        return self.proc.wait(timeout)

    def stop(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait(10)

    def log(self) -> str:
        with open(self.log_path, encoding="utf-8", errors="replace") as f:
            return f.read()


@pytest.fixture
def serves() -> Iterator[list[Serve]]:
    started: list[Serve] = []
    yield started
    for s in started:
        s.stop()


def serve(serves: list[Serve], tmp_path: object, address: str, args: list[str], env: dict[str, str] | None = None) -> Serve:
    s = Serve(tmp_path, args, env)
    serves.append(s)
    s.start(address)
    return s


def use(address: str, queue: str) -> None:
    """Leave a trace on disk: a queue with one item."""
    stubs = Stubs(grpc.insecure_channel(address))
    try:
        stubs.create(queue)
        stubs.produce(queue, [b"x"])
    finally:
        stubs.channel.close()


def holds_data(data_dir: str) -> bool:
    return os.path.isdir(os.path.join(data_dir, "catalog")) and bool(os.listdir(os.path.join(data_dir, "groups")))


def queue_names(address: str) -> list[str]:
    stubs = Stubs(grpc.insecure_channel(address))
    try:
        return [q.queue_name for q in stubs.queues.ListQueues(queues_pb2.ListQueuesRequest(), timeout=10).queues]
    finally:
        stubs.channel.close()


# -- flags and environment -------------------------------------------------------------


def test_serve_flags_choose_address_and_data_dir(tmp_path: object, serves: list[Serve]) -> None:
    address = f"127.0.0.1:{free_port()}"
    data = os.path.join(str(tmp_path), "flag-data")
    s = serve(serves, tmp_path, address, ["--address", address, "--data-dir", data, "--log-level", "warning"])
    use(address, "by-flags")
    assert holds_data(data)
    assert not os.path.exists(os.path.join(s.cwd, "querator-data"))  # not the default dir
    s.signal(signal.SIGTERM)
    assert s.wait(30) == 0


def test_serve_environment_twins_and_flags_win(tmp_path: object, serves: list[Serve]) -> None:
    address = f"127.0.0.1:{free_port()}"
    env_data = os.path.join(str(tmp_path), "env-data")
    env = {"QUERATOR_ADDRESS": address, "QUERATOR_DATA_DIR": env_data, "QUERATOR_LOG_LEVEL": "warning"}
    s = serve(serves, tmp_path, address, [], env)
    use(address, "by-env")
    assert holds_data(env_data)
    assert not os.path.exists(os.path.join(s.cwd, "querator-data"))
    s.signal(signal.SIGTERM)
    assert s.wait(30) == 0
    assert "info" not in {json.loads(line).get("level") for line in s.log().splitlines() if line.strip()}

    # A flag beats its environment twin.
    flag_data = os.path.join(str(tmp_path), "flag-data")
    s = serve(serves, tmp_path, address, ["--data-dir", flag_data], env)
    assert queue_names(address) == []
    use(address, "by-flag")
    assert holds_data(flag_data)
    s.signal(signal.SIGTERM)
    assert s.wait(30) == 0
    s = serve(serves, tmp_path, address, [], env)
    assert queue_names(address) == ["by-env"]
    s.signal(signal.SIGTERM)
    assert s.wait(30) == 0

    # Commit groups: off by the variable, and by the flag whatever the variable says.
    for name, args, extra in (
        ("grouped-off", [], {"QUERATOR_COMMIT_GROUPS": "false"}),
        ("flag-off", ["--no-commit-groups"], {"QUERATOR_COMMIT_GROUPS": "true"}),
    ):
        data = os.path.join(str(tmp_path), name)
        s = serve(serves, tmp_path, address, ["--data-dir", data, *args], {**env, **extra})
        use(address, name)
        assert os.listdir(os.path.join(data, "queues")) == ["1"] and not os.path.exists(os.path.join(data, "groups"))
        s.signal(signal.SIGTERM)
        assert s.wait(30) == 0


def test_the_server_listens_on_its_own_variable_and_refuses_a_list_meant_for_clients(
    tmp_path: object, serves: list[Serve]
) -> None:
    """QUERATOR_ADDRESS is the clients' target, a cluster's comma list included; the
    server listens on QUERATOR_LISTEN_ADDRESS, and refuses a list rather than trying to
    listen on it."""
    address = f"127.0.0.1:{free_port()}"
    targets = f"{address},127.0.0.1:{free_port()}"  # what a cluster's CLI user sets
    data = os.path.join(str(tmp_path), "data")
    base = {k: v for k, v in os.environ.items() if not k.startswith("QUERATOR_")}
    refused = subprocess.run(
        [sys.executable, "-m", "querator.cli", "serve", "--data-dir", data],
        env={**base, "QUERATOR_ADDRESS": targets},
        check=False, capture_output=True, text=True, timeout=30, stdin=subprocess.DEVNULL,
    )  # fmt: skip
    assert refused.returncode == 2, refused.stderr
    assert f"QUERATOR_ADDRESS={targets!r} is a list of servers" in refused.stderr
    assert "set QUERATOR_LISTEN_ADDRESS (or --address)" in refused.stderr and "Traceback" not in refused.stderr
    assert not os.path.exists(data)
    for given in (["--address", targets, "serve"], ["serve", "--address", targets]):
        refused = subprocess.run(
            [sys.executable, "-m", "querator.cli", *given, "--data-dir", data],
            env=base, check=False, capture_output=True, text=True, timeout=30, stdin=subprocess.DEVNULL,
        )  # fmt: skip
        assert refused.returncode == 2, refused.stderr
        assert f"listens on one host:port, not a list: --address {targets!r}" in refused.stderr
    assert not os.path.exists(data)

    # Its own variable wins; the clients of the same shell still reach it through the list.
    env = {"QUERATOR_LISTEN_ADDRESS": address, "QUERATOR_ADDRESS": targets, "QUERATOR_DATA_DIR": data}
    s = serve(serves, tmp_path, address, [], env)
    use(address, "own-variable")
    listed = subprocess.run(
        [sys.executable, "-m", "querator.cli", "queues", "list"],
        env={**base, "QUERATOR_ADDRESS": targets}, check=False, capture_output=True, text=True, timeout=30,
    )  # fmt: skip
    assert listed.returncode == 0 and "own-variable" in listed.stdout, listed.stderr
    s.signal(signal.SIGTERM)
    assert s.wait(30) == 0
    # --address wins over both.
    s = serve(serves, tmp_path, address, ["--address", address], {"QUERATOR_ADDRESS": targets, "QUERATOR_DATA_DIR": data})
    assert queue_names(address) == ["own-variable"]
    s.signal(signal.SIGTERM)
    assert s.wait(30) == 0


def test_serve_on_a_busy_address_exits_1_with_a_message(tmp_path: object, process_server: ProcessServer) -> None:
    other = os.path.join(str(tmp_path), "other")
    result = subprocess.run(
        [sys.executable, "-m", "querator.cli", "serve", "--address", process_server.address, "--data-dir", other],
        check=False,
        capture_output=True,
        text=True,
        timeout=30,
        stdin=subprocess.DEVNULL,
    )
    assert result.returncode == 1
    assert f"cannot listen on {process_server.address}" in result.stderr
    assert "Traceback" not in result.stderr


def test_serve_rejects_a_bad_log_level_from_the_environment(tmp_path: object) -> None:
    data = os.path.join(str(tmp_path), "data")
    env = {k: v for k, v in os.environ.items() if not k.startswith("QUERATOR_")}
    result = subprocess.run(
        [sys.executable, "-m", "querator.cli", "serve", "--address", "127.0.0.1:0", "--data-dir", data],
        env={**env, "QUERATOR_LOG_LEVEL": "verbose"},
        check=False,
        capture_output=True,
        text=True,
        timeout=30,
        stdin=subprocess.DEVNULL,
    )
    assert result.returncode == 2
    assert "log level 'verbose'" in result.stderr and "Traceback" not in result.stderr
    assert not os.path.exists(data)


# -- health ----------------------------------------------------------------------------


def test_health_reports_serving_for_server_and_each_service(process_server: ProcessServer) -> None:
    channel = grpc.insecure_channel(process_server.address)
    try:
        health = health_pb2_grpc.HealthStub(channel)
        for service in ("", *SERVICES):
            reply = health.Check(health_pb2.HealthCheckRequest(service=service), timeout=5)
            assert reply.status == health_pb2.HealthCheckResponse.SERVING, service
        with pytest.raises(grpc.RpcError) as err:
            health.Check(health_pb2.HealthCheckRequest(service="querator.v1.NoSuchService"), timeout=5)
        assert err.value.code() == grpc.StatusCode.NOT_FOUND
    finally:
        channel.close()


# -- signals -----------------------------------------------------------------------------


def test_sigterm_fails_waiting_lease_exits_zero_and_keeps_data(tmp_path: object, serves: list[Serve]) -> None:
    address = f"127.0.0.1:{free_port()}"
    data = os.path.join(str(tmp_path), "data")
    args = ["--address", address, "--data-dir", data, "--log-level", "warning"]
    s = serve(serves, tmp_path, address, args)
    stubs = Stubs(grpc.insecure_channel(address))
    try:
        stubs.create("term", lease_timeout={"seconds": 600})
        stubs.create("flow")
        ids = list(stubs.produce("term", [b"a", b"b", b"c", b"d"]).ids)
        lease = stubs.lease("term", batch_size=4)
        assert [i.id for i in lease.items] == ids
        stubs.complete("term", lease.partition, ids[:1])
        # Nothing is ready now, so this lease waits (up to a minute).
        request = queue_pb2.LeaseRequest(queue_name="term", batch_size=1, request_timeout={"seconds": 60})
        waiting = stubs.queue.Lease.future(request, timeout=90)
        wait_until(lambda: stubs.stats("term").lease_waiting == 1, timeout=10)

        # A producer keeps writing through the shutdown.
        acked: list[str] = []
        refusals: list[grpc.StatusCode] = []
        producer = threading.Thread(target=_produce_until_refused, args=(address, acked, refusals), daemon=True)
        producer.start()
        wait_until(lambda: len(acked) >= 20, timeout=20)

        # Both happen well before the shutdown grace period (10 s) would end them: the
        # waiting lease is failed at once, and the process does not sit out the grace.
        started = time.monotonic()
        s.signal(signal.SIGTERM)
        with pytest.raises(grpc.RpcError) as err:
            waiting.result(timeout=30)
        assert err.value.code() == grpc.StatusCode.UNAVAILABLE
        failed_after = time.monotonic() - started
        assert failed_after < GRACE_S / 2, f"the waiting lease failed only after {failed_after:.1f}s"
        assert s.wait(30) == 0
        exited_after = time.monotonic() - started
        assert exited_after < GRACE_S * 0.7, f"the server took {exited_after:.1f}s to exit"
        producer.join(10)
        assert not producer.is_alive()
        assert refusals == [grpc.StatusCode.UNAVAILABLE]  # "shutting down: safe to retry"
    finally:
        stubs.channel.close()

    s = serve(serves, tmp_path, address, args)
    stubs = Stubs(grpc.insecure_channel(address))
    try:
        stats = stubs.stats("term").partitions[0]
        assert (stats.total, stats.total_leased) == (3, 3)
        stubs.complete("term", lease.partition, ids[1:])
        stored = _all_ids(stubs, "flow")
        assert set(acked) <= stored, f"{len(set(acked) - stored)} acknowledged items lost in the shutdown"
    finally:
        stubs.channel.close()


def _all_ids(stubs: Stubs, name: str) -> set[str]:
    ids: set[str] = set()
    token = ""
    for _ in range(1000):
        request = storage_pb2.ListItemsRequest(queue_name=name, page_size=1000, page_token=token)
        page = stubs.storage.ListItems(request, timeout=10)
        ids.update(i.id for i in page.items)
        token = page.next_page_token
        if not token:
            return ids
    raise AssertionError("ListItems paging did not end")


def _produce_until_refused(address: str, acked: list[str], refusals: list[grpc.StatusCode]) -> None:
    stubs = Stubs(grpc.insecure_channel(address))
    try:
        for n in range(100_000):
            try:
                acked += stubs.produce("flow", [f"{n}".encode()]).ids
            except grpc.RpcError as exc:
                refusals.append(exc.code())
                return
    finally:
        stubs.channel.close()


def test_second_signal_during_shutdown_exits_at_once(tmp_path: object, serves: list[Serve]) -> None:
    address = f"127.0.0.1:{free_port()}"
    args = ["--address", address, "--data-dir", os.path.join(str(tmp_path), "data"), "--log-level", "warning"]
    fault = os.path.join(str(tmp_path), "fault")
    s = serve(serves, tmp_path, address, args, env={"QUERATOR_FAULT_FILE": fault})
    stubs = Stubs(grpc.insecure_channel(address))
    produced: list[grpc.StatusCode] = []

    def produce() -> None:
        try:
            stubs.produce("stalled", [b"x"])
        except grpc.RpcError as exc:
            produced.append(exc.code())

    try:
        stubs.create("stalled")
        # A commit that waits on a stalled disk holds the shutdown, which lets the
        # queue finish what it took in, for as long as the stall lasts.
        with open(fault, "w") as f:
            f.write("stall")
        producer = threading.Thread(target=produce, daemon=True)
        producer.start()
        time.sleep(0.3)
        s.signal(signal.SIGTERM)
        wait_until(lambda: health_status(address) != health_pb2.HealthCheckResponse.SERVING, 10)
        time.sleep(0.2)
        assert s.proc is not None and s.proc.poll() is None, "still draining: the second signal has work to do"
        started = time.monotonic()
        s.signal(signal.SIGINT)
        code = s.wait(GRACE_S * 0.8)
        elapsed = time.monotonic() - started
        assert elapsed < GRACE_S / 2, f"the second signal took {elapsed:.1f}s to end the process"
        assert code != 0  # a forced exit, not a clean one
        producer.join(10)
        assert produced, "the stalled produce was answered OK"
    finally:
        os.remove(fault)
        stubs.channel.close()


def test_reflection_streams_end_at_shutdown(tmp_path: object, serves: list[Serve]) -> None:
    # A grpcurl or grpcui session keeps a reflection stream open: it must end (OK)
    # after the answer it is giving, not hold the shutdown for the whole grace period.
    address = f"127.0.0.1:{free_port()}"
    args = ["--address", address, "--data-dir", os.path.join(str(tmp_path), "data"), "--log-level", "warning"]
    s = serve(serves, tmp_path, address, args)
    channel = grpc.insecure_channel(address)
    more = threading.Event()

    def requests() -> Iterator[reflection_pb2.ServerReflectionRequest]:
        yield reflection_pb2.ServerReflectionRequest(list_services="")
        more.wait(60)  # the client keeps its side open

    try:
        info = reflection_pb2_grpc.ServerReflectionStub(channel).ServerReflectionInfo(requests(), timeout=60)
        assert next(info).list_services_response.service
        started = time.monotonic()
        s.signal(signal.SIGTERM)
        assert list(info) == []  # the stream ends...
        assert info.code() == grpc.StatusCode.OK  # ...with OK
        exits_cleanly_in_half_the_grace(s, started, "a reflection stream open")
    finally:
        more.set()
        channel.close()


def exits_cleanly_in_half_the_grace(s: Serve, started: float, what: str) -> None:
    """The process exits 0, well before a grace period spent waiting would end."""
    assert s.wait(GRACE_S * 0.8) == 0
    elapsed = time.monotonic() - started
    assert elapsed < GRACE_S / 2, f"the shutdown took {elapsed:.1f}s with {what}"


def health_status(address: str) -> int:
    """The server's health, or -1 once it no longer answers."""
    with grpc.insecure_channel(address) as channel:
        try:
            return int(health_pb2_grpc.HealthStub(channel).Check(health_pb2.HealthCheckRequest(), timeout=2).status)
        except grpc.RpcError:
            return -1


def test_health_watch_ends_at_shutdown(tmp_path: object, serves: list[Serve]) -> None:
    # gRPC client-side health checking keeps a Watch open per channel: it must learn
    # NOT_SERVING and then end, not hold the shutdown for the whole grace period.
    address = f"127.0.0.1:{free_port()}"
    args = ["--address", address, "--data-dir", os.path.join(str(tmp_path), "data"), "--log-level", "warning"]
    s = serve(serves, tmp_path, address, args)
    channel = grpc.insecure_channel(address)
    try:
        stub = health_pb2_grpc.HealthStub(channel)
        watches = [stub.Watch(health_pb2.HealthCheckRequest(service=name), timeout=60) for name in ("", SERVICES[0], "no.such.Service")]
        assert [next(w).status for w in watches] == [
            health_pb2.HealthCheckResponse.SERVING,
            health_pb2.HealthCheckResponse.SERVING,
            health_pb2.HealthCheckResponse.SERVICE_UNKNOWN,
        ]
        started = time.monotonic()
        s.signal(signal.SIGTERM)
        assert next(watches[0]).status == health_pb2.HealthCheckResponse.NOT_SERVING
        assert next(watches[1]).status == health_pb2.HealthCheckResponse.NOT_SERVING
        for watch in watches:
            assert list(watch) == []  # the stream ends...
            assert watch.code() == grpc.StatusCode.OK  # ...with OK
        exits_cleanly_in_half_the_grace(s, started, "Watch calls open")
    finally:
        channel.close()


def test_two_quick_signals_end_the_process_quickly(tmp_path: object, serves: list[Serve]) -> None:
    address = f"127.0.0.1:{free_port()}"
    args = ["--address", address, "--data-dir", os.path.join(str(tmp_path), "data"), "--log-level", "warning"]
    s = serve(serves, tmp_path, address, args)
    use(address, "q")
    started = time.monotonic()
    s.signal(signal.SIGTERM)
    s.signal(signal.SIGINT)
    s.wait(30)
    elapsed = time.monotonic() - started
    assert elapsed < GRACE_S / 2, f"the process took {elapsed:.1f}s to end"
    s = serve(serves, tmp_path, address, args)
    assert queue_names(address) == ["q"]  # an OK'd admin call survives even a forced exit


def test_sigterm_as_soon_as_the_port_answers_stops_the_server_cleanly(tmp_path: object) -> None:
    """The port answers before start-up returns (the GC tuning, the signal handlers):
    a SIGTERM sent at once, as a supervisor or a script may, still ends in a clean exit 0
    (it killed the process, -15, when the handlers came after the port)."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("QUERATOR_")}
    for attempt in range(5):
        port = free_port()
        data = os.path.join(str(tmp_path), f"data{attempt}")
        proc = subprocess.Popen(
            [sys.executable, "-m", "querator.cli", "serve", "--address", f"127.0.0.1:{port}", "--data-dir", data,
             "--log-level", "warning"],
            env=env, stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE,
        )  # fmt: skip
        try:
            deadline = time.monotonic() + 60
            while True:
                assert proc.poll() is None, proc.stderr.read() if proc.stderr else ""
                with socket.socket() as s:
                    if s.connect_ex(("127.0.0.1", port)) == 0:
                        break
                assert time.monotonic() < deadline, "the server did not listen within 60 s"
                time.sleep(0.005)
            proc.send_signal(signal.SIGTERM)
            _, err = proc.communicate(timeout=60)
        finally:
            if proc.poll() is None:
                proc.kill()
                proc.wait(10)
        assert proc.returncode == 0, f"attempt {attempt}: exit {proc.returncode}\n{err.decode(errors='replace')}"


# -- logs ----------------------------------------------------------------------------------


def test_logs_are_json_lines_and_an_rpc_error_is_logged_once(tmp_path: object, serves: list[Serve]) -> None:
    address = f"127.0.0.1:{free_port()}"
    args = ["--address", address, "--data-dir", os.path.join(str(tmp_path), "data"), "--log-level", "info"]
    s = serve(serves, tmp_path, address, args)  # stderr is a file, not a TTY
    stubs = Stubs(grpc.insecure_channel(address))
    try:
        missing = "no-such-queue-7f3a"
        with pytest.raises(grpc.RpcError) as err:
            stubs.produce(missing, [b"x"])
        assert err.value.code() == grpc.StatusCode.NOT_FOUND
        stubs.create("logged-queue-91c2")
        with pytest.raises(grpc.RpcError) as err:
            stubs.complete("logged-queue-91c2", 0, ["1.0.ffff"])
        assert err.value.code() == grpc.StatusCode.NOT_FOUND
    finally:
        stubs.channel.close()
    s.signal(signal.SIGTERM)
    assert s.wait(30) == 0

    lines = [line for line in s.log().splitlines() if line.strip()]
    events = []
    for line in lines:
        try:
            events.append(json.loads(line))
        except json.JSONDecodeError:
            raise AssertionError(f"not a JSON log line: {line!r}") from None
    assert all(isinstance(e, dict) and e.get("event") and e.get("level") and e.get("timestamp") for e in events)
    assert any(e["event"] == "server_started" for e in events)
    about_missing = [line for line in lines if missing in line]
    assert len(about_missing) == 1, about_missing
    errors = [e for e in events if e["event"] == "rpc_error"]
    assert [e.get("queue") for e in errors] == [missing, "logged-queue-91c2"]
    assert errors[0].get("code") == "NOT_FOUND" and errors[0].get("method", "").endswith("/Produce")
    assert errors[1].get("method", "").endswith("/Complete")

