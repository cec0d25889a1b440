"""The console's web application (Starlette): pages drawn on the server from gRPC calls.

Every page reads a bounded amount: one page of queues or items (the server's own
paging), never a whole listing, so it stays fast with many queues and many items.
Actions are HTML form posts carrying the session's CSRF token; the server behind
decides what the key may do, and its refusal is shown as it gave it.
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections import OrderedDict
from collections.abc import AsyncIterator, Awaitable, Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any
from urllib.parse import quote, urlencode

import jinja2
from starlette.applications import Starlette
from starlette.middleware.trustedhost import TrustedHostMiddleware
from starlette.requests import Request
from starlette.responses import HTMLResponse, RedirectResponse, Response
from starlette.routing import Mount, Route
from starlette.staticfiles import StaticFiles

from .._async_client import AsyncClient
from ..errors import PermissionDenied, QueratorError, Unauthenticated
from ..v1 import queues_pb2, storage_pb2
from . import _format as fmt
from ._api import DEAD_REASONS, REASON_NAMES, Api
from ._sampler import Sampler
from ._sessions import COOKIE, Session, Sessions

HERE = Path(__file__).parent
QUEUES_PAGE = 50
ITEMS_PAGE = 50
# A filtered items page reads at most this many server pages to fill itself.
MAX_SCAN_PAGES = 5
# Oldest-ready age: the first non-leased item among this many at a partition's head.
HEAD_ITEMS = 20
# Redrive all: at most this many RedriveItems calls (1,000 items each) per click.
REDRIVE_CALLS = 20
# Finding the queues whose dead_queue is this one reads at most this many queues.
SOURCE_SCAN = 20_000
SOURCE_TTL = 60.0
# Items a page showed, kept per session so "redrive selected" can import them as shown.
SHOWN_ITEMS = 2_000
_CONCURRENCY = 16


@dataclass
class ConsoleSettings:
    """What ``querator console`` was started with."""

    make_client: Callable[[str | None], AsyncClient]
    token: str | None = None
    read_only: bool = False
    target: str = ""
    # Host header names a request may carry (empty: any). A console on loopback answers
    # only its own names, so a site whose name is made to resolve to 127.0.0.1 (DNS
    # rebinding) cannot read its pages or use its key from a visitor's browser.
    allowed_hosts: tuple[str, ...] = ()


@dataclass
class _State:
    shown: OrderedDict[tuple[str, int, str], storage_pb2.StorageItem] = field(default_factory=OrderedDict)
    sources: dict[str, tuple[float, list[str]]] = field(default_factory=dict)
    storage_denied: bool = False


class Console:
    def __init__(self, settings: ConsoleSettings) -> None:
        self.settings = settings
        # One sampler for every visitor: each queue polled once, the same rates for all.
        self.sampler = Sampler()
        self.sessions = Sessions(settings.make_client, self.sampler)
        self.env = jinja2.Environment(
            loader=jinja2.FileSystemLoader(HERE / "templates"),
            autoescape=jinja2.select_autoescape(["html"]),
            undefined=jinja2.StrictUndefined,
        )
        self.env.filters["q"] = lambda s: quote(str(s), safe="")
        self.env.globals.update(
            fmt=fmt, reasons=REASON_NAMES, reason_values=DEAD_REASONS, read_only=settings.read_only,
            target=settings.target, urlencode=urlencode,
        )  # fmt: skip
        # Without login (a server without keys, or --token): one client for everyone.
        self._open: tuple[Api, Sampler] | None = None
        self._open_checked = 0.0
        self._opening = asyncio.Lock()
        self._open_state = _State()

    # -- plumbing ------------------------------------------------------------------------------

    def render(self, request: Request, session: Session | None, name: str, status: int = 200, **ctx: Any) -> Response:
        flash = list(session.flash) if session else []
        if session:
            session.flash.clear()
        html = self.env.get_template(name).render(
            request=request,
            refresh=_refresh(request),
            csrf=session.csrf if session else "",
            logged_in=bool(session and session.api and self._open is None),
            flash=flash,
            **ctx,
        )
        return HTMLResponse(html, status_code=status)

    def state(self, session: Session) -> _State:
        """What pages remember between requests: the session's own, or with one client
        for everyone, everyone's (it goes with the session when it is dropped)."""
        if self._open is not None:
            return self._open_state
        state: _State = session.data.setdefault("console", _State())
        return state

    async def _open_api(self) -> tuple[Api, Sampler] | None:
        """The shared client when no login is needed: with --token, or when the server
        answers without a key. None when it wants one (checked again after 30 s)."""
        async with self._opening:  # one client, however many requests come at once
            return await self._open_once()

    async def _open_once(self) -> tuple[Api, Sampler] | None:
        if self._open is not None:
            return self._open
        if self.settings.token is None and time.monotonic() - self._open_checked < 30:
            return None
        api = Api(self.settings.make_client(self.settings.token))
        try:
            await api.list_queues(1)
        except Unauthenticated:
            await api.client.close()
            if self.settings.token is not None:
                raise
            self._open_checked = time.monotonic()
            return None
        except BaseException:
            await api.client.close()
            raise
        self._open = (api, self.sampler)
        return self._open

    async def session(self, request: Request) -> tuple[Session, Api, Sampler] | Response:
        """The visitor's session with a client, or the redirect to the login page."""
        session = self.sessions.get(request.cookies.get(COOKIE))
        if session is not None and session.api is not None and session.sampler is not None:
            return session, session.api, session.sampler
        try:
            opened = await self._open_api()
        except QueratorError as exc:
            return self.render(request, None, "error.html", 502, title="The console cannot reach the server", error=_refusal(exc))
        if opened is None:
            return RedirectResponse("/login", status_code=303)
        if session is None:
            session = await self.sessions.new()
        api, sampler = opened
        return session, api, sampler

    @staticmethod
    def with_cookie(response: Response, session: Session) -> Response:
        response.set_cookie(COOKIE, session.sid, httponly=True, samesite="strict", path="/")
        return response

    async def close(self) -> None:
        await self.sessions.close()
        await self.sampler.stop()
        if self._open is not None:
            await self._open[0].client.close()

    # -- login ---------------------------------------------------------------------------------

    async def login_page(self, request: Request) -> Response:
        try:
            opened = await self._open_api()
        except QueratorError as exc:
            return self.render(request, None, "error.html", 502, title="The console cannot reach the server", error=_refusal(exc))
        if opened is not None:
            return RedirectResponse("/", status_code=303)
        session = self.sessions.get(request.cookies.get(COOKIE)) or await self.sessions.new()
        return self.with_cookie(self.render(request, session, "login.html", error=""), session)

    async def login(self, request: Request) -> Response:
        session = self.sessions.get(request.cookies.get(COOKIE))
        form = await request.form()
        if session is None or not session.csrf_ok(str(form.get("csrf", ""))):
            return self.render(request, None, "error.html", 403, title="Refused", error=_CSRF_MESSAGE)
        token = str(form.get("token", "")).strip()
        if not token:
            return self.render(request, session, "login.html", 400, error="Enter an API key.")

        async def check(api: Api) -> None:
            await api.list_queues(1)

        try:
            fresh = await self.sessions.log_in(session, token, check)
        except Unauthenticated as exc:
            return self.render(request, session, "login.html", 401, error=f"The server refused the key: {exc.message}")
        except QueratorError as exc:
            return self.render(request, session, "login.html", 502, error=f"{exc.status}: {exc.message}")
        return self.with_cookie(RedirectResponse("/", status_code=303), fresh)

    async def logout(self, request: Request) -> Response:
        session = self.sessions.get(request.cookies.get(COOKIE))
        form = await request.form()
        if session is not None and session.csrf_ok(str(form.get("csrf", ""))):
            await self.sessions.drop(session)
        response = RedirectResponse("/login", status_code=303)
        response.delete_cookie(COOKIE, path="/")
        return response

    # -- pages ---------------------------------------------------------------------------------

    async def page(self, request: Request, draw: Callable[[Session, Api, Sampler], Awaitable[Response]]) -> Response:
        got = await self.session(request)
        if isinstance(got, Response):
            return got
        session, api, sampler = got
        try:
            response = await draw(session, api, sampler)
        except Unauthenticated as exc:
            if self._open is None:
                await self.sessions.drop(session)
                return RedirectResponse("/login", status_code=303)
            response = self.render(request, session, "error.html", 401, title="The server refused the key", error=_refusal(exc))
        except QueratorError as exc:
            response = self.render(
                request, session, "error.html", _http_status(exc), title="The server answered an error", error=_refusal(exc)
            )
        return self.with_cookie(response, session)

    async def queues(self, request: Request) -> Response:
        token = request.query_params.get("page", "")
        jump = request.query_params.get("queue", "").strip()
        if jump:
            return RedirectResponse(f"/q/{quote(jump, safe='')}", status_code=303)

        async def draw(session: Session, api: Api, sampler: Sampler) -> Response:
            started = time.perf_counter()
            listing = await api.list_queues(QUEUES_PAGE, token)
            names = [q.queue_name for q in listing.queues]
            dead_names = sorted({q.dead_queue for q in listing.queues if q.dead_queue})
            stats = await _gather({n: api.stats(n) for n in names + [d for d in dead_names if d not in names]})
            # Samples of the listed queues only: one of a dead-letter queue not on the page
            # would stay in the shared sampler, never watched and so never dropped.
            readable = {n: s for n, s in stats.items() if n in names and isinstance(s, queues_pb2.GetQueueStatsResponse)}
            for name, got in readable.items():
                sampler.record(name, got)
            sampler.watch(list(readable), api)
            oldest = await self.oldest_ready(session, api, {n: s for n, s in stats.items() if n in names})
            rows = []
            for q in listing.queues:
                s = stats.get(q.queue_name)
                d = stats.get(q.dead_queue) if q.dead_queue else None
                rows.append(
                    {
                        "info": q,
                        "stats": s if isinstance(s, queues_pb2.GetQueueStatsResponse) else None,
                        "error": _refusal(s) if isinstance(s, QueratorError) else "",
                        "counts": _counts(s),
                        "dead": _counts(d)["depth"] if isinstance(d, queues_pb2.GetQueueStatsResponse) else None,
                        "oldest": oldest.get(q.queue_name, ""),
                        # Only of a queue this key just read: the history is everyone's.
                        "rates": sampler.rates(q.queue_name) if isinstance(s, queues_pb2.GetQueueStatsResponse) else None,
                    }
                )
            return self.render(
                request, session, "queues.html", rows=rows, next_page=listing.next_page_token, first=not token,
                elapsed_ms=(time.perf_counter() - started) * 1000,
            )  # fmt: skip

        return await self.page(request, draw)

    async def oldest_ready(
        self, session: Session, api: Api, stats: dict[str, queues_pb2.GetQueueStatsResponse | BaseException]
    ) -> dict[str, str]:
        """Each queue's oldest ready item's age: the first item not leased at the head of
        each partition (ListItems is FIFO), among the first HEAD_ITEMS; ``> age`` when
        all of those are leased. Needs StorageService: empty for keys it refuses."""
        state = self.state(session)
        if state.storage_denied:
            return {}
        calls: dict[tuple[str, int], Awaitable[Any]] = {}
        for name, s in stats.items():
            if not isinstance(s, queues_pb2.GetQueueStatsResponse):
                continue
            for p in s.partitions:
                if p.total - p.total_leased > 0 and not p.faulty:
                    calls[(name, p.partition)] = api.list_items(name, p.partition, min(p.total_leased + 1, HEAD_ITEMS))
        got = await _gather(calls)
        best: dict[str, tuple[float, bool]] = {}
        for (name, _), page in got.items():
            if isinstance(page, PermissionDenied):
                state.storage_denied = True
                return {}
            if isinstance(page, BaseException):
                continue
            items = list(page.items)
            ready = next((i for i in items if not i.is_leased), None)
            head = ready or (items[-1] if items else None)
            if head is None:
                continue
            created = head.created_at.seconds + head.created_at.nanos / 1e9
            if name not in best or created < best[name][0]:
                best[name] = (created, ready is None)
        now = time.time()
        return {n: ("> " if lower else "") + fmt.seconds_text(max(0.0, now - c)) for n, (c, lower) in best.items()}

    async def queue(self, request: Request) -> Response:
        name = request.path_params["name"]

        async def draw(session: Session, api: Api, sampler: Sampler) -> Response:
            info, stats = await asyncio.gather(api.get_queue(name), api.stats(name))
            sampler.record(name, stats)
            sampler.watch([name], api)
            placement: dict[int, str] = {}
            live: dict[str, bool] = {}
            clustered = False
            try:
                cluster = await api.cluster_info([name])
            except PermissionDenied:
                pass
            else:
                clustered = cluster.clustered
                live = {m.node_id: m.live for m in cluster.members}
                for q in cluster.queues:
                    if q.queue_name == name:
                        placement = dict(enumerate(q.homes))
            dead = None
            if info.dead_queue:
                try:
                    dead = _counts(await api.stats(info.dead_queue))
                except QueratorError:
                    dead = None
            return self.render(
                request, session, "queue.html", info=info, stats=stats, counts=_counts(stats), placement=placement,
                live=live, clustered=clustered, dead=dead, chart=fmt.depth_chart(sampler.series(name)),
                rates=sampler.rates(name),
            )  # fmt: skip

        return await self.page(request, draw)

    async def items(self, request: Request) -> Response:
        return await self._listing(request, dead_view=False)

    async def dead(self, request: Request) -> Response:
        return await self._listing(request, dead_view=True)

    async def _listing(self, request: Request, *, dead_view: bool) -> Response:
        name = request.path_params["name"]
        params = request.query_params
        state_filter = params.get("state", "ready" if dead_view else "all")
        if state_filter not in ("all", "ready", "leased", "scheduled"):
            state_filter = "all"
        kind = params.get("kind", "")
        reason = params.get("reason", "")
        try:
            partition = max(0, int(params.get("partition", "0")))
        except ValueError:
            partition = 0
        token = params.get("page", "")

        def keep(item: storage_pb2.StorageItem) -> bool:
            if state_filter == "ready" and item.is_leased or state_filter == "leased" and not item.is_leased:
                return False
            if kind and item.kind != kind:
                return False
            return not (reason and item.dead_reason != DEAD_REASONS.get(reason, -1))

        async def draw(session: Session, api: Api, sampler: Sampler) -> Response:
            started = time.perf_counter()
            info, stats = await asyncio.gather(api.get_queue(name), api.stats(name))
            shown: list[storage_pb2.StorageItem] = []
            next_token, scanned, pages = token, 0, 0
            while pages < MAX_SCAN_PAGES and len(shown) < ITEMS_PAGE:
                # Asking only for what the page still lacks keeps it at ITEMS_PAGE items
                # and the next page's token right after the last item shown.
                want = ITEMS_PAGE - len(shown)
                page = await api.list_items(name, partition, want, next_token, scheduled=state_filter == "scheduled")
                pages += 1
                scanned += len(page.items)
                shown.extend(i for i in page.items if keep(i))
                next_token = page.next_page_token
                if not next_token:
                    break
            state = self.state(session)
            for item in shown:
                state.shown[(name, partition, item.id)] = item
                state.shown.move_to_end((name, partition, item.id))
            while len(state.shown) > SHOWN_ITEMS:
                state.shown.popitem(last=False)
            sources = await self.sources(session, api, name) if dead_view and not self.settings.read_only else []
            return self.render(
                request, session, "items.html", info=info, stats=stats, counts=_counts(stats), items=shown,
                partition=partition, state_filter=state_filter, kind=kind, reason=reason, page_token=token,
                next_page=next_token, scanned=scanned, dead_view=dead_view, sources=sources,
                elapsed_ms=(time.perf_counter() - started) * 1000,
            )  # fmt: skip

        return await self.page(request, draw)

    async def sources(self, session: Session, api: Api, dead_queue: str) -> list[str]:
        """The queues whose dead_queue is ``dead_queue`` (for "redrive selected"), from a
        scan of at most SOURCE_SCAN queues, kept SOURCE_TTL seconds."""
        state = self.state(session)
        cached = state.sources.get(dead_queue)
        if cached is not None and time.monotonic() - cached[0] < SOURCE_TTL:
            return cached[1]
        found: list[str] = []
        token, seen = "", 0
        while seen < SOURCE_SCAN:
            page = await api.list_queues(1000, token)
            seen += len(page.queues)
            found.extend(q.queue_name for q in page.queues if q.dead_queue == dead_queue)
            token = page.next_page_token
            if not token:
                break
        state.sources[dead_queue] = (time.monotonic(), found)
        return found

    async def cluster(self, request: Request) -> Response:
        async def draw(session: Session, api: Api, sampler: Sampler) -> Response:
            started = time.perf_counter()
            view = await api.cluster_info(check_members=True)
            per_node: dict[str, int] = {}
            for q in view.queues:
                for home in q.homes:
                    per_node[home] = per_node.get(home, 0) + 1
            return self.render(
                request, session, "cluster.html", view=view, per_node=per_node,
                elapsed_ms=(time.perf_counter() - started) * 1000,
            )  # fmt: skip

        return await self.page(request, draw)

    # -- actions -------------------------------------------------------------------------------

    async def action(self, request: Request) -> Response:
        name = request.path_params["name"]
        verb = request.path_params["verb"]
        got = await self.session(request)
        if isinstance(got, Response):
            return got
        session, api, _ = got
        form = await request.form()
        if not session.csrf_ok(str(form.get("csrf", ""))):
            return self.render(request, session, "error.html", 403, title="Refused", error=_CSRF_MESSAGE)
        back = str(form.get("back", "")) or f"/q/{quote(name, safe='')}/dead"
        # Only a path of this console (never "//host" or "/\\host", which browsers follow off-site).
        if not back.startswith("/") or back.startswith("//") or "\\" in back:
            back = "/"
        if self.settings.read_only:
            session.flash.append(("error", "The console runs read-only (--read-only): no action is taken."))
            return self.with_cookie(RedirectResponse(back, status_code=303), session)
        handler = _ACTIONS.get(verb)
        if handler is None:
            return self.render(request, session, "error.html", 404, title="Not found", error=f"no action {verb!r}")
        try:
            message = await handler(self, session, api, name, form)
            session.flash.append(("ok", message))
        except Unauthenticated:
            if self._open is None:
                await self.sessions.drop(session)
                return RedirectResponse("/login", status_code=303)
            session.flash.append(("error", "Refused by the server: the console's key is not accepted."))
        except QueratorError as exc:
            session.flash.append(("error", _refusal(exc)))
        except ValueError as exc:
            session.flash.append(("error", str(exc)))
        return self.with_cookie(RedirectResponse(back, status_code=303), session)

    def _selected(self, session: Session, name: str, form: Any) -> dict[int, list[storage_pb2.StorageItem]]:
        chosen: dict[int, list[storage_pb2.StorageItem]] = {}
        state = self.state(session)
        for value in form.getlist("item"):
            partition_text, _, item_id = str(value).partition(":")
            try:
                partition = int(partition_text)
            except ValueError:
                raise ValueError(f"not an item: {value!r}") from None
            item = state.shown.get((name, partition, item_id))
            if item is None:
                raise ValueError("An item selected is no longer known to this page: reload the page and select again.")
            chosen.setdefault(partition, []).append(item)
        if not chosen:
            raise ValueError("Select at least one item.")
        return chosen

    async def redrive_selected(self, session: Session, api: Api, name: str, form: Any) -> str:
        """Import each selected dead letter into the target queue as a fresh item (as
        RedriveItems hands it over: no attempts, no dead-letter fields, message_id,
        created_at and last error kept, its dead-letter id as source_id), then delete
        it from here."""
        target = str(form.get("to", "")).strip()
        if not target:
            raise ValueError("Name the queue to redrive the selected items to.")
        if target == name:
            raise ValueError(f"Redrive to another queue than {name} itself.")
        chosen = self._selected(session, name, form)
        moved = 0
        for partition, items in chosen.items():
            fresh = [_handed_over(item) for item in items]
            await api.import_items(target, fresh)
            await api.delete_items(name, partition, [item.id for item in items])
            moved += len(items)
            for item in items:
                self.state(session).shown.pop((name, partition, item.id), None)
        return f"Redrove {moved} selected item(s) from {name} to {target}."

    async def redrive_all(self, session: Session, api: Api, name: str, form: Any) -> str:
        target = str(form.get("to", "")).strip()
        kind = str(form.get("kind", "")).strip()
        reason_text = str(form.get("reason", ""))
        if reason_text and reason_text not in DEAD_REASONS:
            raise ValueError(f"unknown dead reason {reason_text!r}")
        reason = DEAD_REASONS.get(reason_text, 0)
        moved = skipped = 0
        token = ""
        for _ in range(REDRIVE_CALLS):
            try:
                reply = await api.redrive(name, target=target, kind=kind, reason=reason, max_items=1000, page_token=token)
            except QueratorError as exc:
                if moved:
                    exc.message = f"{exc.message} (after {moved} item(s) moved)"
                raise
            moved += reply.moved
            skipped += reply.skipped
            token = reply.next_page_token
            if not token:
                break
        where = target or "their source queues"
        text = f"Redrove {moved} item(s) from {name} to {where}"
        if kind or reason_text:
            text += " (only " + ", ".join(x for x in (f"kind {kind}" if kind else "", reason_text) if x) + ")"
        text += "."
        if skipped:
            text += f" {skipped} stayed: their source queue is gone or not visible to this key."
        if token:
            text += " More remain: redrive again to go on."
        return text

    async def delete_selected(self, session: Session, api: Api, name: str, form: Any) -> str:
        chosen = self._selected(session, name, form)
        count = 0
        for partition, items in chosen.items():
            await api.delete_items(name, partition, [item.id for item in items])
            count += len(items)
            for item in items:
                self.state(session).shown.pop((name, partition, item.id), None)
        return f"Deleted {count} item(s) from {name}."

    async def purge(self, session: Session, api: Api, name: str, form: Any) -> str:
        if str(form.get("confirm", "")) != name:
            raise ValueError(f"Not purged: type the queue's name ({name}) to confirm.")
        await api.clear(name)
        return f"Purged {name}: its ready and scheduled items are gone (leased items stay with their consumers)."

    # -- the application -----------------------------------------------------------------------

    def app(self) -> Starlette:
        routes = [
            Route("/", self.queues),
            Route("/login", self.login_page, methods=["GET"]),
            Route("/login", self.login, methods=["POST"]),
            Route("/logout", self.logout, methods=["POST"]),
            Route("/cluster", self.cluster),
            Route("/q/{name}", self.queue),
            Route("/q/{name}/items", self.items),
            Route("/q/{name}/dead", self.dead),
            Route("/q/{name}/action/{verb}", self.action, methods=["POST"]),
            Mount("/static", StaticFiles(directory=HERE / "static"), name="static"),
        ]
        @contextlib.asynccontextmanager
        async def lifespan(app: Starlette) -> AsyncIterator[None]:
            yield
            await self.close()

        app = Starlette(routes=routes, lifespan=lifespan)
        app.add_middleware(_Headers)
        if self.settings.allowed_hosts:
            app.add_middleware(TrustedHostMiddleware, allowed_hosts=list(self.settings.allowed_hosts), www_redirect=False)
        return app


