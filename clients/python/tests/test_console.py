"""``querator console`` against a real server with API keys, through HTTP as a browser
would send it (the browser test, test_console_browser.py, clicks the same pages)."""

from __future__ import annotations

import html
import json
import re
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

pytest.importorskip("starlette", reason="the console extra (querator-client[console]) is not installed")

from console_helpers import Visitor, console, count, csrf, flash  # noqa: E402

import querator  # noqa: E402
from querator.console._format import field, preview  # noqa: E402
from querator.embedded import EmbeddedServer  # noqa: E402
from querator.testing import make_certificates, server  # noqa: E402
from querator.v1 import storage_pb2  # noqa: E402

from sdk_helpers import wait_until  # noqa: E402

ADMIN = "console-admin-token"


@pytest.fixture(scope="module")
def srv() -> Iterator[EmbeddedServer]:
    with server(admin_token=ADMIN) as s:
        yield s


@pytest.fixture(scope="module")
def admin(srv: EmbeddedServer) -> Iterator[querator.Client]:
    with srv.client() as c:
        yield c


@pytest.fixture(scope="module")
def url(srv: EmbeddedServer) -> Iterator[str]:
    with console(srv.address) as base:
        yield base


def dead_letters(admin: querator.Client, name: str, count: int, *, kind: str = "") -> str:
    """Queue ``name`` with ``count`` items dead-lettered into ``name``-dlq; the DLQ's name."""
    dlq = f"{name}-dlq"
    admin.create_queue(dlq)
    admin.create_queue(name, dead_queue=dlq)
    admin.produce(name, [json.dumps({"n": i}).encode() for i in range(count)], kind=kind)
    admin.retry(admin.lease(name, batch_size=count, wait=5), dead=True)
    # The hand-over to the dead-letter queue follows the Retry's answer.
    wait_until(lambda: admin.queue_stats(dlq).ready == count)
    return dlq


def test_login_keeps_the_key_in_the_console(url: str) -> None:
    v = Visitor(url)
    first = v.get("/")
    assert first.url.endswith("/login") and 'name="token"' in first.text
    refused = v.log_in("qk_not_a_key")
    assert refused.status == 401 and "The server refused the key" in refused.text
    ok = v.log_in(ADMIN)
    assert ok.status == 200 and ok.url.rstrip("/") == url.rstrip("/") and 'id="queues"' in ok.text
    (cookie,) = list(v.jar)
    assert cookie.has_nonstandard_attr("HttpOnly") and cookie.get_nonstandard_attr("SameSite", "").lower() == "strict"
    assert ADMIN not in cookie.value and ADMIN not in ok.text and ADMIN not in ok.url
    for header in ("content-security-policy", "x-frame-options"):
        assert header in {k.lower() for k in ok.headers}
    # Logging out drops the session on the console: the old cookie no longer works.
    v.post("/logout", {"csrf": csrf(ok.text)})
    again = Visitor(url)
    again.jar.set_cookie(cookie)
    assert again.get("/").url.endswith("/login")


def test_an_action_without_the_session_csrf_token_is_refused(url: str, admin: querator.Client) -> None:
    dlq = dead_letters(admin, "csrf-jobs", 2)
    v = Visitor(url)
    page = v.log_in(ADMIN)
    for token in ("", "forged" + csrf(page.text)):
        reply = v.post(f"/q/{dlq}/action/purge", {"csrf": token, "confirm": dlq})
        assert reply.status == 403 and "security token" in flash(reply.text)
    # Another visitor's token does not fit this session either.
    other = Visitor(url)
    other_token = csrf(other.log_in(ADMIN).text)
    assert v.post(f"/q/{dlq}/action/purge", {"csrf": other_token, "confirm": dlq}).status == 403
    assert admin.queue_stats(dlq).ready == 2


