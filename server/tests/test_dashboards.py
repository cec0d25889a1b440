"""The Grafana dashboard and the Prometheus alert rules of deploy/, checked.

- ``promtool`` (Debian's ``prometheus`` package; ``./dev test`` installs it when it
  can): the rules and both Prometheus configurations pass ``promtool check``, the
  rules' unit tests pass ``promtool test rules``, and every expression of the dashboard
  parses as PromQL (run as recording rules through ``promtool check rules``). Without
  promtool these tests skip, and fail when CI=true.
- Every metric name the dashboard and the rules read is one a real server exports:
  a ``querator serve`` and a three-node ``--cluster`` are given traffic (produce,
  lease, complete, retry, dead letters), their /metrics scraped, and the names
  compared (promql_names.py finds the names; its docstring says what it cannot do).
- The compose stack provisions them: Grafana's datasource points at the stack's
  Prometheus, its dashboard folder is the one mounted, and Prometheus mounts the rules.
- The cluster gauges the dashboard shows follow a node's death.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import time
import urllib.request
from collections.abc import Iterator
from pathlib import Path

import grpc
import pytest
from cluster_helpers import Cluster, etcd_binary
from prometheus_client.parser import text_string_to_metric_families
from promql_names import PromQLNameError, metric_names, names_in_grafana_query
from ruamel.yaml import YAML

from querator.v1 import queue_pb2
from querator_server.metrics import LOOP_LAG_INTERVAL_S

from conftest import ProcessServer, Stubs, free_port, wait_until

ROOT = Path(__file__).resolve().parents[2]
DEPLOY = ROOT / "deploy"
RULES = DEPLOY / "querator-alerts.yml"
RULE_TESTS = DEPLOY / "querator-alerts.test.yml"
DASHBOARD = DEPLOY / "grafana" / "dashboards" / "querator.json"
DATASOURCES = DEPLOY / "grafana" / "provisioning" / "datasources" / "prometheus.yml"
DASHBOARD_PROVIDERS = DEPLOY / "grafana" / "provisioning" / "dashboards" / "querator.yml"
# Series Prometheus itself adds to every scrape target, not the server.
PROMETHEUS_OWN = {"up"}
# Exported by cluster nodes only.
CLUSTER_ONLY = re.compile(r"^querator_cluster_")
# Grafana's interval variables stand for durations; the others are label values.
DURATION_VARIABLES = {"__rate_interval", "__interval", "__range"}

yaml = YAML(typ="safe")


# -- the files -----------------------------------------------------------------------


def _dashboard() -> dict[str, object]:
    data = json.loads(DASHBOARD.read_text())
    assert isinstance(data, dict)
    return data


def _panels() -> list[dict[str, object]]:
    panels = _dashboard()["panels"]
    assert isinstance(panels, list)
    return [p for p in panels if p["type"] != "row"]


def _dashboard_expressions() -> list[tuple[str, str]]:
    """(where, expression) of every panel target."""
    return [(f"panel {p['title']!r} {t['refId']}", t["expr"]) for p in _panels() for t in p["targets"]]  # type: ignore[attr-defined]


def _variable_queries() -> list[tuple[str, str]]:
    variables = _dashboard()["templating"]["list"]  # type: ignore[index]
    return [(f"variable {v['name']}", v["query"]["query"]) for v in variables if v["type"] == "query"]


def _rule_expressions() -> list[tuple[str, str]]:
    groups = yaml.load(RULES.read_text())["groups"]
    return [(f"rule {r['alert']}", str(r["expr"])) for g in groups for r in g["rules"]]


def _used_names() -> dict[str, set[str]]:
    """Each metric name the dashboard and the rules read, and where."""
    used: dict[str, set[str]] = {}
    for where, expr in _dashboard_expressions() + _rule_expressions():
        for name in metric_names(expr):
            used.setdefault(name, set()).add(where)
    for where, query in _variable_queries():
        for name in names_in_grafana_query(query):
            used.setdefault(name, set()).add(where)
    return used


def _substituted(expr: str) -> str:
    """``expr`` with Grafana's variables replaced as Grafana would: durations, regexes."""
    return re.sub(
        r"\$\{?(\w+)\}?", lambda m: "1m" if m.group(1) in DURATION_VARIABLES else ".*", expr
    )


# -- promtool ------------------------------------------------------------------------


