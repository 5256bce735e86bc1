"""The committed ``docs/state-diagrams.md`` is exactly what the tables render to."""

from __future__ import annotations

from pathlib import Path

from states import diagrams, worker

REGENERATE = "run `python -m states.diagrams` to regenerate docs/state-diagrams.md"


def test_committed_document_matches_the_tables() -> None:
    path = diagrams.DOCUMENT
    assert path.exists(), f"{path} is missing; {REGENERATE}"
    assert path.read_text(encoding="utf-8") == diagrams.render_document(), (
        f"{path} is stale; {REGENERATE}"
    )


def test_check_passes_on_a_fresh_rendering(tmp_path: Path, capsys) -> None:
    out = tmp_path / "state-diagrams.md"
    assert diagrams.main(["--output", str(out)]) == 0
    assert out.read_text(encoding="utf-8") == diagrams.render_document()
    assert diagrams.main(["--check", "--output", str(out)]) == 0
    capsys.readouterr()


def test_check_fails_on_a_stale_or_missing_document(tmp_path: Path, capsys) -> None:
    out = tmp_path / "state-diagrams.md"
    assert diagrams.main(["--check", "--output", str(out)]) == 1
    out.write_text(diagrams.render_document() + "edited\n", encoding="utf-8")
    assert diagrams.main(["--check", "--output", str(out)]) == 1
    err = capsys.readouterr().err
    assert str(out) in err
    assert "python -m states.diagrams" in err


def test_a_modified_table_renders_differently() -> None:
    table = dict(worker.TRANSITIONS)
    table[(worker.State.BUSY, worker.Event.STOP)] = worker.State.STOPPED

    class ModifiedWorker(worker.WorkerMachine):
        TABLE = table

    ModifiedWorker.__module__ = worker.__name__
    original = diagrams.render_machine(worker.WorkerMachine)
    modified = diagrams.render_machine(ModifiedWorker)
    assert modified != original
    assert "    BUSY --> STOPPED: STOP" in modified
    machines = tuple(ModifiedWorker if m is worker.WorkerMachine else m for m in diagrams.MACHINES)
    assert diagrams.render_document(machines) != diagrams.render_document()


def test_rendering_shape() -> None:
    text = diagrams.render_machine(worker.WorkerMachine)
    assert "stateDiagram-v2" in text
    assert "    [*] --> STARTING" in text
    assert "    FAILED --> [*]" in text and "    STOPPED --> [*]" in text
    # Parallel edges between one pair of states are merged into one label.
    assert "    BUSY --> BUSY: SESSION_ADDED, SESSION_REMOVED" in text
    assert text.count("BUSY --> BUSY") == 1
    assert diagrams.render_document() == diagrams.render_document()