def test_dead_letters_redrive_selected_and_all_delete_and_purge(url: str, admin: querator.Client) -> None:
    dlq = dead_letters(admin, "dl-jobs", 6, kind="invoice")
    v = Visitor(url)
    v.log_in(ADMIN)
    page = v.get(f"/q/{dlq}/dead")
    assert page.status == 200 and count(page.text, "ready") == 6
    assert page.text.count('class="item"') == 6 and "retry_dead" in page.text
    assert 'value="dl-jobs"' in page.text  # the only source queue, offered as the target
    ids = [line.split('value="0:')[1].split('"')[0] for line in page.text.splitlines() if 'name="item" value="0:' in line]
    token = csrf(page.text)

    same = v.post(f"/q/{dlq}/action/redrive-selected", [("csrf", token), ("to", dlq), ("item", f"0:{ids[0]}")])
    assert "another queue" in flash(same.text) and count(same.text, "ready") == 6
    moved = v.post(f"/q/{dlq}/action/redrive-selected", [("csrf", token), ("to", "dl-jobs"), ("item", f"0:{ids[0]}")])
    assert "Redrove 1 selected item(s)" in flash(moved.text, "ok"), moved.text
    assert count(moved.text, "ready") == 5
    (back,) = admin.lease("dl-jobs", wait=5)
    assert back.attempts == 1 and back.kind == "invoice" and json.loads(back.payload) == {"n": 0}
    back.complete()

    gone = v.post(f"/q/{dlq}/action/delete-selected", [("csrf", token), ("item", f"0:{ids[1]}"), ("item", f"0:{ids[2]}")])
    assert "Deleted 2 item(s)" in flash(gone.text, "ok") and count(gone.text, "ready") == 3

    none = v.post(f"/q/{dlq}/action/redrive-all", {"csrf": token, "kind": "email", "reason": ""})
    assert "Redrove 0 item(s)" in flash(none.text, "ok") and count(none.text, "ready") == 3
    some = v.post(f"/q/{dlq}/action/redrive-all", {"csrf": token, "kind": "invoice", "reason": "retry_dead", "to": ""})
    assert "Redrove 3 item(s) from dl-jobs-dlq to their source queues" in flash(some.text, "ok")
    assert count(some.text, "ready") == 0 and admin.queue_stats("dl-jobs").ready == 3

    wrong = v.post("/q/dl-jobs/action/purge", {"csrf": token, "confirm": "dl-job", "back": "/q/dl-jobs"})
    assert "type the queue's name" in flash(wrong.text) and admin.queue_stats("dl-jobs").ready == 3
    purged = v.post("/q/dl-jobs/action/purge", {"csrf": token, "confirm": "dl-jobs", "back": "/q/dl-jobs"})
    assert "Purged dl-jobs" in flash(purged.text, "ok") and count(purged.text, "ready") == 0


def test_the_server_refuses_a_consumer_key_and_the_page_says_so(url: str, admin: querator.Client) -> None:
    dlq = dead_letters(admin, "ro-jobs", 2)
    consumer = admin.create_key("consumer", ["*"]).token
    v = Visitor(url)
    home = v.log_in(consumer)
    assert 'data-queue="ro-jobs"' in home.text  # a consumer key may list queues and read counts
    page = v.get(f"/q/{dlq}")
    assert count(page.text, "ready") == 2
    refused = v.post(f"/q/{dlq}/action/purge", {"csrf": csrf(page.text), "confirm": dlq, "back": f"/q/{dlq}"})
    assert flash(refused.text).startswith("Refused by the server (PERMISSION_DENIED)")
    listing = v.get(f"/q/{dlq}/dead")
    assert listing.status == 403 and "PERMISSION_DENIED" in flash(listing.text)
    assert admin.queue_stats(dlq).ready == 2


def test_read_only_takes_no_action(srv: EmbeddedServer, admin: querator.Client) -> None:
    dlq = dead_letters(admin, "rd-jobs", 2)
    # --token: every visitor uses that key, no login.
    with console(srv.address, "--read-only", "--token", ADMIN) as base:
        v = Visitor(base)
        page = v.get(f"/q/{dlq}/dead")
        assert page.status == 200 and count(page.text, "ready") == 2 and "read-only" in page.text
        assert "/action/" not in page.text
        reply = v.post(f"/q/{dlq}/action/purge", {"csrf": csrf(page.text), "confirm": dlq, "back": f"/q/{dlq}"})
        assert "read-only" in flash(reply.text)
    assert admin.queue_stats(dlq).ready == 2


