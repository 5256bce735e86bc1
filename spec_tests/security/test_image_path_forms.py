"""Every bad form of a create's ``image_path`` is a 400 ``invalid_image_path`` that names the field and what is wrong
with the form, through a real server (front, hypercorn, sockets), and holds nothing.

``'a.png\\x00'`` was refused as "must be relative to the assets directory" (it is relative: the NUL is what is
wrong), and ``'a.png/'`` or ``'a.png/.'`` (a folder's form) were taken as the file ``a.png``: ``pathlib`` drops a
trailing ``/`` and ``.`` where the system refuses them. A name with a control character was taken when such a file
was there (a prompt holding one is refused), a name too long for any file system was a lookup's ``strerror``, and a
directory or a pipe was "a directory, a pipe or a device" without saying which. The forms that name a file
(``./a.png``, ``sub//b.png``) are taken as before.
"""

from __future__ import annotations

import os
from pathlib import Path

from server.reasons import echo

from ..server.conftest import png_bytes
from .test_hostile_server import running

IMAGE_REPLAY = str(Path(__file__).parents[1] / "server" / "image_replay.py")
SESSIONS = "/v1/stream/sessions"

#: image_path -> the words its refusal must hold (what is wrong with it)
REFUSED = {
    "a.png\x00": "holds a NUL character (at character 5)",
    "a.png/": "ends with '/', the form of a folder",
    "a.png/.": "ends with '/.', the form of a folder",
    "sub/": "ends with '/', the form of a folder",
    "": "is empty",
    ".": "names the assets directory itself",
    "./": "names the assets directory itself",
    "..": "may not contain '..'",
    "sub/../a.png": "may not contain '..'",
    "sub\\b.png": "holds a backslash (at character 3)",
    "/etc/passwd": "must be relative to the assets directory",
    "x" * 300: "has a part of 300 bytes; a file or folder name is at most 255",
    "é" * 200: "has a part of 400 bytes",
    "éééé/" * 499 + "a": "is 4492 bytes long; a path is at most 4095",  # 2496 characters: within the field's 4096
    "tab\t.png": "holds a control character (0x09) at character 3",
    "line\n.png": "holds a control character (0x0a) at character 4",
    "esc\x1b.png": "holds a control character (0x1b) at character 3",
    "del\x7f.png": "holds a control character (0x7f) at character 3",
    "sub": "is a directory in the assets directory, not a regular file",
    "pipe.png": "is a named pipe (FIFO) in the assets directory, not a regular file",
}
TAKEN = ["a.png", "./a.png", "sub//b.png", "sub/./b.png"]


def assets(root: Path) -> Path:
    """``a.png``, ``sub/b.png``, a FIFO, and files whose names hold control characters (refused though they exist)."""
    folder = root / "assets"
    (folder / "sub").mkdir(parents=True)
    for name in ("a.png", "sub/b.png", "tab\t.png", "line\n.png", "esc\x1b.png", "del\x7f.png"):
        (folder / name).write_bytes(png_bytes())
    os.mkfifo(folder / "pipe.png")
    return folder


async def test_each_bad_form_of_image_path_is_a_400_naming_what_is_wrong_and_holds_nothing(tmp_path: Path) -> None:
    async with running(assets_dir=str(assets(tmp_path)), pipeline=IMAGE_REPLAY) as server:
        wrong = {}
        for name, words in REFUSED.items():
            status, answer = await server.request("POST", SESSIONS, {"identity": "ctl", "image_path": name})
            detail = answer.get("detail", "")
            if (status, answer.get("error")) != (400, "invalid_image_path") \
                    or not detail.startswith(f"image_path {echo(name)} ") or words not in detail:
                wrong[name[:20]] = (status, answer)
                if status in (200, 202):  # taken: it goes, so that the next form meets a free slot
                    await server.request("DELETE", f"{SESSIONS}/{answer['session_id']}")
        assert wrong == {}, "\n".join(f"{name!r}: {answer}" for name, answer in wrong.items())
        status, listed = await server.request("GET", SESSIONS)
        assert status == 200 and listed["sessions"] == [], listed
        health = (await server.request("GET", "/v1/stream/health"))[1]
        assert health["retained_sessions"] == 0 and health["queued_sessions"] == 0, health
        for name in TAKEN:  # the forms that name a file as the system reads them
            status, created = await server.request("POST", SESSIONS, {"identity": "ctl", "image_path": name})
            assert status in (200, 202), (name, created)  # one slot: the one before may still be draining
            assert (await server.request("DELETE", f"{SESSIONS}/{created['session_id']}"))[0] == 200
