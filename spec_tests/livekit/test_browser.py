"""The demo page in LiveKit mode, in Debian's Chromium, inside the namespace with the LiveKit server.

chromedriver (and the Chromium it starts) runs inside the namespace, where the page, the stream server
and LiveKit share one address; the test drives it from outside through chromedriver's port on that
address (``--allowed-ips``: only the test's end of the veth pair). Chromium gathers WebRTC candidates on
the namespace's veth address (mDNS obfuscation off, so the server can pair with it).

1. controller: Start; the video element plays the worker's track; hold ``d``: the picture moves left
   (the same shift measure as the local browser test) and the decoder's frame count (``getStats()``
   ``framesDecoded``, shown as the page's frame counter) grows;
2. Share as viewer, opened in a second Chromium: its decoder counts frames of the same stream;
3. Stop: the session ends closed.
"""

from __future__ import annotations

import os
import subprocess
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import trio

from server.livekit_local import stop_process, wait_http_ok
from spec_tests.frames import near_ground_shift

from .conftest import IN_CI, LiveKit, StreamServer
from .test_stream import TERMINAL, wait_status

pytestmark = pytest.mark.livekit

CHROMIUM = Path(os.environ.get("CHUNKLINE_CHROMIUM", "/usr/bin/chromium"))
CHROMEDRIVER = Path(os.environ.get("CHUNKLINE_CHROMEDRIVER", "/usr/bin/chromedriver"))
DRIVER_PORT = 9515
WAIT = 20.0
FLAGS = (
    "--headless=new", "--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run",
    "--no-default-browser-check", "--disable-background-networking", "--disable-component-update",
    "--disable-sync", "--disable-extensions", "--disable-default-apps", "--disable-domain-reliability",
    "--disable-client-side-phishing-detection", "--disable-breakpad", "--metrics-recording-only",
    "--password-store=basic", "--use-mock-keychain", "--autoplay-policy=no-user-gesture-required",
    "--disable-features=AutofillServerCommunication,OptimizationHints,MediaRouter,Translate,WebRtcHideLocalIpsWithMdns",
    "--disable-background-timer-throttling", "--disable-renderer-backgrounding", "--disable-dev-shm-usage",
    "--window-size=1280,1400",
)

# The <video>'s current picture, in grey levels, and the page's frame counter.
READ_VIDEO_JS = """
const video = document.getElementById("lk-video");
if (video.hidden || !video.videoWidth) return null;
const canvas = document.createElement("canvas");
canvas.width = video.videoWidth;
canvas.height = video.videoHeight;
const context = canvas.getContext("2d", { willReadFrequently: true });
context.drawImage(video, 0, 0);
const rgba = context.getImageData(0, 0, canvas.width, canvas.height).data;
const grey = new Array(canvas.width * canvas.height);
for (let i = 0; i < grey.length; i += 1) grey[i] = Math.round((rgba[4 * i] + rgba[4 * i + 1] + rgba[4 * i + 2]) / 3);
return {width: canvas.width, height: canvas.height, grey, frames: Number(document.getElementById("stat-frames").textContent)};
"""


def _executable(path: Path) -> bool:
    return path.is_file() and os.access(path, os.X_OK)


@pytest.fixture(scope="module")
def chromedriver(livekit_server: LiveKit) -> Iterator[str]:
    """chromedriver inside the namespace; its URL (reachable from the test's end of the veth pair only)."""
    try:
        import selenium  # noqa: F401
    except ImportError:
        reason = "selenium not installed: pip install -e '.[test]'"
        pytest.fail(reason) if IN_CI else pytest.skip(reason)
    missing = [str(path) for path in (CHROMIUM, CHROMEDRIVER) if not _executable(path)]
    if missing:
        reason = f"chromium/chromedriver not installed: run .ci/install-browser (missing {', '.join(missing)})"
        pytest.fail(f"CI=true: the LiveKit tests must run, never skip: {reason}") if IN_CI else pytest.skip(reason)
    network = livekit_server.network
    log = livekit_server.workdir / "chromedriver.log"
    process = subprocess.Popen(
        [*network.prefix(), str(CHROMEDRIVER), f"--port={DRIVER_PORT}", f"--allowed-ips={network.outer_ip}", f"--log-path={log}"],
        stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
    )
    url = f"http://{network.inner_ip}:{DRIVER_PORT}"
    try:
        wait_http_ok(url + "/status", 20, process)
        yield url
    finally:
        stop_process(process)


def new_browser(driver_url: str, profile: Path, host: str) -> Any:
    from selenium import webdriver

    options = webdriver.ChromeOptions()
    options.binary_location = str(CHROMIUM)
    for flag in FLAGS:
        options.add_argument(flag)
    # nothing resolves but the namespace's own address (the page and LiveKit): no background lookups
    options.add_argument(f"--host-resolver-rules=MAP * ~NOTFOUND, EXCLUDE {host}")
    options.add_argument(f"--user-data-dir={profile}")
    options.set_capability("goog:loggingPrefs", {"browser": "ALL"})
    driver = webdriver.Remote(command_executor=driver_url, options=options)
    driver.set_page_load_timeout(20)
    driver.set_script_timeout(10)
    return driver


def wait(driver: Any, predicate: Callable[[Any], Any], what: str, timeout: float = WAIT) -> Any:
    from selenium.webdriver.support.ui import WebDriverWait

    return WebDriverWait(driver, timeout, poll_frequency=0.1).until(predicate, message=what)


def text(driver: Any, element_id: str) -> str:
    from selenium.webdriver.common.by import By

    return driver.find_element(By.ID, element_id).text


def click(driver: Any, element_id: str) -> None:
    from selenium.webdriver.common.by import By

    driver.find_element(By.ID, element_id).click()


