"""The Dockerfile and docker-compose.yml, checked without a container engine.

- docker-compose.yml is validated against the compose-spec JSON schema
  (check-jsonschema's vendored copy, so no network) and cross-checked with the
  Dockerfile and deploy/prometheus.yml.
- The Dockerfile's ENTRYPOINT + CMD run exactly as the image would run them, with the
  image's ENV, against a temp data dir; only the listen addresses are moved to free
  loopback ports. The image's and the compose file's health-check commands are then
  run as they are (address swapped) and must pass, then fail once the server stops.
- Every RUN line must at least parse as a shell script (bash -n).
"""

from __future__ import annotations

import json
import os
import re
import shlex
import signal
import subprocess
import sys
import tomllib
import urllib.request
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path

import grpc
import pytest
from ruamel.yaml import YAML

from querator_server.cli import effective_config
from querator_server.config import ServerConfig

from conftest import Stubs, free_port, wait_until

ROOT = Path(__file__).resolve().parents[2]
BIN = Path(sys.executable).parent
# The addresses the image listens on; tests move them to free loopback ports.
IMAGE_GRPC = "0.0.0.0:2319"
IMAGE_METRICS = "127.0.0.1:9090"  # loopback: metrics are reached from outside by choice
# The health checks dial this from inside the container.
HEALTH_TARGET = "127.0.0.1:2319"


@dataclass
class Dockerfile:
    instructions: list[tuple[str, str]] = field(default_factory=list)

    @classmethod
    def read(cls, path: Path) -> Dockerfile:
        text = re.sub(r"\\\n", " ", "\n".join(
            line for line in path.read_text().splitlines() if not line.lstrip().startswith("#")
        ))  # fmt: skip
        out = cls()
        for line in text.splitlines():
            if line.strip():
                keyword, _, rest = line.strip().partition(" ")
                out.instructions.append((keyword.upper(), rest.strip()))
        return out

    def all(self, keyword: str) -> list[str]:
        return [rest for kw, rest in self.instructions if kw == keyword]

    def last(self, keyword: str) -> str:
        found = self.all(keyword)
        assert found, f"the Dockerfile has no {keyword}"
        return found[-1]

    def exec_form(self, keyword: str) -> list[str]:
        value = json.loads(self.last(keyword))
        assert isinstance(value, list) and all(isinstance(v, str) for v in value), f"{keyword} must be exec form"
        return value

    def env(self) -> dict[str, str]:
        out: dict[str, str] = {}
        for rest in self.all("ENV"):
            for pair in shlex.split(rest):
                key, sep, value = pair.partition("=")
                assert sep, f"ENV {rest!r}: use KEY=value"
                out[key] = value
        return out

    def healthcheck(self) -> list[str]:
        rest = self.last("HEALTHCHECK")
        _options, sep, command = rest.partition("CMD ")
        assert sep, "HEALTHCHECK needs CMD"
        value = json.loads(command)
        assert isinstance(value, list)
        return value


@pytest.fixture(scope="module")
def dockerfile() -> Dockerfile:
    return Dockerfile.read(ROOT / "Dockerfile")


@pytest.fixture(scope="module")
def compose() -> dict[str, object]:
    data = YAML(typ="safe").load((ROOT / "docker-compose.yml").read_text())
    assert isinstance(data, dict)
    return data


def _service(compose: dict[str, object], name: str) -> dict[str, object]:
    services = compose["services"]
    assert isinstance(services, dict) and name in services
    return services[name]  # type: ignore[no-any-return]


def _effective(dockerfile: Dockerfile, service: dict[str, object] | None = None) -> ServerConfig:
    """The settings the server of ``service`` (None: the image alone) runs with: the
    image's ENV under the service's environment, the service's command (or the image's
    CMD) parsed by ``querator serve`` itself."""
    assert dockerfile.exec_form("ENTRYPOINT") == ["querator"]
    command = list((service or {}).get("command") or dockerfile.exec_form("CMD"))  # type: ignore[call-overload]
    assert command[0] == "serve", command
    env = {**dockerfile.env(), **{str(k): str(v) for k, v in dict((service or {}).get("environment") or {}).items()}}  # type: ignore[call-overload]
    return effective_config(command[1:], env)


def _host_port(address: str) -> tuple[str, int]:
    host, _, port = address.rpartition(":")
    return host.strip("[]"), int(port)


def _reachable_by_others(address: str, name: str) -> bool:
    """Whether another container of the stack reaches ``address`` as ``name``: it listens
    on every interface (or on the name itself), not on the container's loopback."""
    return _host_port(address)[0] in ("0.0.0.0", "::", "", name)


