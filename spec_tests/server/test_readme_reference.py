"""The README's reference sections name everything the code has: a new user writes a pipeline or a client from them.

A user following README.md from a fresh clone had to read the code for a pipeline's method signatures, the room
messages' fields and the error codes (7 Dec). The README now has "The pipeline contract, in full", "Room messages" and
"Error codes"; these tests collect what they must name from the code itself (the contract's classes by introspection,
the codes and message types by an AST scan of the modules that make them), so a new method, field, message type or
error code that the README does not name fails here, naming it and where it came from.

Each section is read from its heading to the next heading, and each table by the first cell of its header row; an
item counts as named only in the first column of its own table (a code named elsewhere in the README does not count).
"""

from __future__ import annotations

import ast
import inspect
import re
from collections import defaultdict
from collections.abc import Iterator

import attrs
import pytest

import pipelines.contract as contract
import server.protocol as protocol

from .readme_tables import (
    README, ROOT, calls, missing, missing_with_fields, parsed, python_files, quoted, row_of, section, table, texts,
)


# -- the pipeline contract ---------------------------------------------------------------------------------------

CONTRACT = section("The pipeline contract, in full")
SERVICES = (contract.BidirectionalService, contract.ServerPushService)


def rendered(function: object) -> str:
    """A method's signature as the README writes it: ``create_session(config, *, on_event=None)``."""
    parameters = list(inspect.signature(function).parameters.values())[1:]  # self
    parts, starred = [], False
    for parameter in parameters:
        if parameter.kind is inspect.Parameter.KEYWORD_ONLY and not starred:
            parts.append("*")
            starred = True
        parts.append(parameter.name if parameter.default is inspect.Parameter.empty
                     else f"{parameter.name}={parameter.default!r}")
    return f"{function.__name__}({', '.join(parts)})"


def form_of(method: object) -> str:
    """How the contract declares ``method``, as the README's form column begins: an ``async def``, an async generator
    or an async context manager (a ``def`` the contract types as returning one), or a plain ``def``."""
    if inspect.iscoroutinefunction(method):
        return "`async def`"
    returned = str(inspect.signature(method).return_annotation)
    if returned.startswith("AsyncIterator"):
        return "async generator"
    if returned.startswith("AbstractAsyncContextManager"):
        return "async context manager"
    return "`def`"


def service_members() -> Iterator[tuple[type, str, object]]:
    for service in SERVICES:
        for name, member in vars(service).items():
            if not name.startswith("_"):
                yield service, name, member


def test_every_member_of_the_service_contract_has_a_row_with_its_signature_and_form():
    rows = table(CONTRACT, "member")
    problems = []
    for service, name, member in service_members():
        row = row_of(rows, name)
        where = f"{service.__name__}.{name}"
        if row is None:
            problems.append(f"{where}: no row")
            continue
        form = row[1]
        if inspect.isfunction(member):
            if rendered(member) not in row[0]:
                problems.append(f"{where}: the row does not give its signature {rendered(member)!r}: {row[0]!r}")
            if not form.startswith(expected := form_of(member)):
                problems.append(f"{where} is {expected!r}, and its form says {form!r}")
        elif isinstance(member, property):
            if "property" not in form:
                problems.append(f"{where} is a property; its form says {form!r}")
        elif "class attribute" not in form:
            problems.append(f"{where} is a class attribute; its form says {form!r}")
    assert not problems, "README.md, The pipeline contract, in full:\n" + "\n".join(problems)


def test_every_field_of_the_contracts_values_is_named_in_its_row():
    rows = table(CONTRACT, "value")
    values = [value for value in vars(contract).values()
              if inspect.isclass(value) and attrs.has(value) and value.__module__ == contract.__name__]
    assert {contract.Chunk, contract.Control} <= set(values)
    problems = []
    for value in values:
        row = row_of(rows, value.__name__)
        if row is None:
            problems.append(f"{value.__name__}: no row")
            continue
        named = quoted(" ".join(row[1:]))
        problems += [f"{value.__name__}.{field.name}: not named in its row" for field in attrs.fields(value)
                     if field.name not in named]
    control = row_of(rows, "Control") or []
    problems += [f"ControlType {kind.value!r}: not named in Control's row" for kind in contract.ControlType
                 if kind.value not in quoted(" ".join(control))]
    assert not problems, "README.md, The pipeline contract, in full:\n" + "\n".join(problems)