@pytest.fixture(scope="module")
def promtool() -> str:
    found = shutil.which("promtool")
    if found:
        return found
    message = "promtool not found: ./dev test installs it (Debian: apt-get install prometheus) when it can"
    if os.environ.get("CI") == "true":
        pytest.fail(message)
    pytest.skip(message)


def _promtool(promtool: str, *args: str, cwd: Path = DEPLOY) -> str:
    result = subprocess.run([promtool, *args], cwd=cwd, capture_output=True, text=True, timeout=60, check=False)
    assert result.returncode == 0, f"promtool {' '.join(args)}:\n{result.stdout}{result.stderr}"
    return result.stdout + result.stderr


def test_the_rules_and_the_prometheus_configurations_pass_promtool(promtool: str) -> None:
    out = _promtool(promtool, "check", "rules", RULES.name)
    assert f"SUCCESS: {len(_rule_expressions())} rules found" in out
    for config in ("prometheus.yml", "prometheus-cluster.yml"):
        out = _promtool(promtool, "check", "config", config)
        assert "SUCCESS: 1 rule files found" in out, out  # the config loads the rules


def test_the_rules_unit_tests_pass(promtool: str) -> None:
    out = _promtool(promtool, "test", "rules", RULE_TESTS.name)
    assert "SUCCESS" in out
    tests = yaml.load(RULE_TESTS.read_text())
    assert tests["rule_files"] == [RULES.name]
    fired = {case["alertname"] for test in tests["tests"] for case in test["alert_rule_test"] if case["exp_alerts"]}
    quiet = {case["alertname"] for test in tests["tests"] for case in test["alert_rule_test"] if not case["exp_alerts"]}
    assert len(fired) >= 2 and fired <= quiet, (fired, quiet)  # each alert seen firing, and not firing


def test_every_dashboard_expression_parses_as_promql(promtool: str, tmp_path: Path) -> None:
    """Prometheus's own parser reads each expression, as a recording rule of a file made here."""
    expressions = _dashboard_expressions()
    for where, query in _variable_queries():
        inner = re.fullmatch(r"\s*label_values\((.*),\s*\w+\)\s*", query, re.S)
        if inner:
            expressions.append((where, inner.group(1)))
    assert len(expressions) >= 30
    rules = [{"record": f"dashboard:expression_{i}", "expr": _substituted(expr)} for i, (_, expr) in enumerate(expressions)]
    path = tmp_path / "dashboard-expressions.yml"
    path.write_text(json.dumps({"groups": [{"name": "dashboard", "rules": rules}]}))
    out = _promtool(promtool, "check", "rules", str(path), cwd=tmp_path)
    assert f"SUCCESS: {len(rules)} rules found" in out


# -- the dashboard and the compose stack -------------------------------------------------


def test_the_dashboard_is_well_formed() -> None:
    dashboard = _dashboard()
    panels = dashboard["panels"]
    assert isinstance(panels, list)
    ids = [p["id"] for p in panels]
    assert len(ids) == len(set(ids)), "panel ids must be unique"
    titles = {p["title"] for p in panels if p["type"] == "row"}
    assert titles == {"Queues", "Server", "Cluster"}
    variables = {v["name"]: v for v in dashboard["templating"]["list"]}  # type: ignore[index]
    assert variables["datasource"]["type"] == "datasource" and variables["datasource"]["query"] == "prometheus"
    for panel in _panels():
        grid = panel["gridPos"]
        assert 0 <= grid["x"] and grid["x"] + grid["w"] <= 24, panel["title"]  # type: ignore[index,operator]
        assert panel["datasource"] == {"type": "prometheus", "uid": "${datasource}"}, panel["title"]
        assert panel["targets"] and panel["description"], panel["title"]
        for target in panel["targets"]:  # type: ignore[attr-defined]
            assert target["datasource"] == panel["datasource"], panel["title"]