_CSRF_MESSAGE = "The form's security token did not match this session (an old page, or another site's form). Reload the page and try again."

_ACTIONS: dict[str, Callable[[Console, Session, Api, str, Any], Awaitable[str]]] = {
    "redrive-selected": Console.redrive_selected,
    "redrive-all": Console.redrive_all,
    "delete-selected": Console.delete_selected,
    "purge": Console.purge,
}


class _Headers:
    """No framing, no referrer, nothing cached, and only this origin's scripts and styles."""

    def __init__(self, app: Any) -> None:
        self.app = app

    async def __call__(self, scope: Any, receive: Any, send: Any) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return

        async def with_headers(message: Any) -> None:
            if message["type"] == "http.response.start":
                headers = list(message.get("headers", []))
                headers += [
                    (b"content-security-policy", b"default-src 'self'; img-src 'self' data:; frame-ancestors 'none'; form-action 'self'"),
                    (b"x-frame-options", b"DENY"),
                    (b"x-content-type-options", b"nosniff"),
                    (b"referrer-policy", b"no-referrer"),
                ]
                if not scope["path"].startswith("/static/"):
                    headers.append((b"cache-control", b"no-store"))
                message["headers"] = headers
            await send(message)

        await self.app(scope, receive, with_headers)


def _handed_over(item: storage_pb2.StorageItem) -> storage_pb2.StorageItem:
    return storage_pb2.StorageItem(
        created_at=item.created_at,
        reference=item.reference,
        encoding=item.encoding,
        kind=item.kind,
        payload=item.payload,
        source_id=item.id,
        metadata=dict(item.metadata),
        message_id=item.message_id or item.id,
        last_error=item.last_error,
        last_error_at=item.last_error_at if item.last_error else None,
        priority=item.priority,
    )


