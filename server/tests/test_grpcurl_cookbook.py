"""docs/grpcurl.md, run: every ```sh block in order, in one bash, with the real grpcurl.

The rules (also at the end of the page): a ```json block right after a command is its
sample output (the real output must hold every key of the sample, lists as long, and
the same UPPER_CASE enum values); a ```text block right after is checked line by line
("..." skips); ``<!-- cookbook: exit N -->`` before a block expects exit code N.
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

from conftest import ThreadServer

ROOT = Path(__file__).resolve().parents[2]
PAGE = ROOT / "docs" / "grpcurl.md"
DOC_ADDRESS = "127.0.0.1:2319"
_FENCE = re.compile(
    r"^(?:<!-- (?:cookbook: exit (\d+)|(walkthrough)) -->\n)?```(\w*)\n(.*?)^```$", re.MULTILINE | re.DOTALL
)


@dataclass
class Step:
    line: int
    script: str
    exit_code: int = 0
    sample_kind: str = ""
    sample: str = ""


def steps(text: str, *, marked_only: bool = False) -> list[Step]:
    """The commands of a page; with ``marked_only``, only blocks marked ``<!-- walkthrough -->``."""
    out: list[Step] = []
    for match in _FENCE.finditer(text):
        exit_code, marked, lang, body = match.groups()
        line = text.count("\n", 0, match.start()) + 1
        if lang == "sh" and (marked or not marked_only):
            out.append(Step(line, body, int(exit_code or 0)))
        elif lang in ("json", "text") and out and not out[-1].sample_kind:
            # A sample belongs to the command just above it, with only prose between.
            between = text[text.rfind("```", 0, match.start() - 1) : match.start()]
            if "```sh" not in between:
                out[-1].sample_kind, out[-1].sample = lang, body
    return out


def _json_documents(text: str) -> list[object]:
    decoder, docs, i = json.JSONDecoder(), [], 0
    while i < len(text):
        if text[i].isspace():
            i += 1
            continue
        value, i = decoder.raw_decode(text, i)
        docs.append(value)
    return docs


def _holds(actual: object, sample: object, path: str) -> list[str]:
    if isinstance(sample, dict):
        if not isinstance(actual, dict):
            return [f"{path}: expected an object, got {actual!r}"]
        problems = []
        for key, value in sample.items():
            if key not in actual:
                problems.append(f"{path}.{key}: missing")
            else:
                problems += _holds(actual[key], value, f"{path}.{key}")
        return problems
    if isinstance(sample, list):
        if not isinstance(actual, list) or len(actual) != len(sample):
            return [f"{path}: expected {len(sample)} entries, got {actual!r}"]
        return [p for i, (a, s) in enumerate(zip(actual, sample)) for p in _holds(a, s, f"{path}[{i}]")]
    if isinstance(sample, str) and re.fullmatch(r"[A-Z][A-Z_]+", sample) and actual != sample:
        return [f"{path}: expected {sample}, got {actual!r}"]
    return []


def check_output(step: Step, stdout: str, stderr: str) -> None:
    where = f"line {step.line}"
    if step.sample_kind == "json":
        docs = _json_documents(stdout)
        assert len(docs) == 1, f"{where}: expected one JSON reply, got: {stdout!r}"
        problems = _holds(docs[0], json.loads(step.sample), "$")
        assert not problems, f"{where}: output {stdout} does not match the sample: {problems}"
    elif step.sample_kind == "text":
        lines = {line.strip() for line in (stdout + stderr).splitlines()}
        for wanted in step.sample.splitlines():
            if wanted.strip() and wanted.strip() != "...":
                assert wanted.strip() in lines, f"{where}: {wanted.strip()!r} not in output:\n{stdout}{stderr}"


def run_steps(found: list[Step], substitutions: dict[str, str], tmp_path: Path, page: str) -> None:
    """Run ``found`` in order in one bash, each block's output, errors and exit code to files."""
    out = tmp_path / "out"
    out.mkdir()
    script = ["set -euo pipefail"]
    for i, step in enumerate(found):
        body = step.script
        for old, new in substitutions.items():
            body = body.replace(old, new)
        capture = f'>"{out}/{i}.out" 2>"{out}/{i}.err"'
        if step.exit_code:
            script += ["set +e", f"{{\n{body}\n}} {capture}", f'echo $? >"{out}/{i}.rc"', "set -e"]
        else:
            script += [f"{{\n{body}\n}} {capture}", f'echo 0 >"{out}/{i}.rc"']
    env = {k: v for k, v in os.environ.items() if not k.startswith("QUERATOR_")}
    env["PATH"] = f"{Path(sys.executable).parent}{os.pathsep}{env.get('PATH', '')}"
    run = subprocess.run(
        ["bash", "-c", "\n".join(script)],
        check=False,
        cwd=tmp_path,
        env=env,
        stdin=subprocess.DEVNULL,
        capture_output=True,
        text=True,
        timeout=120,
    )
    for i, step in enumerate(found):
        rc_file = out / f"{i}.rc"
        stdout = (out / f"{i}.out").read_text() if (out / f"{i}.out").exists() else ""
        stderr = (out / f"{i}.err").read_text() if (out / f"{i}.err").exists() else ""
        assert rc_file.exists(), (
            f"{page} line {step.line} failed (bash exit {run.returncode}):\n{step.script}\n"
            f"stdout: {stdout}\nstderr: {stderr}{run.stderr}"
        )
        code = int(rc_file.read_text())
        assert code == step.exit_code, f"{page} line {step.line}: exit {code}, expected {step.exit_code}"
        try:
            check_output(step, stdout, stderr)
        except AssertionError as exc:
            raise AssertionError(f"{page}: {exc}") from None
    assert run.returncode == 0, run.stderr


def test_cookbook_runs_in_order(server: ThreadServer, tmp_path: Path) -> None:
    text = PAGE.read_text()
    cookbook = steps(text)
    assert len(cookbook) >= 20, "the cookbook lost its commands?"
    covered = "\n".join(s.script for s in cookbook)
    for needed in (
        " list",
        " describe ",
        "QueuesService/CreateQueue",
        '"utf8"',
        '"payload"',
        "QueueService/Produce",
        "QueueService/Lease",
        "QueueService/Complete",
        "QueueService/Retry",
        "QueueService/Extend",
        "QueuesService/GetQueueStats",
        "grpc.health.v1.Health/Check",
    ):
        assert needed in covered, f"the cookbook should show {needed.strip()}"

    run_steps(cookbook, {DOC_ADDRESS: server.address}, tmp_path, "docs/grpcurl.md")


def test_cookbook_parser_finds_samples_and_exit_codes() -> None:
    page = (
        "```sh\necho hi\n```\n"
        'prose\n```json\n{"a": 1}\n```\n'
        "<!-- cookbook: exit 3 -->\n```sh\nexit 3\n```\n"
        "```text\nERROR\n```\n"
        "```sh\ntrue\n```"
    )
    found = steps(page)
    assert [(s.script.strip(), s.exit_code, s.sample_kind) for s in found] == [
        ("echo hi", 0, "json"),
        ("exit 3", 3, "text"),
        ("true", 0, ""),
    ]
    assert _holds({"a": 1, "b": [1, 2]}, {"a": 5, "b": [0, 0]}, "$") == []
    assert _holds({"status": "NOT_SERVING"}, {"status": "SERVING"}, "$") != []
    assert _holds({"a": []}, {"a": [1]}, "$") != []