def _scrape_targets(compose: dict[str, object], service: str) -> set[str]:
    prometheus = _service(compose, service)
    config_mount = next(str(v) for v in prometheus["volumes"] if "prometheus" in str(v) and ".yml" in str(v))  # type: ignore[attr-defined]
    config = YAML(typ="safe").load((ROOT / config_mount.split(":")[0]).read_text())
    return {t for job in config["scrape_configs"] for sc in job["static_configs"] for t in sc["targets"]}


def test_compose_file_matches_the_compose_spec() -> None:
    result = subprocess.run(
        [str(BIN / "check-jsonschema"), "--builtin-schema", "vendor.compose-spec", "docker-compose.yml"],
        cwd=ROOT,
        check=False,
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert result.returncode == 0, result.stdout + result.stderr


def test_compose_file_agrees_with_the_dockerfile(dockerfile: Dockerfile, compose: dict[str, object]) -> None:
    env = dockerfile.env()
    server = _service(compose, "querator")
    assert server["build"]["dockerfile"] == "Dockerfile"  # type: ignore[index]
    volumes = compose["volumes"]
    assert isinstance(volumes, dict)
    data_dir = env["QUERATOR_DATA_DIR"]
    assert json.loads(dockerfile.last("VOLUME")) == [data_dir]
    mounts = [str(v).split(":") for v in server["volumes"]]  # type: ignore[attr-defined]
    assert any(src in volumes and dst == data_dir for src, dst, *_ in mounts), "the data dir needs a named volume"
    image = _effective(dockerfile)
    assert _host_port(image.metrics_address)[0] == "127.0.0.1", "the image keeps metrics on its loopback"
    effective = _effective(dockerfile, server)
    assert _reachable_by_others(effective.metrics_address, "querator"), effective.metrics_address
    assert effective.data_dir == data_dir
    grpc_port, metrics_port = _host_port(effective.address)[1], _host_port(effective.metrics_address)[1]
    published = {int(str(p).rsplit(":", 1)[-1]) for p in server["ports"]}  # type: ignore[attr-defined]
    assert {grpc_port, metrics_port} <= published
    assert {grpc_port, metrics_port} <= {int(p) for p in dockerfile.last("EXPOSE").split()}

    prometheus = _service(compose, "prometheus")
    assert prometheus["depends_on"]["querator"]["condition"] == "service_healthy"  # type: ignore[index]
    assert f"querator:{metrics_port}" in _scrape_targets(compose, "prometheus")


def test_dockerfile_basics(dockerfile: Dockerfile) -> None:
    image = dockerfile.all("FROM")[-1]
    match = re.fullmatch(r"python:(\d+)\.(\d+)-slim(-\w+)?", image)
    assert match, f"base image {image!r} should be python:X.Y-slim"
    pyproject = tomllib.loads((ROOT / "server" / "pyproject.toml").read_text())
    floor = re.fullmatch(r">=(\d+)\.(\d+)", pyproject["project"]["requires-python"])
    assert floor and (int(match[1]), int(match[2])) >= (int(floor[1]), int(floor[2]))
    user = dockerfile.last("USER")
    assert user not in ("root", "0", "0:0"), "the server must not run as root"
    for copy in dockerfile.all("COPY"):
        *sources, _dest = copy.split()
        for source in sources:
            assert (ROOT / source).exists(), f"COPY source {source} is missing"
    for run in dockerfile.all("RUN"):
        check = subprocess.run(["bash", "-n", "-c", run], check=False, capture_output=True, text=True, timeout=10)
        assert check.returncode == 0, f"RUN {run!r}: {check.stderr}"
    command = dockerfile.exec_form("ENTRYPOINT") + dockerfile.exec_form("CMD")
    assert command == ["querator", "serve", "--address", IMAGE_GRPC]


class ImageProcess:
    """The image's command line, run here with the image's environment."""

    def __init__(self, dockerfile: Dockerfile, tmp_path: Path) -> None:
        self.grpc = f"127.0.0.1:{free_port()}"
        self.metrics_port = free_port()
        data_dir = tmp_path / "data"
        data_dir.mkdir(mode=0o700)
        swaps = {IMAGE_GRPC: self.grpc, IMAGE_METRICS: f"127.0.0.1:{self.metrics_port}"}
        image_env = dockerfile.env()
        image_env["QUERATOR_DATA_DIR"] = str(data_dir)
        image_env = {k: swaps.get(v, v) for k, v in image_env.items()}
        base = {k: v for k, v in os.environ.items() if not k.startswith("QUERATOR_")}
        self.env = {**base, **image_env, "PATH": f"{BIN}{os.pathsep}{os.environ.get('PATH', '')}"}
        self.command = [swaps.get(arg, arg) for arg in dockerfile.exec_form("ENTRYPOINT") + dockerfile.exec_form("CMD")]
        self.log = tmp_path / "server.log"
        with self.log.open("wb") as log:
            self.proc = subprocess.Popen(
                self.command, cwd=data_dir, env=self.env, stdin=subprocess.DEVNULL, stdout=log, stderr=log
            )

    def health_command(self, command: list[str]) -> list[str]:
        """A CMD-form health check as it would run in the container, aimed at this server."""
        assert command[0] == "python", "the health check runs the image's python"
        assert any(HEALTH_TARGET in arg for arg in command), f"the health check should dial {HEALTH_TARGET}"
        return [sys.executable, *(arg.replace(HEALTH_TARGET, self.grpc) for arg in command[1:])]

    def run_check(self, command: list[str]) -> int:
        return subprocess.run(
            self.health_command(command), env=self.env, check=False, capture_output=True, timeout=20
        ).returncode

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait(10)


@pytest.fixture
def image_process(dockerfile: Dockerfile, tmp_path: Path) -> Iterator[ImageProcess]:
    proc = ImageProcess(dockerfile, tmp_path)
    yield proc
    proc.stop()


def test_image_command_serves_is_healthy_and_stops_on_sigterm(
    image_process: ImageProcess, dockerfile: Dockerfile, compose: dict[str, object]
) -> None:
    proc = image_process
    channel = grpc.insecure_channel(proc.grpc)
    try:
        grpc.channel_ready_future(channel).result(timeout=20)
    except grpc.FutureTimeoutError:
        raise AssertionError(f"the image command did not start: {proc.log.read_text()}") from None

    healthcheck = _service(compose, "querator")["healthcheck"]
    compose_test = list(healthcheck["test"])  # type: ignore[index]
    assert compose_test[0] == "CMD"
    assert proc.run_check(dockerfile.healthcheck()) == 0
    assert proc.run_check(compose_test[1:]) == 0

    # The metrics endpoint comes from the image's ENV and follows the queue.
    stubs = Stubs(channel)
    stubs.create("boxed")
    stubs.produce("boxed", [b"1", b"2", b"3"])
    url = f"http://127.0.0.1:{proc.metrics_port}/metrics"

    def ready() -> str:
        with urllib.request.urlopen(url, timeout=5) as reply:
            body: str = reply.read().decode()
        return body

    assert 'querator_queue_items{queue="boxed",state="ready"} 3.0' in ready()
    leased = stubs.lease("boxed", batch_size=3)
    stubs.complete("boxed", leased.partition, [i.id for i in leased.items])
    assert 'querator_queue_items{queue="boxed",state="ready"} 0.0' in ready()
    channel.close()

    # docker stop: SIGTERM, a clean exit well inside the compose stop_grace_period.
    proc.proc.send_signal(signal.SIGTERM)
    assert proc.proc.wait(20) == 0, proc.log.read_text()
    assert proc.run_check(dockerfile.healthcheck()) != 0
    wait_until(lambda: proc.proc.poll() is not None, timeout=1)


def test_the_cluster_profile_runs_etcd_and_three_nodes_scraped_by_prometheus(
    dockerfile: Dockerfile, compose: dict[str, object]
) -> None:
    services = compose["services"]
    assert isinstance(services, dict)
    profiled = sorted(name for name, s in services.items() if "cluster" in s.get("profiles", []))
    assert profiled == ["etcd", "grafana-cluster", "node1", "node2", "node3", "prometheus-cluster"]
    # The single server's stack stays as it was: none of its services is in a profile.
    assert all(not services[name].get("profiles") for name in ("querator", "prometheus", "grafana"))
    single_health = services["querator"]["healthcheck"]["test"]
    ids, advertised, scraped = set(), set(), set()
    for name in ("node1", "node2", "node3"):
        node = services[name]
        config = _effective(dockerfile, node)  # every flag is one `querator serve` knows
        assert config.cluster == "etcd://etcd:2379/compose"
        assert config.advertise == f"{name}:{_host_port(config.address)[1]}"
        assert _reachable_by_others(config.address, name)
        ids.add(config.node_id)
        advertised.add(config.advertise)
        # Prometheus runs in a container of its own: the node's metrics must not be on
        # the node container's loopback.
        assert config.metrics_address, f"{name} serves no metrics"
        assert _reachable_by_others(config.metrics_address, name), f"{name} metrics on {config.metrics_address}"
        scraped.add(f"{name}:{_host_port(config.metrics_address)[1]}")
        assert node["depends_on"]["etcd"]["condition"] == "service_healthy"
        assert node["healthcheck"]["test"] == single_health
        assert any(str(v).endswith(f":{config.data_dir}") for v in node["volumes"])
    assert len(ids) == 3 and len(advertised) == 3
    assert _scrape_targets(compose, "prometheus-cluster") == scraped
