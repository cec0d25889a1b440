"""Server-side sessions: the browser holds only a random session id (an HttpOnly,
SameSite=Strict cookie); the API key, the session's gRPC client and its CSRF token
stay in this process. Nothing secret is ever put in a URL, a page's script or the
browser's storage. Every session shares the console's one stats sampler.
"""

from __future__ import annotations

import hmac
import secrets
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from typing import Any

from .._async_client import AsyncClient
from ._api import Api
from ._sampler import Sampler

COOKIE = "querator_console"
# A session unused this long is dropped (its client closed); the visitor logs in again.
IDLE_SECONDS = 8 * 3600
# At most this many sessions at once: the oldest unused goes first.
MAX_SESSIONS = 256


@dataclass(eq=False)
class Session:
    sid: str
    csrf: str
    # None until logged in (or when the console runs without keys).
    api: Api | None = None
    sampler: Sampler | None = None
    last_used: float = field(default_factory=time.monotonic)
    # Messages shown on the next page drawn (the outcome of an action).
    flash: list[tuple[str, str]] = field(default_factory=list)
    # What the pages keep for this session (items shown, queues found).
    data: dict[str, Any] = field(default_factory=dict)

    def csrf_ok(self, token: str) -> bool:
        return bool(token) and hmac.compare_digest(self.csrf.encode(), token.encode())

    async def close(self) -> None:
        if self.sampler is not None and self.api is not None:
            self.sampler.forget(self.api)  # shared: it goes on for the other sessions
        if self.api is not None:
            await self.api.client.close()
        self.api = None
        self.sampler = None


class Sessions:
    def __init__(self, make_client: Callable[[str | None], AsyncClient], sampler: Sampler) -> None:
        self._make_client = make_client
        self._sampler = sampler
        self._by_id: dict[str, Session] = {}

    def get(self, sid: str | None) -> Session | None:
        if not sid:
            return None
        session = self._by_id.get(sid)
        if session is None:
            return None
        now = time.monotonic()
        if now - session.last_used > IDLE_SECONDS:
            return None
        session.last_used = now
        return session

    async def new(self) -> Session:
        await self._expire()
        session = Session(sid=secrets.token_urlsafe(32), csrf=secrets.token_urlsafe(32))
        self._by_id[session.sid] = session
        return session

    async def log_in(self, session: Session, token: str | None, check: Callable[[Api], Awaitable[None]]) -> Session:
        """A new session (new id: no fixation) holding a client with ``token``, once
        ``check`` passed with it; the old session is dropped. ``check`` raises on a
        refused key, and the client is closed then."""
        client = self._make_client(token)
        api = Api(client)
        try:
            await check(api)
        except BaseException:
            await client.close()
            raise
        await self.drop(session)
        fresh = await self.new()
        fresh.api = api
        fresh.sampler = self._sampler
        return fresh

    async def drop(self, session: Session) -> None:
        self._by_id.pop(session.sid, None)
        await session.close()

    async def close(self) -> None:
        for session in list(self._by_id.values()):
            await self.drop(session)

    async def _expire(self) -> None:
        now = time.monotonic()
        for session in [s for s in self._by_id.values() if now - s.last_used > IDLE_SECONDS]:
            await self.drop(session)
        while len(self._by_id) >= MAX_SESSIONS:
            await self.drop(min(self._by_id.values(), key=lambda s: s.last_used))