def test_items_are_paged_and_filtered(url: str, admin: querator.Client) -> None:
    admin.create_queue("paged", partitions=1)
    admin.produce("paged", [b"\x00\x01binary", "plain text"] + [json.dumps({"i": i}) for i in range(118)])
    leased = admin.lease("paged", batch_size=2, wait=5)
    v = Visitor(url)
    v.log_in(ADMIN)
    first = v.get("/q/paged/items")
    assert first.text.count('class="item"') == 50 and 'id="next"' in first.text
    assert "hex, 8 bytes" in first.text and "text, 10 bytes" in first.text and "json" in first.text
    leased_page = v.get("/q/paged/items?state=leased")
    assert leased_page.text.count('class="item"') == 2
    ready = v.get("/q/paged/items?state=ready")
    assert ready.text.count('class="item"') == 50 and f'data-id="{leased[0].id}"' not in ready.text
    nxt = first.text.split('id="next" href="')[1].split('"')[0].replace("&amp;", "&")
    second = v.get(nxt)
    assert second.text.count('class="item"') == 50 and '"i": 48' in html.unescape(second.text)


def test_the_item_view_shows_each_items_priority(url: str, admin: querator.Client) -> None:
    admin.create_queue("ranked", partitions=1)
    admin.produce("ranked", [querator.Item("urgent", priority=7), "plain"])
    v = Visitor(url)
    v.log_in(ADMIN)
    page = v.get("/q/ranked/items").text
    assert "<th class=\"n\">Priority</th>" in page
    assert sorted(re.findall(r'<td class="n priority">(\d+)</td>', page)) == ["0", "7"]


def test_payload_preview_forms() -> None:
    assert preview(b'{"a": [1, 2]}').form == "json"
    assert preview("héllo\nworld".encode()).text == "héllo\nworld"
    binary = preview(bytes(range(40)))
    assert binary.form == "hex" and binary.text.startswith("00000000  00 01 02")
    big = preview("é".encode() * 3000)  # cut inside a character: still text
    assert big.form == "text" and big.cut and big.size == 6000
    assert preview(b"").form == "empty"


def test_a_field_the_generated_code_lacks_reads_as_none() -> None:
    item = storage_pb2.StorageItem(kind="k")
    assert field(item, "kind") == "k"
    assert field(item, "no_such_field") is None


def test_durations_read_short() -> None:
    from querator.console._format import seconds_text

    assert [seconds_text(x) for x in (0.5, 5, 60, 61, 3600, 3660, 86400, 90000)] == [
        "500ms", "5s", "1m", "1m 1s", "1h", "1h 1m", "1d", "1d 1h",
    ]  # fmt: skip


def test_tls_and_a_key_given_on_the_command_line(tmp_path: Path) -> None:
    certs = make_certificates(tmp_path)
    with server(tls=certs, admin_token=ADMIN) as tls_srv, tls_srv.client() as c:
        c.create_queue("secure")
        c.produce("secure", ["a", "b"])
        address = tls_srv.address.replace("127.0.0.1", "localhost")
        with console(address, "--tls-ca", str(certs.ca), "--token", ADMIN) as base:
            page = Visitor(base).get("/q/secure")
            assert page.status == 200 and count(page.text, "ready") == 2
        # Without the CA the console cannot reach it, and says so on the page.
        with console(address, "--tls", "--token", ADMIN, "--timeout", "2s") as base:
            page = Visitor(base).get("/")
            assert page.status == 502 and "cannot reach the server" in page.text and "UNAVAILABLE" in flash(page.text)


