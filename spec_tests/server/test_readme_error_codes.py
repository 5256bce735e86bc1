"""The README's "Error codes" names every code the server answers with: the HTTP API's, a room's refusals, a
``control_rejected``'s reasons, a session's last word and the close codes, each collected from the code that makes it
(an AST scan of the modules), so a new one that the README does not name fails here, naming it and where it came
from (see ``test_readme_reference.py`` for the rest of the reference)."""

from __future__ import annotations

import ast
import inspect
import re
from pathlib import Path

import server.front as front
import server.protocol as protocol
import server.tokens as tokens
import server.transport.refusals as refusals
from states.stream_session import DrainCause

from .readme_tables import (
    PIPELINES, ROOT, SERVER, argument, calls, missing, number, numbers, parsed, row_of, section, table, texts,
)


# -- error codes -------------------------------------------------------------------------------------------------

ERRORS = section("Error codes")
#: constructors whose first argument is an HTTP ``error`` code, and the status it answers with unless told
CODE_FIRST = {"BadRequest": 400, "Busy": 503, "JsonRefused": 400, "ImageRefused": 400}


def http_codes() -> dict[str, tuple[set[int], str]]:
    """Every ``error`` an HTTP error body can carry, with the statuses it comes with, collected from the code."""
    found: dict[str, tuple[set[int], str]] = {}

    def add(code: str, status: int | None, where: str) -> None:
        statuses, first = found.get(code, (set(), where))
        found[code] = (statuses | ({status} if status is not None else set()), first)

    app = ROOT / "server" / "app.py"
    for call, where in calls([app], "error"):  # error(status, code, detail)
        for code in texts(argument(call, 1)):
            add(code, number(argument(call, 0)), where)
    for call, where in calls(SERVER + PIPELINES, *CODE_FIRST):
        name = call.func.id if isinstance(call.func, ast.Name) else call.func.attr  # type: ignore[union-attr]
        status = number(argument(call, 2, "status")) if name == "BadRequest" else None
        for code in texts(argument(call, 0)):
            add(code, status or CODE_FIRST[name], where)
    for path in SERVER:  # a BadRequest of its own: super().__init__(code, ...)
        for node in ast.walk(parsed(path)):
            if isinstance(node, ast.ClassDef) and any(isinstance(base, ast.Name) and base.id in CODE_FIRST
                                                      for base in node.bases):
                for call in (inner for inner in ast.walk(node) if isinstance(inner, ast.Call)):
                    if isinstance(call.func, ast.Attribute) and call.func.attr == "__init__":
                        for code in texts(argument(call, 0)):
                            add(code, 400, f"{path.relative_to(ROOT)}:{call.lineno}")
    import server.app as app_module

    for code in app_module.REFUSALS:  # the 429s of a create the admission book refuses
        add(code, 429, "server/app.py REFUSALS")
    admission = ROOT / "states" / "admission.py"
    for node in ast.walk(parsed(admission)):
        if isinstance(node, ast.Assign) and any(isinstance(t, ast.Name) and t.id == "reason" for t in node.targets):
            for code in texts(node.value):
                add(code, 429, f"states/admission.py:{node.lineno}")
    for call, where in calls(SERVER, "Admission"):
        for code in texts(argument(call, 99, "reason")):
            add(code, 429, where)
    # werkzeug's own exceptions, as the app names them (its http_error: the name in snake case): those it imports,
    # and those quart-trio's request raises (a body too large, or too slow)
    import quart_trio.wrappers.request as quart_request
    import werkzeug.exceptions

    for path in (app, Path(quart_request.__file__)):
        for node in ast.walk(parsed(path)):
            if isinstance(node, ast.ImportFrom) and node.module == "werkzeug.exceptions":
                for alias in node.names:
                    exception = getattr(werkzeug.exceptions, alias.name)
                    if inspect.isclass(exception) and exception.code is not None:
                        add(exception().name.lower().replace(" ", "_"), exception.code, f"werkzeug {alias.name}")
    # the front's answers: FramingRefused(status, detail, error=code), or a code named after the status
    for call, where in calls([ROOT / "server" / "front.py", ROOT / "server" / "http_framing.py"], "FramingRefused"):
        status = number(argument(call, 0))
        codes = texts(argument(call, 99, "error"))
        if not codes and status is not None:
            codes = [front._REFUSALS[status].decode().split(" ", 1)[1].lower().replace(" ", "_")]
        for code in codes:
            add(code, status, where)
    for call, where in calls([ROOT / "server" / "room_socket.py"], "_reject"):  # a room socket's handshake
        for code in texts(argument(call, 1)):
            add(code, number(argument(call, 0)), where)
    return found


def test_every_http_error_code_is_in_error_codes_with_its_status():
    rows = table(ERRORS, "HTTP `error`")
    codes = http_codes()
    problems = missing({code: where for code, (_, where) in codes.items()}, rows)
    for code, (statuses, where) in sorted(codes.items()):
        row = row_of(rows, code)
        if row is not None:
            problems += [f"{code} ({where}): its row does not say status {status}" for status in sorted(statuses)
                         if not re.search(rf"\b{status}\b", row[1])]
    assert not problems, "README.md, Error codes, the HTTP table:\n" + "\n".join(problems)
    assert len(codes) >= 40, f"the scan found only {sorted(codes)}: teach it where the codes are made now"


