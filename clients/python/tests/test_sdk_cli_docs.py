"""Every ``querator`` command the docs show, as written.

The shell blocks of README.md and docs/*.md run line by line in bash, against a real
``querator serve`` started from the docs' own ``querator serve`` lines (or a plain one),
with the ids and key ids the docs write as ``<ID>``/``<KEY_ID>`` taken from the output
of the command before, as a reader would. The synopsis block of docs/sdk.md is made
concrete (each placeholder a sample value, each alternative in turn, every optional
part given) and parsed by the command line itself: the order it shows must be accepted.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import shlex
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path

import pytest

import querator
from querator.cli import build_parser, parse
from querator.testing import make_certificates

ROOT = Path(__file__).resolve().parents[3]
DOCS = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
BIN = Path(sys.executable).parent
ADMIN = "change-me"  # the bootstrap token docs/quickstart.md uses

_BLOCK = re.compile(r"^```(\w*)\n(.*?)^```", re.S | re.M)
_ASSIGN = r"(?:[A-Z_][A-Z0-9_]*=\S*\s+)*"
_RUNS_QUERATOR = re.compile(rf"^(?:{_ASSIGN}querator\s|export\s)|\|\s*querator\s|\$\(querator\s")


@dataclass
class Block:
    path: Path
    lang: str
    text: str

    @property
    def name(self) -> str:
        return f"{self.path.name}:{self.text.splitlines()[0][:50]}"


def blocks() -> list[Block]:
    out = []
    for path in DOCS:
        for match in _BLOCK.finditer(path.read_text()):
            lang, text = match.group(1), match.group(2)
            if lang not in ("python", "json", "yaml", "proto") and re.search(r"(^|[\s|(])querator\s+[a-z-]", text):
                out.append(Block(path, lang, text))
    return out


def logical_lines(text: str) -> list[str]:
    """Lines with their continuations (a trailing backslash or pipe) joined."""
    out: list[str] = []
    pending = ""
    for line in text.splitlines():
        pending = f"{pending} {line.strip()}" if pending else line.strip()
        if pending.endswith("\\"):
            pending = pending[:-1].rstrip()
            continue
        if re.search(r"\|\s*$", pending.split(" #")[0]):
            continue
        if pending:
            out.append(pending)
        pending = ""
    return out


def test_the_docs_show_commands_of_both_kinds() -> None:
    found = blocks()
    assert [b for b in found if b.lang == "sh"], "no shell block with querator commands found"
    assert [b for b in found if b.lang == ""], "the synopsis block of docs/sdk.md was not found"


# -- the synopsis: parsed as written -------------------------------------------------------------

SAMPLES = {
    "NAME": "jobs", "QUEUE": "jobs", "Q": "jobs-dlq", "R": "note", "N": "2", "PARTITION": "0",
    "PAYLOAD": "hello", "ID": "1a.0.2", "FILE": "items.jsonl", "K": "key-1", "E": "text/plain",
    "TIME": "2030-01-02T03:04:05Z", "D": "billing", "A": "127.0.0.1:2319", "L": "info",
    "PATTERN": "jobs*", "KEY_ID": "k1", "TOKEN": "t", "DLQ": "jobs-dlq", "NODE": "n3", "SET_ASIDE_ID": "jobs@7",
    "TEXT": "ValueError: bad row",
}  # fmt: skip


def _tokens(text: str) -> list[str]:
    return re.findall(r"\[|\]|\.\.\.|[^\s\[\]]+", text)


def _group(tokens: list[str], pos: int) -> tuple[list[list[str]], int]:
    """Alternatives (each a token list) up to the matching ``]`` or the end."""
    alternatives: list[list[str]] = [[]]
    while pos < len(tokens):
        token = tokens[pos]
        if token == "]":
            return alternatives, pos + 1
        if token == "|":
            alternatives.append([])
        elif token == "..." and alternatives[-1] and isinstance(alternatives[-1][-1], list):
            alternatives[-1].append(alternatives[-1][-1])  # a repeatable group: given twice
        elif token == "[":
            inner, pos = _group(tokens, pos + 1)
            alternatives[-1].append(inner)  # type: ignore[arg-type]
            continue
        else:
            alternatives[-1].append(token)
        pos += 1
    return alternatives, pos


def _choose(part: object, pick: int, out: list[str]) -> None:
    if isinstance(part, list) and part and isinstance(part[0], list):  # a group's alternatives
        for token in part[min(pick, len(part) - 1)]:
            _choose(token, pick, out)
        return
    word = str(part)
    if word == "...":
        if out:
            out.append(out[-1] + "x" if out[-1] in SAMPLES.values() else out[-1])
        return
    options = word.split("|")
    word = options[min(pick, len(options) - 1)]
    if re.fullmatch(r"[A-Z][A-Z_]*", word):
        assert word in SAMPLES, f"placeholder {word} of the synopsis has no sample value in this test"
        word = SAMPLES[word]
    out.append(word)


def synopses() -> Iterator[tuple[str, list[str]]]:
    for block in blocks():
        if block.lang:
            continue
        lines: list[str] = []
        for raw in block.text.splitlines():
            text = re.split(r"\s{2,}(?=[a-z])", raw.strip())[0] if raw.startswith("querator") else raw.strip()
            if raw.startswith("querator"):
                lines.append(text)
            elif lines and raw.strip():
                lines[-1] += " " + text
        for line in lines:
            alternatives, _ = _group(_tokens(line), 0)
            widest = max([len(w.split("|")) for w in re.findall(r"\S+", line)] + [line.count("|") + 1])
            for pick in range(widest):
                argv: list[str] = []
                for token in alternatives[0]:
                    _choose(token, pick, argv)
                yield line, argv


def test_every_synopsis_line_parses_as_written() -> None:
    seen = 0
    for line, argv in synopses():
        assert argv[0] == "querator", line
        seen += 1
        if argv[1] == "serve":
            from querator_server.cli import add_serve_arguments

            serve = argparse.ArgumentParser()
            add_serve_arguments(serve)
            serve.parse_args(argv[2:])
            continue
        try:
            args = parse(build_parser(), argv[1:])
        except SystemExit as exc:  # argparse refused it
            pytest.fail(f"{line!r} as {shlex.join(argv)!r}: exit {exc.code}")
        rest = getattr(args, "leaf_rest", None)
        if rest is not None:  # the ids/payloads the line gives all reach the command
            given = [w for w in argv if w in (SAMPLES["ID"], SAMPLES["ID"] + "x", SAMPLES["PAYLOAD"], SAMPLES["PAYLOAD"] + "x", "-")]
            given = [w for w in given if not (w == "-" and argv[argv.index(w) - 1] in ("-f", "--file"))]
            assert getattr(args, rest) == given, f"{shlex.join(argv)}: {rest}={getattr(args, rest)}"
    assert seen >= 17


# -- the shell blocks: run against a real server ------------------------------------------------------


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def ids_in(text: str) -> list[str]:
    """Item ids in a command's output: JSON (lines) or a table with an ID column."""
    ids: list[str] = []
    for line in text.splitlines():
        try:
            obj = json.loads(line)
        except json.JSONDecodeError:
            break
        if isinstance(obj, dict):
            ids += [obj["id"]] if "id" in obj else [i["id"] for i in obj.get("items", [])]
    if ids:
        return ids
    return column(text, "ID")


