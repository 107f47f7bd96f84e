"""What the dashboard's browser tests drive: a headless Chromium through its Debian chromedriver (never
Selenium Manager, which would download one), and `gpumesh dashboard` as the real process a user starts.

The dashboard swaps its live regions' innerHTML about once a second, so an element found a moment ago
may be gone: everything here reads the page in one JavaScript call (one turn of the page's event loop,
which no swap can interrupt) instead of holding Selenium element references across waits."""

from __future__ import annotations

import os
import queue
import re
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

import psutil
import pytest

from .conftest import ROOT, free_port, wait_until

# Where the pages' screenshots go: docs/screenshots/ (docs/how-to/watch.md shows them) when GPUMESH_SCREENSHOTS=1,
# so a test run leaves the checkout as it was; a temporary directory otherwise (still taken: a page that
# cannot be captured fails its test).
SCREENSHOTS = ROOT / "docs" / "screenshots"
WINDOW = (1400, 900)
NEEDS = (
    "the dashboard's browser tests need Chromium and its chromedriver (CI installs them): "
    "apt install chromium chromium-driver"
)


def launch() -> Any:
    """A headless Chromium, fixed window size; fails (never skips) when Chromium or Selenium is missing."""
    try:
        from selenium import webdriver
        from selenium.webdriver.chrome.service import Service
    except ImportError:
        pytest.fail("the dashboard's browser tests need selenium: pip install -e '.[test]'")
    binary = shutil.which("chromium") or shutil.which("chromium-browser")
    driver_path = shutil.which("chromedriver") or "/usr/lib/chromium/chromedriver"
    if binary is None or not Path(driver_path).is_file():
        pytest.fail(f"{NEEDS} (found chromium: {binary}, chromedriver: {shutil.which('chromedriver')})")
    options = webdriver.ChromeOptions()
    options.binary_location = binary
    for arg in ("--headless=new", "--no-sandbox", "--disable-dev-shm-usage", "--disable-gpu",
                f"--window-size={WINDOW[0]},{WINDOW[1]}", "--hide-scrollbars"):  # fmt: skip
        options.add_argument(arg)
    driver = webdriver.Chrome(service=Service(driver_path), options=options)
    # the viewport is WINDOW (the window's size would include the browser's bars): the screenshots' size
    driver.execute_cdp_cmd("Emulation.setDeviceMetricsOverride",
                           {"width": WINDOW[0], "height": WINDOW[1], "deviceScaleFactor": 1, "mobile": False})  # fmt: skip
    driver.set_page_load_timeout(20)
    driver.set_script_timeout(20)
    return driver


def quit(driver: Any) -> None:
    """Quit the browser, and reap what it leaves behind. Chromium's helper processes outlive chromedriver,
    and once an in-process worker (conftest's MeshWorkers) has made this test process a subreaper, as every
    gpumesh worker is, they come back to it when orphaned: the zombies they become would be children
    that later tests trip over (tests/sandbox/test_spares.py lists this process's children)."""
    driver.quit()
    deadline = time.monotonic() + 10
    while True:
        alive = 0
        for p in psutil.Process().children():
            try:
                if not p.name().startswith(("chrome", "chromium")):
                    continue
                if p.status() == psutil.STATUS_ZOMBIE:
                    os.waitpid(p.pid, os.WNOHANG)
                else:
                    alive += 1
            except (psutil.Error, ChildProcessError):
                continue
        if not alive or time.monotonic() > deadline:
            return
        time.sleep(0.1)


