"""Every place that names a lifecycle state outside ``states/`` agrees with the enums (and only one owner moves records).

The OpenAPI document generates its enums from the tables; the metrics labels and
the demo page's constants are written by hand, so they are checked here.
"""

from __future__ import annotations

import ast
import re
from pathlib import Path

from server import metrics, openapi
from states import stream_session
from states.stream_session import DrainCause, State

ROOT = Path(__file__).resolve().parents[2]
APP_JS = (ROOT / "server" / "static" / "app.js").read_text()


def js_set(name: str) -> set[str]:
    match = re.search(rf"const {name} = new Set\(\[(.*?)\]\)", APP_JS, re.S)
    assert match, f"app.js defines no {name}"
    return set(re.findall(r'"([a-z_]+)"', match.group(1)))


def test_the_openapi_enums_are_the_tables_enums():
    schemas = openapi.openapi_document()["components"]["schemas"]
    assert schemas["SessionStatus"]["properties"]["status"]["enum"] == [state.value for state in State]
    assert schemas["SessionStatus"]["properties"]["drain_cause"]["enum"] == [cause.value for cause in DrainCause] + [None]


def test_the_metrics_labels_are_state_values():
    terminal = {state.value for state in stream_session.TERMINAL}
    assert set(metrics.FINISH_RESULTS) == terminal - {State.REJECTED.value}  # a rejected session never started


def test_the_demo_page_constants_are_the_stream_session_states():
    assert js_set("SESSION_STATES") == {state.value for state in State}
    assert js_set("TERMINAL") == {state.value for state in stream_session.TERMINAL}
    assert js_set("WAITING") == {State.PENDING.value, State.QUEUED.value}


def test_only_the_session_lifecycle_moves_stream_session_records():
    movers = []
    for path in sorted((ROOT / "server").rglob("*.py")):
        tree = ast.parse(path.read_text(), filename=str(path))
        for node in ast.walk(tree):
            if isinstance(node, ast.Attribute) and node.attr == "apply" and isinstance(node.value, ast.Attribute) \
                    and node.value.attr == "registry":
                movers.append(path.relative_to(ROOT).as_posix())
    assert set(movers) == {"server/lifecycle.py"}, movers