def test_rates_come_from_the_servers_counters() -> None:
    from collections import deque

    from querator.console._sampler import Sample, Sampler

    sampler = Sampler()
    # Two partitions over 20 s: 30 + 10 produced, 20 completed, and partition 1's node
    # restarted between the last two samples (its counter fell from 10 to 4: 4 since).
    sampler._series["q"] = deque(
        [
            Sample(100.0, 0, 0, 0, 0, produced=(100, 0), completed=(50, 0)),
            Sample(110.0, 0, 0, 0, 0, produced=(120, 10), completed=(60, 0)),
            Sample(120.0, 0, 0, 0, 0, produced=(130, 4), completed=(70, 0)),
        ]
    )
    rates = sampler.rates("q")
    assert rates is not None
    assert (rates.in_per_min, rates.out_per_min, rates.seconds) == ((30 + 10 + 4) * 3, 20 * 3, 20.0)
    # Only what the window covers: the last 5 minutes.
    sampler._series["q"].append(Sample(500.0, 0, 0, 0, 0, produced=(130, 4), completed=(70, 0)))
    idle = sampler.rates("q")
    assert idle is not None and (idle.in_per_min, idle.out_per_min) == (0.0, 0.0)


def test_the_queue_page_shows_produce_and_complete_rates(url: str, admin: querator.Client) -> None:
    admin.create_queue("busy")
    v = Visitor(url)
    v.log_in(ADMIN)
    v.get("/q/busy")  # the first sample
    admin.produce("busy", [str(i) for i in range(30)])
    for item in admin.lease("busy", batch_size=10, wait=5):
        item.complete()
    time.sleep(1.1)  # a page keeps at most one sample a second
    page = v.get("/q/busy")
    rates = re.search(r'id="rates">([\d.]+) / ([\d.]+)<', page.text)
    assert rates is not None, page.text
    produced, completed = float(rates.group(1)), float(rates.group(2))
    # 30 and 10 items over the span between the two samples (a little over a second).
    assert 0 < produced < 30 * 60 and produced == pytest.approx(3 * completed, rel=0.01)


def test_visitors_with_different_keys_share_one_sampler_and_see_only_queues_their_key_reads(
    url: str, admin: querator.Client
) -> None:
    admin.create_queue("shared-rates")
    admin.create_queue("hidden-rates")
    first, second = Visitor(url), Visitor(url)
    first.log_in(ADMIN)  # its queue list: a sample of each, taken with the first visitor's key
    admin.produce("shared-rates", [str(i) for i in range(30)])
    admin.produce("hidden-rates", [str(i) for i in range(30)])
    time.sleep(1.1)  # a page keeps at most one sample a second
    # The second visitor's first pages: the rates already span the first visitor's sample.
    second.log_in(admin.create_key("consumer", ["shared-*"]).token)
    page = second.get("/q/shared-rates")
    rates = re.search(r'id="rates">([\d.]+) / ([\d.]+)<', page.text)
    assert rates is not None, page.text
    assert float(rates.group(1)) > 0 and float(rates.group(2)) == 0
    # A queue outside the key's patterns: no page, no row, whatever the sampler holds.
    hidden = second.get("/q/hidden-rates")
    assert hidden.status in (403, 404) and 'id="rates"' not in hidden.text
    assert "hidden-rates" not in second.get("/").text
    assert 'data-queue="hidden-rates"' in first.get("/").text


def test_the_shared_sampler_goes_on_with_the_remaining_sessions_key_when_one_ends(
    srv: EmbeddedServer, admin: querator.Client, monkeypatch: pytest.MonkeyPatch
) -> None:
    import asyncio

    from querator import AsyncClient
    from querator.console import _sampler
    from querator.console._sessions import Sessions

    monkeypatch.setattr(_sampler, "INTERVAL", 0.2)
    admin.create_queue("polled")
    narrow = admin.create_key("consumer", ["polled"]).token

    async def main() -> None:
        sampler = _sampler.Sampler()
        sessions = Sessions(lambda token: AsyncClient(srv.address, bearer_token=token), sampler)

        async def check(api: object) -> None:
            return None

        try:
            first = await sessions.log_in(await sessions.new(), narrow, check)
            second = await sessions.log_in(await sessions.new(), ADMIN, check)
            assert first.sampler is sampler and second.sampler is sampler
            assert first.api is not None and second.api is not None
            sampler.watch(["polled"], first.api)
            sampler.watch(["polled"], second.api)  # the last to show it: polled with its key
            await sessions.drop(second)  # its client closed: the first one's key takes over
            sampler.record("polled", await first.api.stats("polled"))  # as its page would
            before = len(sampler.series("polled"))
            await asyncio.to_thread(admin.produce, "polled", ["a", "b", "c"])
            deadline = time.monotonic() + 20
            while (rates := sampler.rates("polled")) is None or rates.in_per_min == 0:
                assert time.monotonic() < deadline, sampler.series("polled")
                await asyncio.sleep(0.1)
            assert len(sampler.series("polled")) > before  # taken by the loop: no page read them
        finally:
            await sessions.close()
            await sampler.stop()

    asyncio.run(main())