def test_the_contracts_exceptions_are_named():
    exceptions = [name for name in contract.__all__
                  if inspect.isclass(getattr(contract, name)) and issubclass(getattr(contract, name), Exception)]
    assert exceptions
    unnamed = [name for name in exceptions if f"`{name}" not in CONTRACT]
    assert not unnamed, f"README.md, The pipeline contract, in full, names no {unnamed}"


# -- room messages -----------------------------------------------------------------------------------------------

ROOM = section("Room messages")
PROTOCOL = ROOT / "server" / "protocol.py"
#: the modules that write a local room's JSON frames
ROOM_FRAME_FILES = [*python_files("server/transport"), ROOT / "server" / "room_socket.py",
                    ROOT / "server" / "tokens.py"]


def test_every_type_a_client_may_send_is_in_room_messages_with_its_fields():
    rows = table(ROOM, "client `type` (topic `tf.control`)")
    problems = missing({kind: "server.protocol.MESSAGE_TYPES" for kind in protocol.MESSAGE_TYPES}, rows)
    for kind, fields in protocol._OWN_FIELDS.items():
        row = row_of(rows, kind) or ["", ""]
        problems += [f"{kind}.{field}: not named in its row" for field in fields if field not in quoted(row[1])]
    control = row_of(rows, protocol.ControlType.CONTROL.value) or ["", ""]
    problems += [f"control event {event!r}: not named in control's row" for event in protocol._EVENTS
                 if event not in quoted(control[1])]
    problems += [f"envelope field {field!r}: not named" for field in protocol._ENVELOPE_FIELDS
                 if f'"{field}"' not in ROOM and f"`{field}`" not in ROOM]
    problems += [f"key name {alias!r}: not named" for alias in protocol.KEY_ALIASES if f"`{alias}`" not in ROOM]
    assert not problems, "README.md, Room messages:\n" + "\n".join(problems)


def frame_types() -> dict[str, tuple[set[str], str]]:
    """The ``type`` of every JSON frame a local room writes (a dict literal with a constant ``type``), with its keys."""
    found: dict[str, tuple[set[str], str]] = {}
    for path in ROOM_FRAME_FILES:
        for node in ast.walk(parsed(path)):
            if not isinstance(node, ast.Dict):
                continue
            keys = [key.value if isinstance(key, ast.Constant) else None for key in node.keys]
            if "type" in keys and (kinds := texts(node.values[keys.index("type")])):
                for kind in kinds:
                    fields, where = found.get(kind, (set(), f"{path.relative_to(ROOT)}:{node.lineno}"))
                    found[kind] = (fields | {key for key in keys if key not in (None, "type")}, where)
    return found


def test_every_frame_a_local_room_sends_is_in_room_messages_with_its_fields():
    rows = table(ROOM, "frame `type`")
    frames = frame_types()
    problems = missing_with_fields(frames, rows)
    assert not problems, "README.md, Room messages:\n" + "\n".join(problems)
    assert len(frames) >= 5, f"the scan found only {sorted(frames)}: teach it how the rooms write frames now"


def status_payloads() -> dict[str, tuple[set[str], str]]:
    """Each payload type the protocol module builds (``_message(type, ...)``) with the fields of its body."""
    tree = parsed(PROTOCOL)
    found: dict[str, tuple[set[str], str]] = {}
    for function in (node for node in tree.body if isinstance(node, ast.FunctionDef)):
        for node in ast.walk(function):
            if not (isinstance(node, ast.Call) and isinstance(node.func, ast.Name) and node.func.id == "_message"):
                continue
            kinds = texts(node.args[0])
            if not kinds:  # the lease events: the type is the event, one of LEASE_EVENTS
                assert function.name == "lease_message", (
                    f"server/protocol.py:{node.lineno}: a message type this test cannot read; teach it this one")
                kinds = sorted(protocol.LEASE_EVENTS)
            body = node.args[3]
            fields = set()
            if isinstance(body, ast.Dict):
                fields = {key.value for key in body.keys if isinstance(key, ast.Constant)}
            elif isinstance(body, ast.Name):  # a dict built in the function: its literal and the keys set after
                for inner in ast.walk(function):
                    if isinstance(inner, ast.AnnAssign | ast.Assign) and isinstance(inner.value, ast.Dict):
                        targets = inner.targets if isinstance(inner, ast.Assign) else [inner.target]
                        if any(isinstance(target, ast.Name) and target.id == body.id for target in targets):
                            fields |= {key.value for key in inner.value.keys if isinstance(key, ast.Constant)}
                    if (isinstance(inner, ast.Subscript) and isinstance(inner.value, ast.Name)
                            and inner.value.id == body.id and isinstance(inner.slice, ast.Constant)):
                        fields.add(inner.slice.value)
            for kind in kinds:
                found[kind] = (fields, f"server/protocol.py:{node.lineno}")
    return found


