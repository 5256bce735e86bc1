"""The demo page in a real browser: headless Chromium (Debian's) driven by selenium (Debian's chromedriver).

One test, against the real server (hypercorn's trio ``serve`` on a loopback port, a small toy world):

1. controller: open ``/``, press Start, wait for the first frames (the preview chunk) — screenshot 1;
2. hold ``d`` on the page body: new frames arrive (the ``<img>`` gets a new ``src`` again and again) and
   the picture's content moves LEFT (``d`` steps the camera right): measured on the bottom rows, the
   nearest ground, which parallax moves the most (see ``spec_tests/pipelines/toy_world_views.py``) — screenshot 2;
3. press "Share as viewer" and open the link in a second browser: it joins as a viewer, shows no
   controls, and once the controller moves again it shows the same frames — screenshot 3;
4. press Stop: both pages say the stream is done and the session ends ``closed`` — screenshot 4.

Screenshots and the browsers' consoles go to ``$CHUNKLINE_ARTIFACTS/e2e`` (or ``./test-artifacts/e2e``).
Selenium's API blocks, so every browser call runs in ``trio.to_thread.run_sync`` while the server runs in
this test's nursery; every wait is a bounded ``WebDriverWait``. Skipped (with the reason) without
Chromium, chromedriver or selenium: see ``.ci/install-browser``.
"""

from __future__ import annotations

import json
import time
from functools import partial
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import trio
from hypercorn.config import Config
from hypercorn.trio import serve as hypercorn_serve

from pipelines.toy_world import ToyWorldConfig, ToyWorldService
from server.app import create_app
from server.settings import ServerSettings
from spec_tests.frames import near_ground_shift
from spec_tests.server.conftest import wait_ready

from .conftest import SKIP_SELENIUM, Browser, Browsers

pytest.importorskip("selenium", reason=SKIP_SELENIUM)

from selenium.common.exceptions import WebDriverException
from selenium.webdriver.common.action_chains import ActionChains
from selenium.webdriver.common.by import By
from selenium.webdriver.support.ui import WebDriverWait

TEST_DEADLINE = 60.0  # wall seconds for the whole test, browsers' start included
WAIT = 15.0  # seconds any one thing on a page may take
POLL = 0.05
HOLD_SECONDS = 1.5
TERMINAL = {"closed", "failed", "expired", "rejected"}

# The picture as the page shows it: the <img>'s current (decoded) frame drawn into a canvas, in grey levels.
READ_FRAME_JS = """
const img = document.getElementById("frame");
if (img.hidden || !img.src || !img.complete || !img.naturalWidth) return null;
const canvas = document.createElement("canvas");
canvas.width = img.naturalWidth;
canvas.height = img.naturalHeight;
const context = canvas.getContext("2d", { willReadFrequently: true });
context.drawImage(img, 0, 0);
const rgba = context.getImageData(0, 0, canvas.width, canvas.height).data;
const grey = new Array(canvas.width * canvas.height);
for (let i = 0; i < grey.length; i += 1) grey[i] = Math.round((rgba[4 * i] + rgba[4 * i + 1] + rgba[4 * i + 2]) / 3);
return {
  src: img.src,
  width: canvas.width,
  height: canvas.height,
  grey,
  frames: Number(document.getElementById("stat-frames").textContent),
};
"""


class Frame:
    def __init__(self, raw: dict[str, Any]) -> None:
        self.src: str = raw["src"]
        self.frames: int = raw["frames"]
        self.pixels = np.asarray(raw["grey"], dtype=np.float64).reshape(raw["height"], raw["width"])


def toy_loader(path: str, **_: Any) -> ToyWorldService:
    return ToyWorldService(ToyWorldConfig(height=64, width=96, frames_per_chunk=2), max_sessions=2)


def settings() -> ServerSettings:
    return ServerSettings(
        pipeline="pipelines/toy_world",
        max_sessions_per_worker=2,
        controller_timeout=60,
        room_empty_timeout=60,
    )


# -- blocking helpers (each runs in a worker thread) ---------------------------------------------


def wait(driver: Any, predicate: Any, what: str, timeout: float = WAIT) -> Any:
    return WebDriverWait(driver, timeout, poll_frequency=POLL).until(lambda d: predicate(d), message=what)


def text(driver: Any, element_id: str) -> str:
    return driver.find_element(By.ID, element_id).text


def participants(driver: Any) -> list[str]:
    """The identities in the room, as the page lists them (the "In room" stat's title)."""
    title = driver.find_element(By.ID, "stat-participants").get_attribute("title") or ""
    return [identity for identity in title.split(", ") if identity]


