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
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from console_helpers import console

import querator
from querator.testing import server

from sdk_helpers import run_until_empty, wait_until

ADMIN = "browser-admin-token"
DOCS_IMAGES = Path(__file__).resolve().parents[3] / "docs" / "images"


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


def test_console_in_a_browser(browser: Any, tmp_path: Path) -> None:
    from selenium.common.exceptions import WebDriverException
    from selenium.webdriver.common.by import By
    from selenium.webdriver.support import expected_conditions
    from selenium.webdriver.support.ui import WebDriverWait

    shots = tmp_path / "shots"
    shots.mkdir()

    def shot(name: str) -> None:
        browser.save_screenshot(str(shots / f"console-{name}.png"))

    def count(what: str) -> int:
        return int(browser.find_element(By.ID, f"count-{what}").text)

    def flash(kind: str) -> str:
        return str(browser.find_element(By.ID, f"flash-{kind}").text)

    def follow(element: Any) -> None:
        """Click a link or a submit button and wait for the next page to replace this one."""
        page = browser.find_element(By.TAG_NAME, "html")
        try:
            element.click()
        except WebDriverException as exc:
            # ChromeDriver may look at the clicked node after the page it was on is gone.
            if "does not belong to the document" not in str(exc):
                raise
        WebDriverWait(browser, 15).until(expected_conditions.staleness_of(page))

    with server(admin_token=ADMIN) as srv, srv.client() as admin:
        _dead_letters_with_errors(admin)
        consumer = admin.create_key("consumer", ["*"], description="a worker's key").token
        with console(srv.address) as url:
            started = time.monotonic()
            # Log in: the page asks for a key; the key goes to the console, not the URL.
            browser.get(url)
            assert browser.current_url.endswith("/login")
            browser.find_element(By.ID, "token").send_keys(ADMIN)
            follow(browser.find_element(By.ID, "login"))
            assert browser.find_element(By.CSS_SELECTOR, 'tr[data-queue="orders"] td.ready').text == "27"
            assert ADMIN not in browser.current_url

            # Browse a queue: its page (three times, the depth chart gets a sample each
            # time while work comes and goes), then its items.
            follow(browser.find_element(By.LINK_TEXT, "orders"))
            assert count("ready") == 27
            for change in ("produce", "work"):
                if change == "produce":
                    admin.produce("orders", [json.dumps({"order": n}) for n in range(100, 112)], kind="charge")
                else:
                    for item in admin.lease("orders", batch_size=12, wait=5):
                        item.complete()
                time.sleep(1.1)
                browser.refresh()
            assert browser.find_elements(By.CSS_SELECTOR, "svg.chart path.line")
            assert count("ready") == 27
            assert len(browser.find_elements(By.CSS_SELECTOR, "#partitions tbody tr")) == 2
            shot("queue")
            follow(browser.find_element(By.LINK_TEXT, "Items"))
            rows = browser.find_elements(By.CSS_SELECTOR, "#items tr.item")
            assert rows
            rows[0].find_element(By.CSS_SELECTOR, "details summary").click()
            assert '"order"' in rows[0].find_element(By.CSS_SELECTOR, "pre.payload").text
            shot("items")

            # The dead letters: open one and read the error that killed it.
            browser.get(url + "q/orders-dlq/dead")
            assert count("ready") == 3
            first = browser.find_elements(By.CSS_SELECTOR, "#items tr.item")[0]
            first.find_element(By.CSS_SELECTOR, "details summary").click()
            error = first.find_element(By.CSS_SELECTOR, "pre.last-error").text
            order = json.loads(first.find_element(By.CSS_SELECTOR, "pre.payload").text)["order"]
            # The handler's exception: its type and message, then the frame that raised it.
            assert f"PaymentDeclined: card ending 4242 was declined (order {order})" in error, error
            assert "Traceback" in error and ", in charge\n" in error, error
            assert "retry_dead" in first.text
            shot("dead-letters")

            # Redrive the one selected back to orders: the count goes down by one.
            first.find_element(By.CSS_SELECTOR, 'input[name="item"]').click()
            assert browser.find_element(By.ID, "redrive-to").get_attribute("value") == "orders"
            follow(browser.find_element(By.ID, "redrive-selected"))
            assert "Redrove 1 selected item(s) from orders-dlq to orders" in flash("ok")
            assert count("ready") == 2
            # And the rest, with RedriveItems.
            follow(browser.find_element(By.ID, "redrive-all"))
            assert "Redrove 2 item(s)" in flash("ok")
            assert count("ready") == 0
            assert admin.queue_stats("orders").ready == 30
            shot("redriven")
            # The queues again, now that the console has sampled them for a while.
            browser.get(url)
            assert browser.find_element(By.CSS_SELECTOR, 'tr[data-queue="orders"] td.ready').text == "30"
            shot("queues")

            # A consumer key: it may look, but the server refuses a purge, and the page says so.
            follow(browser.find_element(By.CSS_SELECTOR, "header button.link"))  # log out
            assert browser.current_url.endswith("/login")
            browser.find_element(By.ID, "token").send_keys(consumer)
            follow(browser.find_element(By.ID, "login"))
            browser.get(url + "q/orders")
            assert count("ready") == 30
            purge = browser.find_element(By.ID, "purge")
            assert not purge.is_enabled()  # until the name is typed
            browser.find_element(By.ID, "purge-confirm").send_keys("orders")
            follow(purge)
            refusal = flash("error")
            assert refusal.startswith("Refused by the server (PERMISSION_DENIED)"), refusal
            assert count("ready") == 30 and admin.queue_stats("orders").ready == 30
            browser.execute_script("window.scrollTo(0, 0)")
            shot("refused")

            browser.get(url + "cluster")
            assert len(browser.find_elements(By.CSS_SELECTOR, "#members tbody tr")) == 1
            shot("cluster")
            print(f"browser steps took {time.monotonic() - started:.1f} s")
    if os.environ.get("QUERATOR_UPDATE_SCREENSHOTS") == "1":
        DOCS_IMAGES.mkdir(parents=True, exist_ok=True)
        for png in shots.glob("*.png"):
            shutil.copy(png, DOCS_IMAGES / png.name)
