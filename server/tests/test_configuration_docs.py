"""docs/configuration.md names every `querator serve` flag and every QUERATOR_* variable."""

from __future__ import annotations

import argparse
import re
from pathlib import Path

from querator_server.cli import add_serve_arguments

ROOT = Path(__file__).resolve().parents[2]


def test_every_serve_flag_is_documented() -> None:
    page = (ROOT / "docs" / "configuration.md").read_text()
    parser = argparse.ArgumentParser()
    add_serve_arguments(parser)
    flags = [s for action in parser._actions for s in action.option_strings if s.startswith("--") and s != "--help"]
    assert "--metrics-address" in flags
    missing = [flag for flag in flags if f"`{flag}" not in page]
    assert not missing, f"docs/configuration.md does not describe {missing}"


def test_every_environment_variable_is_documented() -> None:
    page = (ROOT / "docs" / "configuration.md").read_text()
    sources = [*ROOT.joinpath("server", "src").rglob("*.py"), *ROOT.joinpath("clients", "python", "src").rglob("*.py")]
    sources += [ROOT / "Dockerfile"]
    names = {name for path in sources for name in re.findall(r"\bQUERATOR_[A-Z_]+[A-Z]\b", path.read_text())}
    assert {"QUERATOR_ADDRESS", "QUERATOR_DATA_DIR", "QUERATOR_METRICS_ADDRESS"} <= names
    missing = sorted(name for name in names if f"`{name}`" not in page)
    assert not missing, f"docs/configuration.md does not describe {missing}"