def test_the_compose_stack_provisions_the_dashboard_and_loads_the_rules() -> None:
    compose = yaml.load((ROOT / "docker-compose.yml").read_text())
    services = compose["services"]
    datasource = yaml.load(DATASOURCES.read_text())["datasources"][0]
    assert datasource["type"] == "prometheus" and datasource["url"] == "${PROMETHEUS_URL}"
    dashboards_path = yaml.load(DASHBOARD_PROVIDERS.read_text())["providers"][0]["options"]["path"]
    for grafana, prometheus in (("grafana", "prometheus"), ("grafana-cluster", "prometheus-cluster")):
        service = services[grafana]
        mounts = {Path(src).resolve().relative_to(ROOT).as_posix(): dst for src, dst, *_ in (str(v).split(":") for v in service["volumes"]) if src.startswith(".")}
        assert mounts["deploy/grafana/provisioning"] == "/etc/grafana/provisioning"
        assert mounts["deploy/grafana/dashboards"] == dashboards_path
        assert service["environment"]["GF_DASHBOARDS_DEFAULT_HOME_DASHBOARD_PATH"] == f"{dashboards_path}/{DASHBOARD.name}"
        # The datasource is the Prometheus of the same stack, at its container port.
        container_ports = {str(p).rsplit(":", 1)[-1] for p in services[prometheus]["ports"]}
        assert service["environment"]["PROMETHEUS_URL"] in {f"http://{prometheus}:{port}" for port in container_ports}
        assert all(str(p).startswith("127.0.0.1:") for p in service["ports"]), "Grafana on the host's loopback only"
        assert service.get("profiles") == services[prometheus].get("profiles")
        # Prometheus mounts the rules beside its configuration, which names them.
        volumes = [str(v).split(":") for v in services[prometheus]["volumes"]]
        config_src, config_dst = next((src, dst) for src, dst, *_ in volumes if dst == "/etc/prometheus/prometheus.yml")
        config = yaml.load((ROOT / config_src).read_text())
        for rule_file in config["rule_files"]:
            target = str(Path(config_dst).parent / rule_file)
            assert [src for src, dst, *_ in volumes if dst == target] == [f"./deploy/{RULES.name}"], target


# -- the names a real server exports ---------------------------------------------------


def _scrape(address: str) -> str:
    with urllib.request.urlopen(f"http://{address}/metrics", timeout=10) as reply:
        return str(reply.read().decode())


def _exported(text: str) -> set[str]:
    """The names of the samples of a scrape (a histogram's _bucket, _sum, _count)."""
    return {sample.name for family in text_string_to_metric_families(text) for sample in family.samples}


def _traffic(stubs: Stubs, queue: str, partitions: int = 1) -> None:
    """What a working system does, a dead letter included, so that every labelled series exists."""
    stubs.create(f"{queue}-dlq")
    stubs.create(queue, dead_queue=f"{queue}-dlq", requested_partitions=partitions)
    for _ in range(3):
        stubs.produce(queue, [b"a", b"b", b"c", b"d"])
    seen = 0
    for _ in range(20):  # bounded: 12 items
        leased = stubs.lease(queue, batch_size=10, timeout=10)
        if not leased.items:
            break
        ids = [item.id for item in leased.items]
        seen += len(ids)
        half = len(ids) // 2
        stubs.complete(queue, leased.partition, ids[:half])
        items = [queue_pb2.RetryItem(id=i, dead=True) for i in ids[half:]]
        stubs.queue.Retry(queue_pb2.RetryRequest(queue_name=queue, partition=leased.partition, items=items), timeout=10)
    assert seen == 12
    with pytest.raises(grpc.RpcError):  # a call answered with an error code
        stubs.produce("no-such-queue", [b"x"])


@pytest.fixture(scope="module")
def single_node_names(tmp_path_factory: pytest.TempPathFactory) -> set[str]:
    metrics = f"127.0.0.1:{free_port()}"
    server = ProcessServer(str(tmp_path_factory.mktemp("single")), ["--metrics-address", metrics])
    server.start()
    try:
        with grpc.insecure_channel(server.address) as channel:
            _traffic(Stubs(channel), "dash")
        # The loop-lag timer has ticked at least once.
        time.sleep(LOOP_LAG_INTERVAL_S * 3)
        return _exported(_scrape(metrics))
    finally:
        server.stop()


@pytest.fixture(scope="module")
def cluster(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Cluster]:
    if not etcd_binary():
        message = "etcd not found: the cluster half of this check needs it"
        if os.environ.get("CI") == "true":
            pytest.fail(message)
        pytest.skip(message)
    with Cluster(str(tmp_path_factory.mktemp("cluster")), metrics=True) as started:
        yield started


