"""``chunkline worker --cluster-token-file FILE`` as a user meets it: the token is read from a regular file only, no
further than 4 KiB, as UTF-8 text; anything else is one line naming the option and the file, exit code 2, before
the agent loads anything. It read without bound: a pipe waited for ever, ``/dev/zero`` grew the process without
end, a file of 100 MB was taken as the token; a file that was not UTF-8 named neither the option nor the file."""

from __future__ import annotations

import subprocess
from pathlib import Path

import pytest

from .conftest import ROOT, TINY, chunkline, clean_env
from .token_files import token_file

OPTION = "--cluster-token-file"
EXIT_DEADLINE = 120.0  # seconds for the command to import what it checks with (a loaded 2-core host)


def _worker_with_token_file(path: Path | str) -> subprocess.CompletedProcess[str]:
    command = chunkline("worker", TINY, "--authority", "tcp://127.0.0.1:1", OPTION, str(path))
    return subprocess.run(command, cwd=str(ROOT), env=clean_env(), capture_output=True, text=True,
                          timeout=EXIT_DEADLINE, stdin=subprocess.DEVNULL)


@pytest.mark.parametrize(("kind", "words"), [
    ("pipe", "is not a regular file"),  # it waited for a writer for ever
    ("/dev/null", "is not a regular file"),  # a device: /dev/zero read without end
    ("large", "holds more than 4096 bytes"),  # 100 MB was taken as the token
    ("latin-1", "is not UTF-8 text"),  # a UnicodeDecodeError naming neither the option nor the file
    ("missing", "no such file"),  # named the file, not the option
    ("directory", "is a directory, not a file"),
    ("blank", "is empty"),
])
def test_a_token_file_that_cannot_hold_a_token_is_one_line_naming_the_option_and_the_file(
    tmp_path: Path, kind: str, words: str
) -> None:
    path = token_file(tmp_path, kind)
    result = _worker_with_token_file(path)
    lines = result.stderr.strip().splitlines()
    assert result.returncode == 2, result.stderr[-2000:]
    assert len(lines) == 1 and lines[0].startswith(f"chunkline worker: error: {OPTION}: "), result.stderr[-2000:]
    assert repr(str(path)) in lines[0] and words in lines[0], lines[0]


def test_a_long_token_file_name_is_shown_cut(tmp_path: Path) -> None:
    name = tmp_path / ("n" * 200) / "token"
    result = _worker_with_token_file(name)
    assert result.returncode == 2 and "no such file" in result.stderr, result.stderr[-2000:]
    assert "n" * 200 not in result.stderr and "characters in all" in result.stderr, result.stderr


@pytest.mark.parametrize("form", ["separate", "equals"])
def test_a_token_on_the_worker_command_line_is_refused_without_repeating_it(form: str) -> None:
    """``chunkline worker --cluster-token SECRET`` (as one gives it to ``stream-serve``) was taken as an abbreviation
    of ``--cluster-token-file``: "no such file 'SECRET'", the secret printed in a line that named another option."""
    secret = "s3cret-token-of-the-cluster-0123456789"
    given = ["--cluster-token", secret] if form == "separate" else [f"--cluster-token={secret}"]
    command = chunkline("worker", TINY, "--authority", "tcp://127.0.0.1:1", *given)
    result = subprocess.run(command, cwd=str(ROOT), env=clean_env(), capture_output=True, text=True,
                            timeout=EXIT_DEADLINE, stdin=subprocess.DEVNULL)
    lines = result.stderr.strip().splitlines()
    assert result.returncode == 2, result.stderr[-2000:]
    assert len(lines) == 1 and lines[0].startswith("chunkline worker: error: --cluster-token "), result.stderr[-2000:]
    assert "CHUNKLINE_CLUSTER_TOKEN" in lines[0] and "--cluster-token-file" in lines[0], lines[0]
    assert secret not in result.stderr + result.stdout, result.stderr