def room_refusals() -> dict[str, str]:
    """Every ``reason`` of a local room's ``refused`` frame, with where it comes from."""
    found: dict[str, str] = {}
    for reason in tokens._REJECTED:
        found.setdefault(reason, "server/tokens.py _REJECTED")
    for reason in refusals._DETAILS:
        found.setdefault(reason, "server/transport/refusals.py _DETAILS")
    for call, where in calls(SERVER, "TokenRejected"):
        for reason in texts(argument(call, 0)):
            found.setdefault(reason, where)
    for call, where in calls(SERVER, "refuse", "send_away", "refused"):  # a subscriber told, or sent away
        for reason in (text for given in call.args for text in texts(given)):
            found.setdefault(reason, where)
    room_socket = ROOT / "server" / "room_socket.py"
    for node in ast.walk(parsed(room_socket)):  # a close reason that is a code (the rest are sentences)
        if isinstance(node, ast.Assign):
            for target, value in zip(node.targets[0].elts if isinstance(node.targets[0], ast.Tuple) else node.targets,
                                     node.value.elts if isinstance(node.value, ast.Tuple) else [node.value]):
                if isinstance(target, ast.Attribute) and target.attr == "close_reason":
                    for reason in texts(value):
                        found.setdefault(reason, f"server/room_socket.py:{node.lineno}")
    # the JSON parser's refusals, as the room's reader passes them on: those it renames (invalid_json) aside
    reading = ROOT / "server" / "transport" / "local_reading.py"
    renamed = {text for node in ast.walk(parsed(reading)) if isinstance(node, ast.Compare)
               and isinstance(node.left, ast.Attribute) and node.left.attr == "reason"
               for text in texts(node.comparators[0])}
    assert renamed == {"invalid_json"}, f"{reading.name} renames {renamed}: check the README's room refusals"
    for call, where in calls([ROOT / "server" / "json_limits.py"], "JsonRefused"):
        for reason in texts(argument(call, 0)):
            if reason not in renamed:
                found.setdefault(reason, where)
    return found


def test_every_reason_a_local_room_refuses_with_is_in_error_codes():
    rows = table(ERRORS, "room `refused`")
    reasons = room_refusals()
    problems = missing(reasons, rows)
    assert not problems, "README.md, Error codes, the room refusals:\n" + "\n".join(problems)
    assert len(reasons) >= 20, f"the scan found only {sorted(reasons)}: teach it where the rooms refuse now"


def test_every_control_rejected_reason_is_in_error_codes():
    rows = table(ERRORS, "`control_rejected` `reason`")
    reasons = {reason: "server.protocol.REJECTION_REASONS" for reason in protocol.REJECTION_REASONS}
    for call, where in calls([ROOT / "server" / "control_intake.py"], "_reject"):  # _reject(sender, reason, detail)
        for reason in texts(argument(call, 1)):
            reasons.setdefault(reason, where)
    problems = missing(reasons, rows)
    assert not problems, "README.md, Error codes, the control refusals:\n" + "\n".join(problems)
    assert len(reasons) > len(protocol.REJECTION_REASONS), "the scan found none of the room runner's own reasons"


def test_a_sessions_last_word_names_its_reasons():
    """``error``'s reason besides a drain cause is in Error codes; every drain cause is in the server's section."""
    extra = {}
    for call, where in calls([ROOT / "server" / "lifecycle.py"], "error_message"):
        for reason in texts(argument(call, 1)):
            extra[reason] = where
    assert "session_failed" in extra, extra
    problems = [f"{reason} ({where})" for reason, where in extra.items() if f"`{reason}`" not in ERRORS]
    server = section("The stream server (`server/`)")
    problems += [f"drain cause {cause.value}" for cause in DrainCause if f"`{cause.value}`" not in server]
    assert not problems, "README.md names no:\n" + "\n".join(problems)


def test_every_close_code_a_room_socket_sends_is_in_error_codes():
    rows = table(ERRORS, "room close code")
    documented = {int(code) for row in rows for code in re.findall(r"\b\d{4}\b", row[0])}
    sources = [ROOT / "server" / "room_socket.py", ROOT / "server" / "app.py"]
    codes: dict[int, str] = {}
    for call, where in calls(sources, "_close", "close"):
        for code in numbers(argument(call, 0)):
            if code >= 1000:
                codes.setdefault(code, where)
    for path in sources:
        for node in ast.walk(parsed(path)):
            if isinstance(node, ast.Assign | ast.AnnAssign):
                pairs = []
                targets = node.targets if isinstance(node, ast.Assign) else [node.target]
                for target in targets:
                    if isinstance(target, ast.Tuple) and isinstance(node.value, ast.Tuple):
                        pairs += zip(target.elts, node.value.elts)
                    else:
                        pairs.append((target, node.value))
                for target, value in pairs:
                    if isinstance(target, ast.Attribute) and target.attr == "close_code":
                        for code in numbers(value):
                            codes.setdefault(code, f"{path.relative_to(ROOT)}:{node.lineno}")
    problems = [f"{code} ({where})" for code, where in sorted(codes.items()) if code not in documented]
    assert not problems, "README.md, Error codes, the close codes:\n" + "\n".join(problems)
    assert len(codes) >= 5, f"the scan found only {sorted(codes)}: teach it where the sockets close now"
