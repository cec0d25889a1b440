"""The server's house: its layers (grpc_api -> cluster -> manager -> actor -> storage),
no import running back up them or in a circle, and one basename per module."""

from __future__ import annotations

import ast
from collections import Counter
from pathlib import Path

import querator_server

from import_graph import find_cycle

PACKAGE = Path(querator_server.__file__).parent
NAME = PACKAGE.name

# Each top-level module or package and its floor: a module imports only from its own
# floor or below. Floor 0 holds the leaves every floor may use (no import of ours
# beyond floor 0 either).
FLOORS = {
    "errors": 0, "clock": 0, "model": 0, "logging": 0, "faults": 0, "settled": 0, "auth": 0, "config": 0,
    "backup": 0, "reflection": 0,
    "storage": 1,
    "actor": 2,
    "queue_admin": 3, "manager": 3,
    "cluster": 4,
    "grpc_api": 5, "metrics": 5,
    "server": 6, "cli": 6,
}  # fmt: skip


def _imports() -> dict[str, set[str]]:
    """Module -> the modules of ours it imports (TYPE_CHECKING imports included)."""
    graph: dict[str, set[str]] = {}
    for path in PACKAGE.rglob("*.py"):
        parts = path.relative_to(PACKAGE.parent).with_suffix("").parts
        module = ".".join(parts[:-1] if parts[-1] == "__init__" else parts)
        package = module.split(".") if parts[-1] == "__init__" else module.split(".")[:-1]
        deps: set[str] = set()
        for node in ast.walk(ast.parse(path.read_text())):
            if not isinstance(node, ast.ImportFrom):
                continue
            if node.level:
                base = package[: len(package) - (node.level - 1)]
                target = ".".join([*base, node.module]) if node.module else ".".join(base)
            elif node.module and node.module.split(".")[0] == NAME:
                target = node.module
            else:
                continue
            if node.module:  # ``from . import x``: the package is this module's parent, loaded first
                deps.add(target)
            deps.update(f"{target}.{alias.name}" for alias in node.names)
        graph[module] = deps
    return {m: {d for d in deps if d in graph and d != m} for m, deps in graph.items()}


def _floor(module: str) -> int:
    top = module.split(".")[1] if "." in module else ""
    return FLOORS[top] if top else 6


def _without_package_inits(graph: dict[str, set[str]]) -> dict[str, set[str]]:
    """Edges into a package's __init__ from its own modules are the import system's
    order (a parent loads first), not a dependency of the module."""
    return {m: {d for d in deps if not m.startswith(d + ".")} for m, deps in graph.items()}


def test_every_module_has_a_floor() -> None:
    tops = {m.split(".")[1] for m in _imports() if "." in m}
    assert tops <= set(FLOORS), sorted(tops - set(FLOORS))


def test_no_import_runs_back_up_the_floors() -> None:
    upward = [
        f"{m} (floor {_floor(m)}) imports {d} (floor {_floor(d)})"
        for m, deps in _imports().items()
        for d in deps
        if _floor(d) > _floor(m)
    ]
    assert not upward, "\n".join(sorted(upward))


def test_no_import_circle() -> None:
    graph = _without_package_inits(_imports())
    assert find_cycle(graph) is None, " -> ".join(find_cycle(graph) or [])


def test_the_checks_would_fail() -> None:
    assert find_cycle({"a": {"b"}, "b": {"c"}, "c": {"a"}}) == ["a", "b", "c", "a"]
    assert _floor(f"{NAME}.grpc_api.handlers") > _floor(f"{NAME}.manager") > _floor(f"{NAME}.storage.lane")


def test_no_two_modules_share_a_basename() -> None:
    names = Counter(p.name for p in PACKAGE.rglob("*.py") if p.name != "__init__.py")
    assert not [n for n, count in names.items() if count > 1], sorted(n for n, count in names.items() if count > 1)