class Dashboard:
    """`gpumesh dashboard --url URL --port FREE` in its own process group; ``base`` is the address it
    printed, ``mode`` what it said it may do ("read-only" or "may cancel and retry")."""

    LINE = re.compile(r"gpumesh dashboard: (http://\S+?)/? \((read-only|may cancel and retry)\)")
    TOKEN = re.compile(r"to cancel and retry, open (http://\S+\?token=\S+)")

    def __init__(self, env: dict[str, str], url: str, tmp: Path) -> None:
        self.port = free_port()
        self.stderr_path = tmp / f"dashboard-{self.port}.err"
        with open(self.stderr_path, "wb") as err:
            self.proc = subprocess.Popen(
                [sys.executable, "-m", "gpumesh", "dashboard", "--url", url, "--port", str(self.port)],
                env=env, stdout=subprocess.PIPE, stderr=err, text=True, start_new_session=True,
            )  # fmt: skip
        self.lines: list[str] = []
        found: queue.Queue[re.Match[str] | None] = queue.Queue()
        # drained until it exits: uvicorn may log every request, and a full pipe would stall the server
        self.reader = threading.Thread(target=self._read, args=(found,), daemon=True)
        self.reader.start()
        try:
            match = found.get(timeout=30)
        except queue.Empty:
            match = None
        if match is None:
            self.stop()
            pytest.fail(f"`gpumesh dashboard` did not print its address: {self.output()}")
        self.base, self.mode = match.group(1), match.group(2)
        self.login = ""  # the address with the access token a dashboard that may write prints next
        if self.mode != "read-only":
            wait_until(lambda: any(self.TOKEN.search(line) for line in self.lines), timeout=10,
                       what="the dashboard to print its access token")  # fmt: skip
            self.login = next(m.group(1) for m in map(self.TOKEN.search, self.lines) if m)

    def _read(self, found: queue.Queue[re.Match[str] | None]) -> None:
        assert self.proc.stdout
        told = False
        for line in self.proc.stdout:
            self.lines.append(line.rstrip("\n"))
            match = self.LINE.search(line)
            if match and not told:
                found.put(match)
                told = True
        self.proc.stdout.close()
        if not told:
            found.put(None)  # it exited without saying where it listens

    def output(self) -> str:
        return f"exit {self.proc.poll()}; stdout: {self.lines!r}; stderr: {self.stderr_path.read_text()[-3000:]}"

    def url(self, path: str) -> str:
        return self.base + path

    def stop(self) -> float:
        """SIGTERM, as a service manager stops it; returns the seconds it took to exit (killed after 15)."""
        started = time.monotonic()
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(timeout=15)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        self.reader.join(timeout=5)
        return time.monotonic() - started


def open_page(driver: Any, url: str) -> None:
    """Load a page and leave a marker on its window: still there later means the page was not reloaded."""
    driver.get(url)
    driver.execute_script("window.__marker = 1;")


def not_reloaded(driver: Any) -> bool:
    return bool(driver.execute_script("return window.__marker === 1;"))


_LIVE = "document.querySelector('[data-live]:not([data-append])')"


def await_live_swap(driver: Any, timeout: float = 5) -> bool:
    """Wait until the page's live region has had its HTML replaced by an event; False if it has none."""
    marked = driver.execute_script(f"const el = {_LIVE}; if (!el) return false; el.__before = el.firstElementChild;"
                                   "return true;")  # fmt: skip
    if marked:
        wait_until(lambda: driver.execute_script(f"const el = {_LIVE}; return !el || el.firstElementChild !== el.__before;"),
                   timeout=timeout, interval=0.1, what="a live update of the page")  # fmt: skip
    return bool(marked)


# One table row as {"data": its data-* attributes, "cells": {each class of each cell: its text}}.
_ROWS = """
return [...document.querySelectorAll(arguments[0])].map(tr => {
  const cells = {};
  for (const td of tr.querySelectorAll('td')) {
    for (const c of td.classList) cells[c] = td.textContent.trim();
  }
  return {data: {...tr.dataset}, cells: cells, text: tr.textContent};
});
"""


def rows(driver: Any, selector: str) -> list[dict[str, Any]]:
    return list(driver.execute_script(_ROWS, selector))


def data(driver: Any, selector: str) -> dict[str, str] | None:
    """The data-* attributes of the first element matching ``selector``; None when there is none."""
    return driver.execute_script("const e = document.querySelector(arguments[0]); return e && {...e.dataset};",
                                 selector)  # fmt: skip


def click(driver: Any, selector: str, timeout: float = 5) -> None:
    """Click what ``selector`` finds, found again when a live update swapped it out between the find and the
    click (Selenium's StaleElementReferenceException: a person's click lands on what is there)."""
    from selenium.common.exceptions import StaleElementReferenceException

    deadline = time.monotonic() + timeout
    while True:
        try:
            driver.find_element("css selector", selector).click()
            return
        except StaleElementReferenceException:
            if time.monotonic() > deadline:
                raise


def exists(driver: Any, selector: str) -> bool:
    return bool(driver.execute_script("return document.querySelector(arguments[0]) !== null;", selector))


def screenshot(driver: Any, name: str) -> Path:
    """Save the window as NAME.png: into docs/screenshots/ with GPUMESH_SCREENSHOTS=1, else a temporary dir."""
    where = (
        SCREENSHOTS if os.environ.get("GPUMESH_SCREENSHOTS") == "1" else Path(tempfile.gettempdir()) / "gpumesh-shots"
    )
    where.mkdir(parents=True, exist_ok=True)
    path = where / f"{name}.png"
    assert driver.save_screenshot(str(path)), f"could not save {path}"
    return path