def test_an_action_returns_only_to_a_page_of_the_console(url: str, admin: querator.Client) -> None:
    admin.create_queue("stay-here")
    v = Visitor(url)
    token = csrf(v.log_in(ADMIN).text)
    for back in ("//evil.example/x", "/\\evil.example/x", "https://evil.example/", "/q/stay-here"):
        reply = v.post("/q/stay-here/action/purge", {"csrf": token, "confirm": "no", "back": back})
        assert reply.url == url.rstrip("/") + ("/q/stay-here" if back == "/q/stay-here" else "/"), (back, reply.url)


def test_the_command_without_the_extra_says_what_to_install() -> None:
    import subprocess
    import sys

    script = "import sys; sys.modules['uvicorn'] = None; from querator.cli import main; sys.exit(main(['console']))"
    done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=60)
    assert done.returncode == 2 and "pip install 'querator-client[console]'" in done.stderr


def test_listen_addresses() -> None:
    from querator.cli._common import UsageError
    from querator.cli.console import is_loopback, split_listen

    assert split_listen("127.0.0.1:2320") == ("127.0.0.1", 2320)
    assert split_listen("[::1]:80") == ("::1", 80)
    assert [is_loopback(h) for h in ("127.0.0.1", "::1", "localhost", "0.0.0.0", "10.1.2.3")] == [True, True, True, False, False]
    for bad in ("2320", "host:", "host:99999"):
        with pytest.raises(UsageError):
            split_listen(bad)


def test_a_revoked_key_ends_its_session(url: str, admin: querator.Client) -> None:
    created = admin.create_key("producer", ["*"])
    v = Visitor(url)
    assert 'id="queues"' in v.log_in(created.token).text
    admin.revoke_key(created.key_id)
    assert v.get("/").url.endswith("/login")  # the session is dropped, not just refused
    assert v.log_in(created.token).status == 401


def test_a_request_for_another_host_name_is_refused(srv: EmbeddedServer) -> None:
    # DNS rebinding: a page of evil.example, resolved to 127.0.0.1, asks the console.
    import urllib.request

    with console(srv.address, "--token", ADMIN) as base:
        v = Visitor(base)
        assert v.get("/").status == 200
        request = urllib.request.Request(base, headers={"Host": "evil.example:2320"})
        assert v._open(request).status == 400
        named = urllib.request.Request(base, headers={"Host": "localhost"})
        assert v._open(named).status == 200
    with console(srv.address, "--token", ADMIN, "--allowed-host", "console.example") as base:
        v = Visitor(base)
        assert v.get("/").status == 400  # 127.0.0.1 is not among the names given
        named = urllib.request.Request(base, headers={"Host": "console.example"})
        assert v._open(named).status == 200


def test_a_page_can_refresh_itself(url: str, admin: querator.Client) -> None:
    admin.create_queue("watched")
    v = Visitor(url)
    v.log_in(ADMIN)
    plain = v.get("/q/watched")
    assert 'http-equiv="refresh"' not in plain.text and "Refresh every 10 s" in plain.text
    assert 'content="10"' in v.get("/q/watched?refresh=10").text
    assert 'content="5"' in v.get("/?refresh=1").text  # at least 5 s
    assert 'http-equiv="refresh"' not in v.get("/?refresh=oops").text


def test_a_paused_queue_says_so(url: str, admin: querator.Client) -> None:
    admin.create_queue("held")
    admin.pause_queue("held", produce=True)
    v = Visitor(url)
    v.log_in(ADMIN)
    assert "paused, produce too" in v.get("/").text
    assert 'id="paused"' in v.get("/q/held").text and "refuses produce" in v.get("/q/held").text
    admin.resume_queue("held")
    assert 'id="paused"' not in v.get("/q/held").text