@pytest.fixture(scope="module")
def cluster_names(cluster: Cluster) -> set[str]:
    _traffic(cluster.nodes[0].stubs, "dash", partitions=6)
    time.sleep(LOOP_LAG_INTERVAL_S * 3)
    names: set[str] = set()
    for node in cluster.nodes:  # Prometheus scrapes every node: what one exports counts
        names |= _exported(_scrape(node.metrics_address))
    return names


def test_every_metric_name_of_the_dashboard_and_the_rules_is_exported(
    single_node_names: set[str], cluster_names: set[str]
) -> None:
    used = _used_names()
    assert len(used) >= 25
    assert PROMETHEUS_OWN <= set(used)
    server_names = {name for name in used if name not in PROMETHEUS_OWN}
    missing = {name: sorted(used[name]) for name in server_names if name not in cluster_names}
    assert not missing, f"used, but not exported by a cluster node: {missing}"
    missing = {name: sorted(used[name]) for name in server_names if name not in single_node_names and not CLUSTER_ONLY.match(name)}
    assert not missing, f"used, but not exported by a single server: {missing}"
    assert not {n for n in single_node_names if CLUSTER_ONLY.match(n)}, "a single server exports no cluster gauges"
    assert {n for n in server_names if CLUSTER_ONLY.match(n)} <= cluster_names


def _gauges(address: str) -> dict[str, float]:
    return {
        sample.name: sample.value
        for family in text_string_to_metric_families(_scrape(address))
        for sample in family.samples
        if not sample.labels
    }


def test_the_cluster_gauges_follow_a_node_killed(cluster: Cluster, cluster_names: set[str]) -> None:
    """Members 3, nothing down; once a node is killed and its membership has lapsed, the
    others count 2 members and its partitions as down. Runs last: it kills a node."""
    first, second, victim = cluster.nodes
    for node in cluster.nodes:
        gauges = _gauges(node.metrics_address)
        assert (gauges["querator_cluster_members"], gauges["querator_cluster_fenced"]) == (3, 0), node.node_id
        assert gauges["querator_cluster_partitions_down"] == 0, node.node_id
        assert gauges["querator_event_loop_lag_seconds_count"] >= 1, node.node_id
    homed = sum(home == victim.node_id for queue in first.info().queues for home in queue.homes)
    assert homed > 0, "the victim homes some of the queue's 6 partitions"
    victim.kill9()
    for node in (first, second):
        wait_until(
            lambda node=node: _gauges(node.metrics_address)["querator_cluster_members"] == 2,  # type: ignore[misc]
            timeout=cluster.ttl * 5,
        )
        assert _gauges(node.metrics_address)["querator_cluster_partitions_down"] == homed, node.node_id


# -- the tokenizer ---------------------------------------------------------------------


@pytest.mark.parametrize(
    ("expr", "names"),
    [
        ('sum by (le, method) (rate(a_bucket{method!~"Lease|x"}[$__rate_interval]))', {"a_bucket"}),
        ("histogram_quantile(0.99, sum without (pod) (rate(b[5m:30s])))", {"b"}),
        ("a offset 1h30m + on (instance) group_left (node) b > bool 1e3 and c unless Inf", {"a", "b", "c"}),
        ('{__name__="d", job="x"} / {"utf8.name"} # a comment naming e', {"d", "utf8.name"}),
        ('label_replace(f, "dst", "$1", "src", "(.*)") or vector(0)', {"f"}),
        ('count_values("v", g) * topk(5, h) - SUM BY (q) (i)', {"g", "h", "i"}),
        ("j:recorded:rate5m @ start()", {"j:recorded:rate5m"}),
    ],
)
def test_the_tokenizer_finds_the_metric_names(expr: str, names: set[str]) -> None:
    assert metric_names(expr) == names


@pytest.mark.parametrize("expr", ['{__name__=~"querator_.*"}', "$metric", "sum(${metric})", "rate(x[5m)"])
def test_the_tokenizer_refuses_what_it_cannot_tell(expr: str) -> None:
    with pytest.raises(PromQLNameError):
        metric_names(expr)


def test_grafana_variable_queries() -> None:
    assert names_in_grafana_query('label_values(k{job=~"$job"}, instance)') == {"k"}
    assert names_in_grafana_query("label_values(job)") == set()
    with pytest.raises(PromQLNameError):
        names_in_grafana_query("metrics(querator_.*)")