def _refresh(request: Request) -> int:
    """``?refresh=N``: the page reloads itself every N seconds (5 to 300; 0: never)."""
    try:
        seconds = int(request.query_params.get("refresh", "0"))
    except ValueError:
        return 0
    return min(max(seconds, 5), 300) if seconds > 0 else 0


def _counts(stats: Any) -> dict[str, int]:
    if not isinstance(stats, queues_pb2.GetQueueStatsResponse):
        return {"ready": 0, "leased": 0, "scheduled": 0, "depth": 0, "faulty": 0}
    leased = sum(p.total_leased for p in stats.partitions)
    total = sum(p.total for p in stats.partitions)
    scheduled = sum(p.scheduled for p in stats.partitions)
    faulty = sum(1 for p in stats.partitions if p.faulty)
    return {"ready": total - leased, "leased": leased, "scheduled": scheduled, "depth": total + scheduled, "faulty": faulty}


def _refusal(exc: QueratorError) -> str:
    if isinstance(exc, PermissionDenied):
        return f"Refused by the server (PERMISSION_DENIED): {exc.message}"
    return f"The server answered {exc.status}: {exc.message}"


def _http_status(exc: QueratorError) -> int:
    return {"PERMISSION_DENIED": 403, "NOT_FOUND": 404, "INVALID_ARGUMENT": 400}.get(exc.status, 502)


async def _gather(calls: dict[Any, Awaitable[Any]]) -> dict[Any, Any]:
    """Every call's answer or error, at most _CONCURRENCY at a time."""
    limit = asyncio.Semaphore(_CONCURRENCY)

    async def one(call: Awaitable[Any]) -> Any:
        async with limit:
            try:
                return await call
            except QueratorError as exc:
                return exc

    answers = await asyncio.gather(*(one(c) for c in calls.values()))
    return dict(zip(calls, answers, strict=True))


def create_app(settings: ConsoleSettings) -> Starlette:
    return Console(settings).app()