def column(text: str, name: str) -> list[str]:
    lines = text.splitlines()
    for at, header in enumerate(lines):
        heads = re.findall(r"\S+", header)
        if name in heads:
            index = heads.index(name)
            return [re.findall(r"\S+", row)[index] for row in lines[at + 1 :] if len(re.findall(r"\S+", row)) > index]
    return []


@dataclass
class Shell:
    """A reader's terminal: a working directory, its environment, the servers it started."""

    cwd: Path
    env: dict[str, str]
    servers: list[subprocess.Popen[bytes]] = field(default_factory=list)
    last_ids: list[str] = field(default_factory=list)
    last_keys: list[str] = field(default_factory=list)
    port: int = 0

    def serve(self, line: str) -> None:
        self.stop()
        self.port = _free_port()
        address = f"127.0.0.1:{self.port}"
        self.env["QUERATOR_ADDRESS"] = address
        # Servers here listen on loopback only: the docs' 0.0.0.0 becomes 127.0.0.1.
        line = re.sub(r"--address \S+", f"--address {address}", line)
        assignments = re.match(_ASSIGN, line)
        prefix = assignments.group(0) if assignments else ""
        log = open(self.cwd / f"serve-{len(self.servers)}.log", "wb")  # noqa: SIM115 - the child's
        # exec: the signal reaches the server itself, not a shell around it.
        script = f"{'export ' + prefix if prefix else ''}\nexec {line[len(prefix):]}"
        proc = subprocess.Popen(["bash", "-c", script], cwd=self.cwd, env=self.env, stderr=log)
        self.servers.append(proc)
        deadline = time.monotonic() + 60
        while True:
            assert proc.poll() is None, f"{line!r} exited: {(self.cwd / log.name).read_text()}"
            with socket.socket() as s:
                if s.connect_ex(("127.0.0.1", self.port)) == 0:
                    return
            assert time.monotonic() < deadline, f"{line!r} did not listen within 60 s"
            time.sleep(0.1)

    def stop(self) -> None:
        for proc in self.servers:
            if proc.poll() is None:
                proc.send_signal(signal.SIGTERM)
                assert proc.wait(60) == 0  # a clean shutdown
        self.servers.clear()

    def run(self, line: str) -> subprocess.CompletedProcess[str]:
        if "<ID>" in line:
            assert self.last_ids, f"{line!r}: no ids in the output before it"
            line = line.replace("<ID> ...", " ".join(self.last_ids))
            ids = iter(self.last_ids)
            line = re.sub(r"<ID>", lambda _: next(ids), line)
        if "<KEY_ID>" in line:
            assert self.last_keys, f"{line!r}: no key ids in the output before it"
            line = line.replace("<KEY_ID>", self.last_keys[-1])
        env_file = self.cwd / ".env0"
        script = f"set -a\n{line}\nrc=$?\nenv -0 > {shlex.quote(str(env_file))}\nexit $rc\n"
        result = subprocess.run(["bash", "-c", script], cwd=self.cwd, env=self.env, capture_output=True, text=True, timeout=120)
        if env_file.exists():
            pairs = [p.split("=", 1) for p in env_file.read_text().split("\0") if "=" in p]
            self.env = {k: v for k, v in pairs}
        output = result.stdout
        redirect = re.search(r">\s*(\S+)", line.split(" #")[0])
        if redirect:
            output = (self.cwd / redirect.group(1)).read_text()
        self.last_ids = ids_in(output) or self.last_ids
        self.last_keys = column(output, "KEY_ID") or self.last_keys
        return result

    def client(self) -> querator.Client:
        ca = self.env.get("QUERATOR_TLS_CA")
        return querator.Client(
            self.env["QUERATOR_ADDRESS"],
            root_certificates=(self.cwd / ca).read_bytes() if ca else None,
            bearer_token=self.env.get("QUERATOR_TOKEN") or None,
        )


