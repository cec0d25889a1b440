"""The console in a real headless browser: Debian's Chromium driven through its
ChromeDriver by Selenium, against a real server with API keys. Logs in, browses a
queue, opens a dead letter and reads its error, redrives it and sees the count change,
and sees the server refuse an action to a consumer key.

Screenshots go to the test's temporary directory; with QUERATOR_UPDATE_SCREENSHOTS=1
they replace docs/images/console-*.png, which docs/console.md shows. With CI=true a
missing chromium, chromedriver or selenium fails the test instead of skipping it
(./dev setup and ./dev test install the Debian packages).
"""

from __future__ import annotations

import json
import os
import shutil
import tempfile
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any, TypeVar

import pytest
from console_helpers import console

import querator
from querator.testing import server

from sdk_helpers import run_until_empty, wait_until

ADMIN = "browser-admin-token"
DOCS_IMAGES = Path(__file__).resolve().parents[3] / "docs" / "images"
T = TypeVar("T")


def _need(what: str) -> None:
    message = f"the console's browser test needs {what} (apt-get install chromium chromium-driver; pip install selenium)"
    if os.environ.get("CI") == "true":
        pytest.fail(message)
    pytest.skip(message)


@pytest.fixture
def browser(tmp_path: Path) -> Iterator[Any]:
    try:
        from selenium import webdriver
        from selenium.webdriver.chrome.service import Service
    except ModuleNotFoundError:
        _need("selenium")
    chromium, driver = shutil.which("chromium"), shutil.which("chromedriver")
    if chromium is None or driver is None:
        _need("chromium and chromedriver")
    options = webdriver.ChromeOptions()
    options.binary_location = chromium
    # No network here: without these Chromium waits on refused connections.
    for arg in (
        "--headless=new", "--no-sandbox", "--disable-gpu", "--disable-background-networking",
        "--disable-component-update", "--disable-sync", "--no-first-run", "--window-size=1280,900",
        "--disable-dev-shm-usage",  # a container's small /dev/shm crashes tabs
        f"--user-data-dir={tempfile.mkdtemp(dir=tmp_path, prefix='chromium-')}",
    ):  # fmt: skip
        options.add_argument(arg)
    b = webdriver.Chrome(options=options, service=Service(driver))
    b.set_page_load_timeout(20)
    try:
        yield b
    finally:
        b.quit()


class PaymentDeclined(Exception):
    pass


def charge(item: querator.LeasedItem) -> None:
    order = item.json()["order"]
    raise PaymentDeclined(f"card ending 4242 was declined (order {order})")


def _dead_letters_with_errors(client: querator.Client) -> None:
    client.create_queue("orders-dlq")
    client.create_queue("orders", dead_queue="orders-dlq", partitions=2, max_attempts=5, reference="checkout orders")
    client.create_queue("emails")
    for name in ("invoices", "reports", "thumbnails"):
        client.create_queue(name)

    def orders(numbers: range) -> list[querator.Item]:
        return [querator.Item(json.dumps({"order": n, "total": 10 * n}).encode(), kind="charge", encoding="application/json",
                              metadata={"traceparent": f"00-{n:032x}-{n:016x}-01"}) for n in numbers]  # fmt: skip

    # Three orders a real worker fails: its handler raises, dead_on gives the item up
    # at once, and the worker sends the exception as the item's failure text.
    client.produce("orders", orders(range(15, 18)))
    worker = querator.Worker(client, "orders", charge, dead_on=[PaymentDeclined], lease_wait=0.2, handle_signals=False)
    run_until_empty(worker, timeout=30)
    assert worker.stats.dead == 3, worker.stats
    client.produce("orders", orders(range(18, 45)))
    client.produce("emails", ["welcome", "receipt", "reset"])
    # The hand-over to the dead-letter queue follows the Retry's answer.
    wait_until(lambda: client.queue_stats("orders-dlq").ready == 3)