def picture(driver: Any) -> tuple[int, np.ndarray] | None:
    raw = driver.execute_script(READ_VIDEO_JS)
    if not raw:
        return None
    return raw["frames"], np.asarray(raw["grey"], dtype=np.float64).reshape(raw["height"], raw["width"])


def settled(driver: Any, what: str) -> tuple[int, np.ndarray]:
    """The picture once it has stopped changing (the worker repeats its last frame while idle)."""
    last: dict[str, Any] = {"grey": None, "since": time.monotonic()}

    def still(d: Any) -> tuple[int, np.ndarray] | None:
        seen = picture(d)
        now = time.monotonic()
        if seen is None:
            return None
        if last["grey"] is None or float(np.abs(seen[1] - last["grey"]).mean()) >= 1.0:
            last.update(grey=seen[1], since=now)
            return None
        return seen if now - last["since"] >= 0.8 else None

    return wait(driver, still, what)


def hold(driver: Any, key: str, down: bool) -> None:
    from selenium.webdriver.common.action_chains import ActionChains

    if down:
        driver.execute_script("if (document.activeElement) document.activeElement.blur();")
        ActionChains(driver).key_down(key).perform()
    else:
        ActionChains(driver).key_up(key).perform()


def console(driver: Any) -> list[dict[str, Any]]:
    """The page's console entries so far (the Remote driver has no ``get_log``; chromedriver serves it)."""
    from selenium.webdriver.remote.command import Command

    return driver.execute(Command.GET_LOG, {"type": "browser"})["value"]


def drive(driver_url: str, base_url: str, profiles: Path, artifacts: Path) -> dict[str, Any]:
    """Blocking: the whole page scenario; returns what it measured (asserted by the test)."""
    from selenium.webdriver.common.by import By

    seen: dict[str, Any] = {}
    host = base_url.split("//", 1)[1].rsplit(":", 1)[0]
    controller = new_browser(driver_url, profiles / "controller", host)
    viewer = None
    try:
        controller.get(base_url + "/")
        seen["mode"] = text(controller, "mode-badge")
        click(controller, "btn-start")
        first_frames, before = settled(controller, "the controller's first picture")
        controller.save_screenshot(str(artifacts / "browser-01-controller.png"))
        chunks_before = int(text(controller, "stat-chunks"))
        hold(controller, "d", True)
        try:
            wait(controller, lambda d: int(text(d, "stat-chunks")) >= chunks_before + 4, "four chunks while D is held")
        finally:
            hold(controller, "d", False)
        held_frames, after = settled(controller, "the controller's picture after D")
        controller.save_screenshot(str(artifacts / "browser-02-controller-after-d.png"))
        seen.update(first_frames=first_frames, held_frames=held_frames, shift=near_ground_shift(before, after))

        click(controller, "btn-share")
        link = wait(controller, lambda d: d.find_element(By.ID, "share-link").get_attribute("value"), "the viewer link")
        viewer = new_browser(driver_url, profiles / "viewer", host)
        viewer.get(link)
        seen["viewer_mode"] = text(viewer, "mode-badge")
        hold(controller, "d", True)
        try:
            viewer_frames = wait(viewer, lambda d: (p := picture(d)) and p[0] >= 8 and p[0], "frames decoded on the viewer page")
        finally:
            hold(controller, "d", False)
        on_controller = settled(controller, "the controller's picture to settle")[1]
        on_viewer = settled(viewer, "the viewer's picture to settle")[1]
        viewer.save_screenshot(str(artifacts / "browser-03-viewer.png"))
        seen.update(viewer_frames=viewer_frames, difference=float(np.abs(on_controller - on_viewer).mean()))

        click(controller, "btn-stop")
        wait(controller, lambda d: text(d, "stat-stage") == "done", "the controller page to show done")
        seen["severe"] = [e["message"] for b in (controller, viewer) for e in console(b) if e.get("level") == "SEVERE"]
        return seen
    except BaseException:
        for name, browser in (("controller", controller), ("viewer", viewer)):
            if browser is not None:
                browser.save_screenshot(str(artifacts / f"browser-failed-{name}.png"))
                (artifacts / f"browser-failed-{name}.txt").write_text(
                    browser.execute_script('return ["notice", "stats", "log"].map((id) => document.getElementById(id)'
                                           ' || document.querySelector("." + id)).map((e) => e ? e.innerText : "").join("\\n\\n");'))
        raise
    finally:
        for browser in (controller, viewer):
            if browser is not None:
                browser.quit()


async def test_the_demo_page_in_livekit_mode(
    chromedriver: str, stream_servers: Callable[..., StreamServer], livekit_server: LiveKit, tmp_path: Path
) -> None:
    stream = stream_servers(controller_timeout=30, max_sessions_per_worker=2)
    with trio.fail_after(150):
        seen = await trio.to_thread.run_sync(drive, chromedriver, stream.url, tmp_path, livekit_server.workdir)
    assert seen["mode"] == "Controller" and seen["viewer_mode"] == "Viewer", seen
    shift, error, unshifted = seen["shift"]
    assert shift >= 5, f"holding D should move the view left; best shift {shift} px (error {error:.1f})"
    assert error < 0.6 * unshifted, seen["shift"]
    assert seen["held_frames"] >= seen["first_frames"] + 12, seen
    assert seen["viewer_frames"] >= 8
    assert seen["difference"] < 3.0, f"the viewer shows another picture (mean grey difference {seen['difference']:.1f})"
    assert not seen["severe"], seen["severe"]
    async with stream.http() as http:
        sessions = (await http.get("/v1/stream/sessions")).json()["sessions"]
    assert len(sessions) == 1
    assert (await wait_status(stream, sessions[0]["session_id"], TERMINAL))["status"] == "closed"
