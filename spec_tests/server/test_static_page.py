"""The demo page: served by the app, no path traversal, valid JavaScript, speaking the server's protocol."""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import pytest

import pipelines
from pipelines.contract import KNOWN_KEYS
from server import protocol
from server import runner as server_runner
from server.app import STATIC, create_app
from server.cluster.identity import worker_participant
from server.settings import ServerSettings
from states.stream_session import TERMINAL as STREAM_TERMINAL
from states.stream_session import State as StreamState

REPLAY = str(Path(pipelines.__file__).parent / "replay")
APP_JS = STATIC / "app.js"


@pytest.fixture
async def client() -> AsyncIterator[Any]:
    app = create_app(ServerSettings(pipeline=REPLAY))
    async with app.test_app() as test_app:
        yield test_app.test_client()


# -- served by the app -------------------------------------------------------------------


async def test_index_is_html_referencing_the_assets(client: Any) -> None:
    response = await client.get("/")
    assert response.status_code == 200
    assert response.mimetype == "text/html"
    page = await response.get_data(as_text=True)
    assert "<!doctype html>" in page.lower()
    assert 'src="/static/app.js"' in page
    assert 'href="/static/style.css"' in page
    assert 'type="module"' in page


async def test_page_loads_nothing_from_other_origins() -> None:
    page = (STATIC / "index.html").read_text()
    script = APP_JS.read_text()
    for text in (page, script):
        assert not re.search(r"""(src|href)\s*=\s*["']?(https?:)?//""", text), "no CDN or remote assets"
        assert "unpkg.com" not in text and "jsdelivr" not in text and "cdnjs" not in text


async def test_app_js_is_javascript(client: Any) -> None:
    response = await client.get("/static/app.js")
    assert response.status_code == 200
    assert response.mimetype == "text/javascript"
    assert "WebSocket" in await response.get_data(as_text=True)


async def test_style_css_is_css(client: Any) -> None:
    response = await client.get("/static/style.css")
    assert response.status_code == 200
    assert response.mimetype == "text/css"


@pytest.mark.parametrize(
    "path",
    [
        "/static/../app.py",
        "/static/%2e%2e/app.py",
        "/static/%2E%2E/app.py",
        "/static/..%2fapp.py",
        "/static/vendor/../../app.py",
        "/static/%2e%2e/%2e%2e/pyproject.toml",
        "/static/missing.js",
        "/static/",
    ],
)
async def test_path_traversal_and_missing_files_are_404(client: Any, path: str) -> None:
    response = await client.get(path)
    assert response.status_code == 404
    body = await response.get_data(as_text=True)
    assert "create_app" not in body and "[project]" not in body


async def test_vendored_livekit_bundle_is_served_when_present(client: Any) -> None:
    bundle = STATIC / "vendor" / "livekit-client.umd.js"
    if not bundle.is_file():
        pytest.skip("livekit-client is not vendored (run server/static/build_vendor.sh)")
    assert "/static/vendor/livekit-client.umd.js" in APP_JS.read_text()
    response = await client.get("/static/vendor/livekit-client.umd.js")
    assert response.status_code == 200
    assert response.mimetype == "text/javascript"
    assert "LivekitClient" in (await response.get_data(as_text=True))[:2000]


# -- the script -----------------------------------------------------------------------------


def test_app_js_parses() -> None:
    node = shutil.which("node")
    if node is None:
        pytest.skip("node is not installed")
    result = subprocess.run([node, "--check", str(APP_JS)], capture_output=True, text=True, timeout=60)
    assert result.returncode == 0, result.stderr


def test_the_page_takes_status_and_metrics_only_from_the_server() -> None:
    """Principle 7 on the page: ``tf.status``/``tf.metrics`` from a participant (a LiveKit controller may
    publish on any topic) or from nobody are ignored; the worker's are shown. The page runs in node with
    an inert DOM (``page_harness.js``) and is handed the data messages as a room delivers them."""
    node = shutil.which("node")
    if node is None:
        if os.environ.get("CI") == "true":
            pytest.fail("CI=true: node is needed to run the demo page's script")
        pytest.skip("node is not installed")
    harness = Path(__file__).with_name("page_harness.js")
    result = subprocess.run([node, str(harness), str(APP_JS)], capture_output=True, text=True, timeout=60)
    assert result.returncode == 0, result.stderr
    taken = json.loads(result.stdout)
    assert taken["participant"] == {"status": False, "metrics": False}, taken
    assert taken["nobody"] == {"status": False, "metrics": False}, taken
    assert taken["worker"] == {"status": True, "metrics": True}, taken