# How ChromeDriver may report a node of a page that has been replaced (a navigation
# under way): as a stale element, or, when the node was resolved before the page went,
# as an "unknown error" of the DevTools inspector ("Node with given id does not belong
# to the document"), which Selenium's staleness_of and ignored_exceptions do not expect.
DETACHED = ("does not belong to the document", "No node with given id")


class Page:
    """The browser's current page, read through CSS selectors found afresh on each use:
    an element held across steps can belong to a page that has since been replaced."""

    def __init__(self, browser: Any, shots: Path) -> None:
        from selenium.common.exceptions import StaleElementReferenceException, WebDriverException
        from selenium.webdriver.common.by import By
        from selenium.webdriver.support.ui import WebDriverWait

        self.browser, self.shots = browser, shots
        self._stale, self._error, self._by, self._wait = StaleElementReferenceException, WebDriverException, By, WebDriverWait

    def detached(self, exc: Exception) -> bool:
        return isinstance(exc, self._stale) or any(text in str(exc) for text in DETACHED)

    def until(self, condition: Callable[[], bool], timeout: float = 15) -> None:
        self._wait(self.browser, timeout, poll_frequency=0.1).until(lambda _: condition())

    def settled(self, step: Callable[[], T], timeout: float = 15) -> T:
        """What ``step`` returns. A step finds its elements afresh, so it is run again
        while the page it found them on was being replaced (for at most ``timeout``
        seconds); any other error fails the test at once. Steps that change the page
        are written to be safe to repeat."""
        done: list[T] = []

        def attempt() -> bool:
            try:
                done.append(step())
            except self._error as exc:
                if not self.detached(exc):
                    raise
                return False
            return True

        self.until(attempt, timeout)
        return done[0]

    def find(self, css: str) -> Any:
        return self.browser.find_element(self._by.CSS_SELECTOR, css)

    def text(self, css: str) -> str:
        return self.settled(lambda: str(self.find(css).text))

    def how_many(self, css: str) -> int:
        return self.settled(lambda: len(self.browser.find_elements(self._by.CSS_SELECTOR, css)))

    def count(self, what: str) -> int:
        return int(self.text(f"#count-{what}"))

    def flash(self, kind: str) -> str:
        return self.text(f"#flash-{kind}")

    def type_into(self, css: str, value: str) -> None:
        def step() -> None:
            field = self.find(css)
            field.clear()
            field.send_keys(value)

        self.settled(step)

    def open_details(self, row: str) -> None:
        """Open the details of ``row`` (its summary clicked, once)."""

        def step() -> None:
            if self.find(f"{row} details").get_attribute("open") is None:
                self.find(f"{row} details summary").click()

        self.settled(step)

    def tick(self, css: str) -> None:
        """Check the checkbox ``css`` (clicked, once)."""

        def step() -> None:
            box = self.find(css)
            if not box.is_selected():
                box.click()

        self.settled(step)

    def follow(self, by: str, value: str) -> None:
        """Click a link or a submit button and wait until the next page has replaced
        this one and loaded."""
        page = self.settled(lambda: self.browser.find_element(self._by.TAG_NAME, "html"))
        try:
            self.settled(lambda: self.browser.find_element(by, value)).click()
        except self._error as exc:
            # ChromeDriver may look at the clicked node after the page it was on is gone.
            if not self.detached(exc):
                raise

        def replaced() -> bool:
            try:
                page.is_enabled()
            except self._error as exc:
                if self.detached(exc):
                    return True
                raise
            return False

        self.until(replaced)
        self.until(lambda: self.settled(lambda: self.browser.execute_script("return document.readyState")) == "complete")

    def shot(self, name: str) -> None:
        self.browser.save_screenshot(str(self.shots / f"console-{name}.png"))


