"""docs/api.md is exactly what scripts/gen_api_docs.py makes of the proto comments."""

from __future__ import annotations

import importlib.util
import re
from pathlib import Path
from types import ModuleType

ROOT = Path(__file__).resolve().parents[2]


def _generator() -> ModuleType:
    spec = importlib.util.spec_from_file_location("gen_api_docs", ROOT / "scripts" / "gen_api_docs.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_committed_api_reference_is_up_to_date() -> None:
    expected = _generator().generate()
    actual = (ROOT / "docs" / "api.md").read_text()
    assert actual == expected, (
        "docs/api.md differs from the proto comments: run ./dev gen (or .venv/bin/python "
        "scripts/gen_api_docs.py) and commit docs/api.md"
    )


def test_every_rpc_and_message_of_the_protos_is_in_the_reference() -> None:
    text = _generator().generate()
    for proto in sorted((ROOT / "proto" / "querator" / "v1").glob("*.proto")):
        source = proto.read_text()
        for service in re.findall(r"^service (\w+)", source, re.MULTILINE):
            assert f"### {service}\n" in text
        for rpc in re.findall(r"^\s*rpc (\w+)\(", source, re.MULTILINE):
            assert re.search(rf"^#### \w+\.{rpc}$", text, re.MULTILINE), rpc
        for message in re.findall(r"^message (\w+)", source, re.MULTILINE):
            assert f"### {message}\n" in text, message
    # Comments made it, and cross-references link to anchors that exist.
    assert "The most items to return, 1 to 1,000." in text
    anchors = {
        re.sub(r"[^a-z0-9_-]", "", h.lower().replace(" ", "-")) for h in re.findall(r"^#+ (.+)$", text, re.MULTILINE)
    }
    for target in re.findall(r"\]\(#([^)]+)\)", text):
        assert target in anchors, target