def test_app_js_sends_only_control_types_the_server_accepts() -> None:
    script = APP_JS.read_text()
    sent = set(re.findall(r"sendControl\(\{\s*type:\s*\"(\w+)\"", script))
    assert sent >= {"control_state", "reset", "reset_pose", "stop", "prompt"}
    assert sent <= protocol.MESSAGE_TYPES
    for message in ({"type": "control_state", "controls": ["w", "j"]}, {"type": "reset_pose"}, {"type": "stop"}):
        protocol.parse_control(
            message, topic=protocol.CONTROL_TOPIC, sender_identity="c", controller_identity="c", session_id="s"
        )


def test_app_js_key_map_matches_the_protocol() -> None:
    script = APP_JS.read_text()
    block = re.search(r"const KEY_CODES = \{(.*?)\};", script, re.S)
    assert block is not None
    pairs = dict(re.findall(r"(\w+):\s*\"(\w)\"", block.group(1)))
    assert set(pairs.values()) == KNOWN_KEYS
    for code, key in pairs.items():
        assert protocol.normalize_key(code) == key, code
    assert {"ArrowUp", "ArrowDown", "ArrowLeft", "ArrowRight"} <= set(pairs)


def test_app_js_uses_the_server_topics() -> None:
    script = APP_JS.read_text()
    for topic in (protocol.CONTROL_TOPIC, protocol.STATUS_TOPIC, protocol.METRICS_TOPIC):
        assert f'"{topic}"' in script


def test_app_js_handles_every_lease_message_type() -> None:
    """tf.status lease messages carry the event as their ``type`` (protocol.lease_message)."""
    script = APP_JS.read_text()
    assert protocol.LEASE_EVENTS == {"lease_queued", "lease_granted", "lease_parked"}
    for event in protocol.LEASE_EVENTS:
        assert f'case "{event}"' in script, event
        message = json.loads(protocol.lease_message("s", event, 2))
        assert message["type"] == event and message["queue_position"] == 2
    for text in ("Lease granted", "Waiting for the model", "Parked (idle)"):
        assert text in script, text


def test_app_js_knows_the_session_states() -> None:
    script = APP_JS.read_text()
    block = re.search(r"const SESSION_STATES = new Set\(\[(.*?)\]\);", script, re.DOTALL)
    assert block is not None
    assert set(re.findall(r"\"(\w+)\"", block.group(1))) == {state.value for state in StreamState}
    terminal = re.search(r"const TERMINAL = new Set\(\[(.*?)\]\);", script, re.DOTALL)
    assert terminal is not None
    assert set(re.findall(r"\"(\w+)\"", terminal.group(1))) == {state.value for state in STREAM_TERMINAL}


def test_app_js_counts_people_not_the_server_publisher() -> None:
    script = APP_JS.read_text()
    assert 'const SERVER_IDENTITY_PREFIX = "chunkline-";' in script
    runner = (Path(server_runner.__file__)).read_text()
    assert "self.identity = worker_participant(worker.worker_id)" in runner  # in-process workers join as agents do
    assert worker_participant("node-1a2b3c4d").startswith("chunkline-")


def test_app_js_refreshes_the_session_at_once_and_ends_cleanly() -> None:
    script = APP_JS.read_text()
    start = re.search(r"function startRefresh\(\) \{(.*?)\n\}", script, re.DOTALL)
    assert start is not None and "refreshSession();" in start.group(1), "fetch at once, not only on the interval"
    end = re.search(r"function endStream\(kind, text\) \{(.*?)\n\}", script, re.DOTALL)
    assert end is not None
    for step in ("stopHeartbeat()", "setControlsEnabled(false)", "disconnect()"):
        assert step in end.group(1), step
    for case in ('case "done"', 'case "error"'):
        branch = script[script.index(case) :]
        assert "endStream(" in branch[: branch.index("break;")], case
    page = (STATIC / "index.html").read_text()
    assert 'id="end-banner"' in page and 'id="screen"' in page