def controller_identity(driver: Any) -> str:
    return driver.find_element(By.ID, "identity").get_attribute("value")


def read_frame(driver: Any) -> Frame | None:
    raw = driver.execute_script(READ_FRAME_JS)
    return Frame(raw) if raw else None


def wait_frame(driver: Any, what: str, newer_than: Frame | None = None) -> Frame:
    def ready(d: Any) -> Frame | None:
        frame = read_frame(d)
        if frame is None or (newer_than is not None and frame.src == newer_than.src):
            return None
        return frame

    return wait(driver, ready, what)


def watch_frames(driver: Any, seconds: float, at_least: int, what: str) -> set[str]:
    """The distinct frame ``src`` s seen for ``seconds`` (and until ``at_least`` were seen)."""
    seen: set[str] = set()
    start = time.monotonic()

    def enough(d: Any) -> bool:
        frame = d.execute_script('const i = document.getElementById("frame"); return i.hidden ? null : i.src;')
        if frame:
            seen.add(frame)
        return time.monotonic() - start >= seconds and len(seen) >= at_least

    wait(driver, enough, f"{what}: saw {len(seen)} distinct frames", timeout=seconds + WAIT)
    return seen


def wait_still(driver: Any, what: str, quiet: float = 0.8) -> Frame:
    """The frame once the picture has stopped changing for ``quiet`` seconds (no key held: no new chunks)."""
    last: dict[str, Any] = {"src": None, "since": time.monotonic()}

    def still(d: Any) -> Frame | None:
        frame = read_frame(d)
        now = time.monotonic()
        if frame is None or frame.src != last["src"]:
            last.update(src=frame and frame.src, since=now)
            return None
        return frame if now - last["since"] >= quiet else None

    return wait(driver, still, what)


def hold_key(driver: Any, key: str) -> None:
    """Press ``key`` on the page body (nothing focused, so no text field takes it) and keep it down."""
    driver.execute_script("if (document.activeElement) document.activeElement.blur();")
    ActionChains(driver).key_down(key).perform()


def release_key(driver: Any, key: str) -> None:
    ActionChains(driver).key_up(key).perform()


def screenshot(driver: Any, path: Path) -> None:
    assert driver.save_screenshot(str(path)), f"could not save {path}"
    assert path.stat().st_size > 0


def save_failure(opened: list[Browser], artifacts: Path) -> None:
    """On a failure: each page's screenshot and its status panel (notice, stats, event log) as text."""
    for browser in opened:
        try:
            browser.driver.save_screenshot(str(artifacts / f"failed-{browser.name}.png"))
            panel = browser.driver.execute_script(
                'return ["notice", "stats", "log"].map((id) => document.getElementById(id)'
                ' || document.querySelector("." + id)).map((e) => e ? e.innerText : "").join("\\n\\n");'
            )
            (artifacts / f"failed-{browser.name}.txt").write_text(panel)
        except (WebDriverException, OSError) as exc:  # the browser itself failed: keep what there is
            (artifacts / f"failed-{browser.name}.txt").write_text(f"could not read the page: {exc!r}")


def page_errors(console: list[dict[str, Any]]) -> list[str]:
    return [entry["message"] for entry in console if entry.get("level") == "SEVERE"]


# -- the test ----------------------------------------------------------------------------------------


async def test_controller_and_viewer_in_headless_chromium(browsers: Browsers, artifacts_dir: Path) -> None:
    app = create_app(settings(), service_loader=toy_loader)
    config = Config()
    config.bind = ["127.0.0.1:0"]
    config.accesslog = None
    stop = trio.Event()
    with trio.fail_after(TEST_DEADLINE):
        async with trio.open_nursery() as nursery:
            urls = await nursery.start(partial(hypercorn_serve, app, config, shutdown_trigger=stop.wait))
            try:
                await wait_ready(app.extensions["chunkline"])
                await drive_the_page(browsers, urls[0], artifacts_dir)
            except BaseException:
                with trio.CancelScope(shield=True), trio.move_on_after(10):
                    await trio.to_thread.run_sync(save_failure, browsers.opened, artifacts_dir)
                raise
            finally:
                stop.set()  # the nursery exits once hypercorn has shut down (lifespan included)


