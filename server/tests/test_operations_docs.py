"""docs/operations.md: the drain walkthrough runs against a real server with metrics, and
the commands it shows match the files they describe."""

from __future__ import annotations

import re
from collections.abc import Iterator
from pathlib import Path

import pytest
from ruamel.yaml import YAML
from test_grpcurl_cookbook import run_steps, steps

from conftest import ThreadServer

ROOT = Path(__file__).resolve().parents[2]
PAGE = ROOT / "docs" / "operations.md"


@pytest.fixture
def metered(data_dir: str) -> Iterator[ThreadServer]:
    server = ThreadServer(data_dir, metrics_address="127.0.0.1:0")
    yield server
    server.stop()


def test_drain_walkthrough_shows_the_depth_moving(metered: ThreadServer, tmp_path: Path) -> None:
    walkthrough = steps(PAGE.read_text(), marked_only=True)
    assert len(walkthrough) == 2 and all(s.sample_kind == "text" for s in walkthrough)
    substitutions = {
        "127.0.0.1:2319": metered.address,
        "http://127.0.0.1:9090": f"http://127.0.0.1:{metered.server.metrics.port}",
    }
    run_steps(walkthrough, substitutions, tmp_path, "docs/operations.md")


def test_health_check_command_is_the_images() -> None:
    page = PAGE.read_text()
    shown = re.search(r'^python -c "(.*)"$', page, re.MULTILINE)
    assert shown, "operations.md should show the health-check command"
    compose = YAML(typ="safe").load((ROOT / "docker-compose.yml").read_text())
    assert compose["services"]["querator"]["healthcheck"]["test"] == ["CMD", "python", "-c", shown[1]]
    assert f'"{shown[1]}"' in (ROOT / "Dockerfile").read_text()


def test_every_metric_is_documented() -> None:
    page = PAGE.read_text()
    source = (ROOT / "server" / "src" / "querator_server" / "metrics.py").read_text()
    names = set(re.findall(r'"(querator_[a-z_]+)"', source))
    assert len(names) >= 15
    for name in names:
        counter = f"{name}_total"
        assert f"`{name}`" in page or f"`{counter}`" in page, f"{name} is not in docs/operations.md"


def test_backup_command_shown_is_the_module() -> None:
    page = PAGE.read_text()
    assert "python -m querator_server.backup ./querator-data " in page
    assert (ROOT / "server" / "src" / "querator_server" / "backup.py").exists()