def _dead_letters(shell: Shell) -> None:
    with shell.client() as c:
        c.create_queue("jobs-dlq")
        c.create_queue("jobs", dead_queue="jobs-dlq")
        c.create_queue("jobs-slow")
        c.produce("jobs", ["one", "two"], kind="invoice")
        c.retry(c.lease("jobs", batch_size=2, wait=5), dead=True)


def _queue(name: str) -> Callable[[Shell], None]:
    def create(shell: Shell) -> None:
        with shell.client() as c:
            c.create_queue(name)

    return create


def _worker_app(shell: Shell) -> None:
    """The handlers docs/sdk.md's ``querator worker`` lines name, and their queues with items."""
    app = shell.cwd / "myapp"
    app.mkdir(exist_ok=True)
    (app / "__init__.py").write_text("")
    for module, function in (("tasks", "handle"), ("mail", "send"), ("sms", "send")):
        (app / f"{module}.py").write_text(f"def {function}(item):\n    print('{module}', item.text)\n")
    (app / "worker.py").write_text(
        "import querator\nfrom myapp.tasks import handle\n\n"
        "settings = querator.WorkerSettings(queue='orders', handler=handle, options=querator.WorkerOptions(concurrency=8))\n"
    )
    with shell.client() as c:
        c.create_queue("orders")
        c.produce("orders", ["o1", "o2"])
        c.create_queue("notifications")
        c.produce("notifications", ["e1"], kind="email")
        c.produce("notifications", ["s1"], kind="sms")


