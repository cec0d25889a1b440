"""The SDK's module graph: no import runs in a circle, TYPE_CHECKING imports included."""

from __future__ import annotations

import ast
import re
from pathlib import Path

import querator

from import_graph import find_cycle

PACKAGE = Path(querator.__file__).parent


def _imports() -> dict[str, set[str]]:
    graph: dict[str, set[str]] = {}
    for path in PACKAGE.rglob("*.py"):
        parts = path.relative_to(PACKAGE.parent).with_suffix("").parts
        if parts[1:2] == ("v1",):
            continue  # generated code
        module = ".".join(parts[:-1] if parts[-1] == "__init__" else parts)
        package = module.split(".") if parts[-1] == "__init__" else module.split(".")[:-1]
        deps: set[str] = set()
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.ImportFrom) and node.level:
                base = package[: len(package) - (node.level - 1)]
                target = ".".join([*base, node.module]) if node.module else ".".join(base)
                if node.module:  # ``from . import x``: the package is this module's parent, loaded first
                    deps.add(target)
                # ``from .pkg import module`` imports the module itself, not only the package
                # (names that are not modules are dropped: they are not in the graph).
                deps.update(f"{target}.{alias.name}" for alias in node.names)
        graph[module] = {d for d in deps if not d.startswith("querator.v1")}
    return graph


def test_the_sdk_has_no_importfind_cycle() -> None:
    graph = _imports()
    assert "querator._items" in graph and "querator.cli._app" in graph  # the walk saw the modules
    assert find_cycle(graph) is None, " -> ".join(find_cycle(graph) or [])


def test_a_module_imported_from_its_package_is_an_edge() -> None:
    """``from .._worker import runner`` hid a circle (runner -> cli -> cli.worker -> runner)
    while only the package was counted as the import."""
    assert "querator.cli.worker" in _imports()["querator.cli._app"]  # from . import ..., worker


def test_a_cycle_would_be_found() -> None:
    assert find_cycle({"a": {"b"}, "b": {"c"}, "c": {"a"}}) == ["a", "b", "c", "a"]


def test_producers_reach_their_client_only_through_its_transport() -> None:
    text = (PACKAGE / "_producer.py").read_text()
    private = set(re.findall(r"client\._(\w+)", text))
    assert private == {"transport"}