def test_every_payload_the_server_sends_is_in_room_messages_with_its_fields():
    rows = table(ROOM, "status `type`")
    payloads = status_payloads()
    problems = missing_with_fields(payloads, rows)
    envelope = next(node for node in ast.walk(parsed(PROTOCOL))
                    if isinstance(node, ast.FunctionDef) and node.name == "_message")
    common = {key.value for node in ast.walk(envelope) if isinstance(node, ast.Dict)
              for key in node.keys if isinstance(key, ast.Constant)}
    problems += [f"the field {field!r} every payload has: not named" for field in common if f"`{field}`" not in ROOM]
    assert not problems, "README.md, Room messages:\n" + "\n".join(problems)
    assert len(payloads) >= 7, f"the scan found only {sorted(payloads)}: teach it how the protocol builds them now"


def test_the_data_of_status_chunk_and_metrics_payloads_is_named_in_their_rows():
    rows = table(ROOM, "status `type`")
    publisher = ROOT / "server" / "chunk_publisher.py"
    wanted: dict[str, set[str]] = defaultdict(set)
    for node in ast.walk(parsed(publisher)):  # the chunk's data: the dict literal that holds "frames"
        if isinstance(node, ast.Dict):
            keys = {key.value for key in node.keys if isinstance(key, ast.Constant) and isinstance(key.value, str)}
            if "frames" in keys and "fps" in keys:
                wanted["chunk"] |= keys
    for call, _ in calls([publisher], "metrics_message"):
        wanted["metrics"] |= {given.arg for given in call.keywords if given.arg}
    for call, _ in calls([ROOT / "server" / "runner.py"], "_send_status", "status_message"):
        stage = call.args[0] if call.func.attr == "_send_status" else call.args[1]  # type: ignore[union-attr]
        wanted["status"] |= set(texts(stage)) | {given.arg for given in call.keywords if given.arg}
    assert wanted["chunk"] and wanted["metrics"] and wanted["status"], wanted
    problems = []
    for kind, names in wanted.items():
        row = row_of(rows, kind) or ["", ""]
        problems += [f"{kind}: {name!r} not named in its row" for name in sorted(names) if name not in quoted(row[1])]
    assert not problems, "README.md, Room messages:\n" + "\n".join(problems)


@pytest.mark.parametrize("title", ["The pipeline contract, in full", "Room messages", "Error codes"])
def test_each_reference_section_sits_where_the_readme_says(title):
    """Each section is linked to where the README points at it, by GitHub's anchor for its heading."""
    anchor = "#" + re.sub(r"[^a-z0-9 _-]", "", title.lower()).replace(" ", "-")
    assert f"]({anchor})" in README, f"README.md links to {title!r} nowhere ({anchor})"


# -- metrics ---------------------------------------------------------------------------------------------------------


def test_every_cause_a_worker_loss_is_counted_by_is_named_with_its_metric():
    """``chunkline_worker_losses_total``'s causes, as the README and the metric's help give them (both left out
    ``authority_stalled``, which a stalled authority counts)."""
    from server.metrics import LOSS_CAUSES, ServerMetrics

    where = README.index("`chunkline_worker_losses_total{cause=...}` (causes")
    listed = set(re.findall(r"`([a-z_]+)`", README[where:README.index(").", where)]))
    assert set(LOSS_CAUSES) <= listed, sorted(set(LOSS_CAUSES) - listed)
    (family,) = [family for family in ServerMetrics().registry.collect() if family.name == "chunkline_worker_losses"]
    assert all(cause in family.documentation for cause in LOSS_CAUSES), family.documentation


def test_every_field_a_handler_and_a_session_hook_are_given_is_named():
    """A new user writing a handler had the README's ``invocation.inputs`` and ``is_first`` alone, and guessed
    ``invocation.sequence_id`` (an ``AttributeError``): the fields of what handlers and hooks get are named."""
    import engine

    where = README.index("A handler's `invocation` (`engine.StageInvocation`")
    paragraph = README[where:README.index("\n\n", where)]
    named = set(re.findall(r"`([a-z_]+)`", paragraph))
    fields = {*engine.StageInvocation._fields, *engine.TaskKey._fields, *attrs.fields_dict(engine.SessionContext)}
    assert fields <= named, sorted(fields - named)
