"""Fixtures for the browser test: Debian's Chromium driven by selenium through Debian's chromedriver.

Nothing is downloaded: selenium gets explicit paths (``Service(executable_path=...)``,
``options.binary_location``), so Selenium Manager is never run; ``SE_OFFLINE`` is set as well, and
Selenium Manager is patched to fail the test if anything calls it anyway.

Install the browser with ``.ci/install-browser`` (Debian packages ``chromium`` and ``chromium-driver``);
without it (or without selenium) the test is skipped with a message that says so.
"""

from __future__ import annotations

import json
import os
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import pytest
import trio

# Debian's packages; the variables are for other layouts (never a downloaded browser).
CHROMIUM = Path(os.environ.get("CHUNKLINE_CHROMIUM", "/usr/bin/chromium"))
CHROMEDRIVER = Path(os.environ.get("CHUNKLINE_CHROMEDRIVER", "/usr/bin/chromedriver"))
ROOT = Path(__file__).resolve().parents[2]
SKIP_BROWSER = "chromium/chromedriver not installed: run .ci/install-browser"  # + the missing paths
SKIP_SELENIUM = "selenium not installed: pip install -e '.[test]'"

# The flags that work on a closed network as root (no sandbox), with no GPU and no background traffic.
# Even with --disable-background-networking, Chromium looks up Google's hosts (autofill, sign-in,
# optimization hints, ...); the resolver rule makes every name but the loopback server unresolvable inside
# the browser, so no DNS query or connection leaves the machine.
CHROMIUM_FLAGS = (
    "--headless",
    "--no-sandbox",
    "--disable-gpu",
    "--disable-quic",
    "--no-first-run",
    "--no-default-browser-check",
    "--disable-background-networking",
    "--disable-component-update",
    "--disable-sync",
    "--disable-extensions",
    "--disable-default-apps",
    "--disable-client-side-phishing-detection",
    "--disable-domain-reliability",
    "--disable-breakpad",
    "--metrics-recording-only",
    "--password-store=basic",
    "--use-mock-keychain",
    "--disable-features=AutofillServerCommunication,OptimizationHints,MediaRouter,Translate",
    "--host-resolver-rules=MAP * ~NOTFOUND, EXCLUDE 127.0.0.1, EXCLUDE localhost",
    "--disable-background-timer-throttling",
    "--disable-renderer-backgrounding",
    "--disable-dev-shm-usage",
    "--window-size=1280,1400",
)


def _executable(path: Path) -> bool:
    return path.is_file() and os.access(path, os.X_OK)


@pytest.fixture
def artifacts_dir() -> Path:
    """``$CHUNKLINE_ARTIFACTS/e2e`` when that is set, else ``./test-artifacts/e2e`` in the repository."""
    base = os.environ.get("CHUNKLINE_ARTIFACTS")
    path = Path(base) / "e2e" if base else ROOT / "test-artifacts" / "e2e"
    path.mkdir(parents=True, exist_ok=True)
    return path


@pytest.fixture
def offline_selenium(monkeypatch: pytest.MonkeyPatch) -> None:
    """Skip without selenium or the browser; make sure Selenium Manager (which downloads drivers) never runs."""
    pytest.importorskip("selenium", reason=SKIP_SELENIUM)
    missing = [str(path) for path in (CHROMIUM, CHROMEDRIVER) if not _executable(path)]
    if missing:
        pytest.skip(f"{SKIP_BROWSER} (missing {', '.join(missing)})")
    from selenium.webdriver.common.selenium_manager import SeleniumManager

    def refuse(*args: Any, **kwargs: Any) -> Any:
        raise AssertionError("Selenium Manager was called: it may download a browser or driver")

    monkeypatch.setenv("SE_OFFLINE", "true")
    monkeypatch.setattr(SeleniumManager, "binary_paths", refuse)


def _new_driver(profile: Path, driver_log: Path) -> Any:
    from selenium import webdriver
    from selenium.webdriver.chrome.service import Service

    options = webdriver.ChromeOptions()
    options.binary_location = str(CHROMIUM)
    for flag in CHROMIUM_FLAGS:
        options.add_argument(flag)
    profile.mkdir(parents=True)
    options.add_argument(f"--user-data-dir={profile}")  # a new, empty profile per browser
    options.set_capability("goog:loggingPrefs", {"browser": "ALL"})
    service = Service(executable_path=str(CHROMEDRIVER), log_output=str(driver_log))
    driver = webdriver.Chrome(options=options, service=service)
    driver.set_page_load_timeout(20)
    driver.set_script_timeout(10)
    return driver


class Browser:
    """One headless Chromium: ``driver`` (blocking selenium API) and its console messages so far."""

    def __init__(self, name: str, driver: Any) -> None:
        self.name = name
        self.driver = driver
        self.console: list[dict[str, Any]] = []

    def read_console(self) -> list[dict[str, Any]]:
        """Blocking: move the browser's new console entries into ``console`` and return them all."""
        self.console.extend(self.driver.get_log("browser"))
        return self.console


class Browsers:
    """``await browsers(name)``: a new headless Chromium with its own empty profile, as a :class:`Browser`."""

    def __init__(self, profiles: Path, artifacts: Path) -> None:
        self.profiles = profiles
        self.artifacts = artifacts
        self.opened: list[Browser] = []

    async def __call__(self, name: str) -> Browser:
        driver = await trio.to_thread.run_sync(
            _new_driver, self.profiles / f"profile-{name}", self.artifacts / f"{name}.chromedriver.log"
        )
        self.opened.append(Browser(name, driver))
        return self.opened[-1]

    def close(self) -> None:
        """Blocking: save each browser's console as ``<name>.console.json`` and quit it."""
        from selenium.common.exceptions import WebDriverException

        for browser in self.opened:
            try:
                browser.read_console()
            except (WebDriverException, OSError) as exc:  # a dead browser: keep quitting
                browser.console.append({"level": "TEST", "message": f"could not read the console: {exc!r}"})
            finally:
                (self.artifacts / f"{browser.name}.console.json").write_text(json.dumps(browser.console, indent=1))
                browser.driver.quit()


@pytest.fixture
async def browsers(offline_selenium: None, tmp_path: Path, artifacts_dir: Path) -> AsyncIterator[Browsers]:
    """Headless Chromiums for one test; all quit at teardown, their consoles saved as artifacts."""
    opened = Browsers(tmp_path, artifacts_dir)
    try:
        yield opened
    finally:
        with trio.CancelScope(shield=True):
            await trio.to_thread.run_sync(opened.close)