async def drive_the_page(browsers: Browsers, base_url: str, artifacts: Path) -> None:
    run = trio.to_thread.run_sync
    for old in [*artifacts.glob("*.png"), *artifacts.glob("failed-*.txt"), *artifacts.glob("summary.json")]:
        old.unlink()
    summary: dict[str, Any] = {}
    controller = await browsers("controller")
    ctl = controller.driver

    # 1. Start: the session is created and the preview chunk shows up.
    await run(ctl.get, base_url + "/")
    assert await run(text, ctl, "mode-badge") == "Controller"
    await run(lambda: ctl.find_element(By.ID, "btn-start").click())
    first = await run(wait_frame, ctl, "the first frame on the controller page")
    await run(wait, ctl, lambda d: controller_identity(d) in participants(d), "the controller to join its room")
    assert await run(text, ctl, "stat-status") in {"assigned", "joining_room", "running", "streaming"}
    await run(screenshot, ctl, artifacts / "01-controller-started.png")

    # 2. Hold D: frames keep coming, and the content moves left.
    await run(hold_key, ctl, "d")
    try:
        await run(wait, ctl, lambda d: text(d, "held-keys") == "Held keys: D", "the page to show D held")
        seen = await run(watch_frames, ctl, HOLD_SECONDS, 6, "frames while D is held")
        held = await run(wait_frame, ctl, "a frame while D is held", first)
        await run(screenshot, ctl, artifacts / "02-controller-holding-d.png")
    finally:
        await run(release_key, ctl, "d")
    await run(wait, ctl, lambda d: text(d, "held-keys") == "Held keys: none", "the page to show no key held")
    assert len(seen - {first.src}) >= 5, f"only {len(seen - {first.src})} new frames while D was held"
    assert held.frames > first.frames, (first.frames, held.frames)
    shift, error, unshifted = near_ground_shift(first.pixels, held.pixels)
    summary.update(frames_while_held=len(seen), shift_px=shift, error_at_shift=error, error_unshifted=unshifted)
    assert shift >= 5, f"holding D should move the content left; best shift {shift} px (error {error:.1f})"
    assert error < 0.6 * unshifted, (shift, error, unshifted)
    chunks = int(await run(text, ctl, "stat-chunks"))
    assert chunks >= 3, f"{chunks} chunks after holding D"

    # 3. Share as viewer: a second browser opens the link and shows the same stream.
    await run(lambda: ctl.find_element(By.ID, "btn-share").click())
    link = await run(
        wait, ctl, lambda d: d.find_element(By.ID, "share-link").get_attribute("value"), "the viewer link"
    )
    assert link.startswith(base_url + "/?") and "token=" in link, link
    viewer_browser = await browsers("viewer")
    viewer = viewer_browser.driver
    await run(viewer.get, link)
    assert await run(text, viewer, "mode-badge") == "Viewer"
    assert not await run(lambda: viewer.find_element(By.ID, "controls").is_displayed())
    assert not await run(lambda: viewer.find_element(By.ID, "start-form").is_displayed())
    for driver, name in ((viewer, "viewer"), (ctl, "controller")):
        await run(
            wait, driver, lambda d: any(p.startswith("viewer-") for p in participants(d)), f"the {name} to list the viewer"
        )

    # No chunks are made while no key is held, so the viewer sees frames once the controller moves again.
    await run(hold_key, ctl, "d")
    try:
        await run(wait_frame, viewer, "the first frame on the viewer page")
        await run(watch_frames, viewer, 0.5, 3, "frames on the viewer page while D is held")
    finally:
        await run(release_key, ctl, "d")
    on_controller = await run(wait_still, ctl, "the controller's picture to settle")
    on_viewer = await run(wait_still, viewer, "the viewer's picture to settle")
    difference = float(np.abs(on_controller.pixels - on_viewer.pixels).mean())
    summary.update(viewer_frames=on_viewer.frames, controller_viewer_difference=difference)
    assert difference < 2.0, f"the viewer shows another picture (mean grey difference {difference:.1f})"
    assert on_viewer.frames >= 3
    await run(screenshot, viewer, artifacts / "03-viewer.png")

    # 4. Stop: both pages say the stream is done; the session ends closed.
    await run(lambda: ctl.find_element(By.ID, "btn-stop").click())
    for driver, name in ((ctl, "controller"), (viewer, "viewer")):
        await run(wait, driver, lambda d: text(d, "stat-stage") == "done", f"the {name} page to show stage done")
    await run(wait, ctl, lambda d: text(d, "stat-status") in TERMINAL, "the controller page to show the session ended")
    assert await run(text, ctl, "stat-status") == "closed"
    await run(screenshot, ctl, artifacts / "04-controller-stopped.png")
    await run(screenshot, viewer, artifacts / "04-viewer-stopped.png")

    summary.update(frames=int(await run(text, ctl, "stat-frames")), chunks=int(await run(text, ctl, "stat-chunks")))
    (artifacts / "summary.json").write_text(json.dumps(summary, indent=1))
    for browser in (controller, viewer_browser):
        errors = page_errors(await run(browser.read_console))
        assert not errors, f"{browser.name} page errors: {errors}"