# What a block assumes exists (what the reader made earlier on the page); made before
# the block's first command other than an export, with the block's settings.
SETUP: dict[str, Callable[[Shell], None]] = {
    "querator items list jobs-dlq": _dead_letters,
    "echo '{\"payload\": \"work\"": _queue("jobs"),
    "querator worker myapp.tasks:handle": _worker_app,
}


def _shell_blocks() -> list[Block]:
    return [b for b in blocks() if b.lang == "sh" and any(_RUNS_QUERATOR.search(l) for l in logical_lines(b.text))]


@pytest.mark.parametrize("doc", sorted({b.path for b in _shell_blocks()}), ids=lambda p: p.name)
def test_every_shell_command_in_the_docs_runs_as_written(doc: Path, tmp_path: Path) -> None:
    make_certificates(tmp_path)  # ca.pem, server.pem, server.key: the file names the docs use
    env = {k: v for k, v in os.environ.items() if not k.startswith("QUERATOR_")}
    env["PATH"] = f"{BIN}{os.pathsep}{env.get('PATH', '')}"
    shell = Shell(tmp_path, env)
    ran = 0
    try:
        for block in [b for b in _shell_blocks() if b.path == doc]:
            setup = next((fn for key, fn in SETUP.items() if block.text.startswith(key)), None)
            for line in logical_lines(block.text):
                if re.match(rf"{_ASSIGN}querator serve\b", line):
                    shell.serve(line.split(" #")[0])
                    ran += 1
                    continue
                if not _RUNS_QUERATOR.search(line):
                    continue  # docker, mv, ./dev setup: not ours to run here
                exporting = line.startswith("export")
                if not exporting and not shell.servers:
                    shell.serve("querator serve")
                if setup is not None and not exporting:
                    setup(shell)
                    setup = None
                result = shell.run(line)
                ran += 1
                expected = re.search(r"#\s*exit (\d+)(?::\s*(\w+))?", line)
                code = int(expected.group(1)) if expected else 0
                assert result.returncode == code, f"{line!r}: exit {result.returncode}\n{result.stderr}"
                if expected and expected.group(2):
                    assert expected.group(2) in result.stderr, result.stderr
    finally:
        shell.stop()
    assert ran > 0


# -- commands named in the prose: each command and option must exist -----------------------------

_INLINE = re.compile(r"`(?:[A-Z_]+=\S+\s+)*(?:\w+=\$\()?(querator\s[^`]*)`")


def _leaf(parser: argparse.ArgumentParser, words: list[str]) -> tuple[argparse.ArgumentParser, list[str]]:
    """The parser of the command ``words`` name, and the words after the command's name."""
    while words:
        subparsers = [a for a in parser._actions if isinstance(a, argparse._SubParsersAction)]
        if not subparsers or words[0] not in subparsers[0].choices:
            break
        parser, words = subparsers[0].choices[words[0]], words[1:]
    return parser, words


def test_every_command_the_prose_names_exists_with_its_options() -> None:
    from querator_server.cli import add_serve_arguments

    checked = 0
    for path in DOCS:
        for match in _INLINE.finditer(path.read_text()):
            words = match.group(1).rstrip(")").split()[1:]
            top = build_parser()
            if words[:1] == ["serve"]:
                leaf, rest = argparse.ArgumentParser(), words[1:]
                add_serve_arguments(leaf)
            else:
                leaf, rest = _leaf(top, [w for w in words if not w.startswith("--") or w not in top._option_string_actions])
                if leaf is top:  # only top-level options, e.g. querator --version
                    assert all(w in top._option_string_actions for w in words), f"{path.name}: {match.group(0)}"
            for word in rest:
                option = word.split("=")[0]
                if option.startswith("-") and option not in ("-", "--"):
                    known = leaf._option_string_actions.keys() | top._option_string_actions.keys()
                    assert option in known, f"{path.name}: {match.group(0)}: no option {option}"
            checked += 1
    assert checked >= 10