def test_console_in_a_browser(browser: Any, tmp_path: Path) -> None:
    from selenium.webdriver.common.by import By

    shots = tmp_path / "shots"
    shots.mkdir()
    page = Page(browser, shots)

    with server(admin_token=ADMIN) as srv, srv.client() as admin:
        _dead_letters_with_errors(admin)
        consumer = admin.create_key("consumer", ["*"], description="a worker's key").token
        with console(srv.address) as url:
            started = time.monotonic()
            # Log in: the page asks for a key; the key goes to the console, not the URL.
            browser.get(url)
            assert browser.current_url.endswith("/login")
            page.type_into("#token", ADMIN)
            page.follow(By.ID, "login")
            assert page.text('tr[data-queue="orders"] td.ready') == "27"
            assert ADMIN not in browser.current_url

            # Browse a queue: its page (three times, the depth chart gets a sample each
            # time while work comes and goes), then its items.
            page.follow(By.LINK_TEXT, "orders")
            assert page.count("ready") == 27
            for change in ("produce", "work"):
                if change == "produce":
                    admin.produce("orders", [json.dumps({"order": n}) for n in range(100, 112)], kind="charge")
                else:
                    for item in admin.lease("orders", batch_size=12, wait=5):
                        item.complete()
                time.sleep(1.1)
                browser.refresh()
            assert page.how_many("svg.chart path.line")
            assert page.count("ready") == 27
            assert page.how_many("#partitions tbody tr") == 2
            page.shot("queue")
            page.follow(By.LINK_TEXT, "Items")
            assert page.how_many("#items tr.item")
            page.open_details("#items tr.item")  # the first row's
            assert '"order"' in page.text("#items tr.item pre.payload")
            page.shot("items")

            # The dead letters: open one and read the error that killed it.
            browser.get(url + "q/orders-dlq/dead")
            assert page.count("ready") == 3
            page.open_details("#items tr.item")
            error = page.text("#items tr.item pre.last-error")
            order = json.loads(page.text("#items tr.item pre.payload"))["order"]
            # The handler's exception: its type and message, then the frame that raised it.
            assert f"PaymentDeclined: card ending 4242 was declined (order {order})" in error, error
            assert "Traceback" in error and ", in charge\n" in error, error
            assert "retry_dead" in page.text("#items tr.item")
            page.shot("dead-letters")

            # Redrive the one selected back to orders: the count goes down by one.
            page.tick('#items tr.item input[name="item"]')
            assert page.settled(lambda: page.find("#redrive-to").get_attribute("value")) == "orders"
            page.follow(By.ID, "redrive-selected")
            assert "Redrove 1 selected item(s) from orders-dlq to orders" in page.flash("ok")
            assert page.count("ready") == 2
            # And the rest, with RedriveItems.
            page.follow(By.ID, "redrive-all")
            assert "Redrove 2 item(s)" in page.flash("ok")
            assert page.count("ready") == 0
            assert admin.queue_stats("orders").ready == 30
            page.shot("redriven")
            # The queues again, now that the console has sampled them for a while.
            browser.get(url)
            assert page.text('tr[data-queue="orders"] td.ready') == "30"
            page.shot("queues")

            # A consumer key: it may look, but the server refuses a purge, and the page says so.
            page.follow(By.CSS_SELECTOR, "header button.link")  # log out
            assert browser.current_url.endswith("/login")
            page.type_into("#token", consumer)
            page.follow(By.ID, "login")
            browser.get(url + "q/orders")
            assert page.count("ready") == 30
            assert not page.settled(lambda: page.find("#purge").is_enabled())  # until the name is typed
            page.type_into("#purge-confirm", "orders")
            page.follow(By.ID, "purge")
            refusal = page.flash("error")
            assert refusal.startswith("Refused by the server (PERMISSION_DENIED)"), refusal
            assert page.count("ready") == 30 and admin.queue_stats("orders").ready == 30
            browser.execute_script("window.scrollTo(0, 0)")
            page.shot("refused")

            browser.get(url + "cluster")
            assert page.how_many("#members tbody tr") == 1
            page.shot("cluster")
            print(f"browser steps took {time.monotonic() - started:.1f} s")
    if os.environ.get("QUERATOR_UPDATE_SCREENSHOTS") == "1":
        DOCS_IMAGES.mkdir(parents=True, exist_ok=True)
        for png in shots.glob("*.png"):
            shutil.copy(png, DOCS_IMAGES / png.name)
