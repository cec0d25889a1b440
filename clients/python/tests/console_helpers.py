"""Helpers of the console tests: ``querator console`` as a process, and an HTTP session
with its own cookie jar (a browser without a screen)."""

from __future__ import annotations

import html as html_lib
import http.cookiejar
import re
import signal
import subprocess
import sys
import threading
import urllib.error
import urllib.parse
import urllib.request
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

QUERATOR = str(Path(sys.executable).parent / "querator")


@contextmanager
def console(address: str, *extra: str, env: dict[str, str] | None = None) -> Iterator[str]:
    """``querator --address ADDRESS console --listen 127.0.0.1:0 EXTRA``; its base URL."""
    proc = subprocess.Popen(
        [QUERATOR, "--address", address, "console", "--listen", "127.0.0.1:0", *extra],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        env=env,
    )
    try:
        line: list[str] = []
        reader = threading.Thread(target=lambda: line.append(proc.stdout.readline() if proc.stdout else ""), daemon=True)
        reader.start()
        reader.join(30)
        match = re.search(r"serving (http://127\.0\.0\.1:\d+/)", line[0] if line else "")
        if match is None:
            proc.kill()
            raise AssertionError(f"the console did not start: {line} {proc.stderr.read() if proc.stderr else ''}")
        yield match.group(1)
    finally:
        if proc.poll() is None:
            proc.send_signal(signal.SIGTERM)
            try:
                code = proc.wait(15)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait(5)
                raise AssertionError("the console did not stop within 15 s of SIGTERM") from None
            assert code == 0, f"the console exited {code} on SIGTERM: {proc.stderr.read() if proc.stderr else ''}"


@dataclass
class Reply:
    status: int
    url: str
    text: str
    headers: dict[str, str]


class Visitor:
    """One browser: cookies kept, redirects followed."""

    def __init__(self, base: str) -> None:
        self.base = base.rstrip("/")
        self.jar = http.cookiejar.CookieJar()
        self.opener = urllib.request.build_opener(urllib.request.HTTPCookieProcessor(self.jar))

    def _open(self, request: urllib.request.Request) -> Reply:
        try:
            with self.opener.open(request, timeout=30) as response:
                return Reply(response.status, response.url, response.read().decode(), dict(response.headers))
        except urllib.error.HTTPError as exc:
            return Reply(exc.code, exc.url, exc.read().decode(), dict(exc.headers))

    def get(self, path: str) -> Reply:
        return self._open(urllib.request.Request(self.base + path))

    def post(self, path: str, fields: dict[str, str] | list[tuple[str, str]]) -> Reply:
        data = urllib.parse.urlencode(fields).encode()
        return self._open(urllib.request.Request(self.base + path, data=data, method="POST"))

    def log_in(self, token: str) -> Reply:
        page = self.get("/login")
        return self.post("/login", {"csrf": csrf(page.text), "token": token})


def csrf(html: str) -> str:
    match = re.search(r'name="csrf" value="([^"]+)"', html)
    assert match, "no CSRF token on the page"
    return match.group(1)


def flash(html: str, kind: str = "error") -> str:
    match = re.search(rf'class="flash {kind}"[^>]*>([^<]*)<', html)
    return html_lib.unescape(match.group(1)) if match else ""


def count(html: str, what: str) -> int:
    match = re.search(rf'id="count-{what}">(\d+)<', html)
    assert match, f"no {what} count on the page"
    return int(match.group(1))
