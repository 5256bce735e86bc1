"""``chunkline stream-serve``: every option as a flag, CLI > env > default, exit code 2 naming the option."""

from __future__ import annotations

import os
import sys
import types
from pathlib import Path
from typing import Any

import pytest

import pipelines
from server.cli import build_parser, main, parse_stream_serve_args
from server.settings import MIN_LIVEKIT_SECRET_BYTES, ServerSettings, SettingsError, env_var, option_for

REPLAY = str(Path(pipelines.__file__).parent / "replay")
SECRET = "k" * MIN_LIVEKIT_SECRET_BYTES


@pytest.fixture(autouse=True)
def clean_environment(monkeypatch: pytest.MonkeyPatch) -> None:
    """The developer's own CHUNKLINE_* variables must not leak into these tests."""
    for name in list(os.environ):
        if name.startswith("CHUNKLINE_"):
            monkeypatch.delenv(name)


@pytest.fixture
def fake_serve(monkeypatch: pytest.MonkeyPatch) -> list[ServerSettings]:
    """Stand in for ``server.serve`` (the lead's module) and record what ``run`` was given."""
    calls: list[ServerSettings] = []
    module = types.ModuleType("server.serve")

    def run(settings: ServerSettings) -> int:
        calls.append(settings)
        return 0

    module.run = run  # type: ignore[attr-defined]
    monkeypatch.setitem(sys.modules, "server.serve", module)
    return calls


# --- parsing -----------------------------------------------------------------------------------------------


def test_every_setting_has_a_flag(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as info:
        main(["stream-serve", "--help"])
    assert info.value.code == 0
    help_text = " ".join(capsys.readouterr().out.split())  # undo argparse's line wrapping
    for name in ServerSettings.field_names():
        if name != "pipeline":
            assert option_for(name) in help_text
        assert env_var(name) in help_text


@pytest.mark.parametrize("url", ["ws://lk.example:7880", "wss://lk.example", "http://lk.example:7880",
                                 "https://lk.example"])
def test_the_help_names_every_livekit_url_scheme_it_takes(url: str, capsys: pytest.CaptureFixture[str]) -> None:
    """--help said ``(ws:// or wss://)`` while http:// and https:// URLs were taken as well."""
    keys = ["--livekit-api-key", "key", "--livekit-api-secret", "s" * 32]
    assert parse_stream_serve_args(["pipe.py", "--livekit-url", url, *keys], {}).livekit_url == url
    with pytest.raises(SystemExit):
        main(["stream-serve", "--help"])
    help_text = " ".join(capsys.readouterr().out.split())
    described = help_text.split("--livekit-url URL ", 1)[1].split("--livekit-api-key", 1)[0]
    assert url.split("//")[0] + "//" in described, described


def test_the_help_says_what_the_control_idle_timeout_governs(capsys: pytest.CaptureFixture[str]) -> None:
    """--help said a held control was released after it; it is when an idle session gives up the execution lease
    (README, "The execution lease"; the metadata's ``control_idle_timeout``), and held keys stay held."""
    with pytest.raises(SystemExit):
        main(["stream-serve", "--help"])
    help_text = " ".join(capsys.readouterr().out.split())
    described = help_text.split("--control-idle-timeout SECONDS ", 1)[1].split("--session-timeout", 1)[0]
    assert "execution lease" in described and "released" not in described, described


def test_no_flags_gives_the_defaults() -> None:
    assert parse_stream_serve_args(["pipe.py"], {}) == ServerSettings(pipeline="pipe.py")


def test_a_leading_command_word_is_accepted() -> None:
    assert parse_stream_serve_args(["stream-serve", "pipe.py"], {}) == ServerSettings(pipeline="pipe.py")


def test_all_flags(tmp_path: Path) -> None:
    s = parse_stream_serve_args(
        [
            "pipe.py",
            "--host", "0.0.0.0",
            "-p", "9000",
            "--transport", "livekit",
            "--livekit-url", "wss://lk.example",
            "--livekit-api-key", "key",
            "--livekit-api-secret", SECRET,
            "--num-workers", "2",
            "--worker-gpu-map", "0,1;2,3",
            "--max-sessions-per-worker", "3",
            "--queue-size", "5",
            "--control-idle-timeout", "2.5",
            "--session-timeout", "100",
            "--token-ttl", "200",
            "--controller-timeout", "30",
            "--room-empty-timeout", "15",
            "--worker-mode", "process",
            "--skip-validation",
            "--assets-dir", str(tmp_path),
            "--api-key", "apikey",
            "--cors-allow-origins", "https://a.example,http://localhost:3000",
            "--default-fps", "24",
            "--max-data-message-bytes", "2048",
            "--max-body-bytes", "65536",
            "--terminal-retention-seconds", "60",
            "--terminal-retention-count", "10",
        ],
        {},
    )  # fmt: skip
    assert s == ServerSettings(
        pipeline="pipe.py",
        host="0.0.0.0",
        port=9000,
        transport="livekit",
        livekit_url="wss://lk.example",
        livekit_api_key="key",
        livekit_api_secret=SECRET,
        num_workers=2,
        worker_gpu_map=((0, 1), (2, 3)),
        max_sessions_per_worker=3,
        queue_size=5,
        control_idle_timeout=2.5,
        session_timeout=100.0,
        token_ttl=200.0,
        controller_timeout=30.0,
        room_empty_timeout=15.0,
        worker_mode="process",
        skip_validation=True,
        assets_dir=str(tmp_path),
        api_key="apikey",
        cors_allow_origins=("https://a.example", "http://localhost:3000"),
        default_fps=24.0,
        max_data_message_bytes=2048,
        max_body_bytes=65536,
        terminal_retention_seconds=60.0,
        terminal_retention_count=10,
    )


def test_pipe_may_come_from_the_environment() -> None:
    assert parse_stream_serve_args([], {"CHUNKLINE_PIPELINE": "env.py"}).pipeline == "env.py"
    assert parse_stream_serve_args(["cli.py"], {"CHUNKLINE_PIPELINE": "env.py"}).pipeline == "cli.py"


def test_cli_over_env_over_default() -> None:
    env = {
        "CHUNKLINE_QUEUE_SIZE": "9",
        "CHUNKLINE_PORT": "7000",
        "CHUNKLINE_WORKER_MODE": "process",
        "CHUNKLINE_SKIP_VALIDATION": "true",
        "CHUNKLINE_MAX_SESSIONS_PER_WORKER": "2",
    }
    s = parse_stream_serve_args(["p.py", "--queue-size", "4", "--no-skip-validation"], env)
    assert s.queue_size == 4  # CLI
    assert s.skip_validation is False  # CLI (negative flag) over env
    assert s.port == 7000  # env
    assert s.worker_mode == "process"  # env
    assert s.max_sessions_per_worker == 2  # env
    assert s.host == "127.0.0.1"  # default
    assert s.control_idle_timeout == 10.0  # default


def test_a_livekit_url_selects_the_livekit_transport() -> None:
    env = {"CHUNKLINE_LIVEKIT_API_KEY": "key", "CHUNKLINE_LIVEKIT_API_SECRET": SECRET}
    assert parse_stream_serve_args(["p.py"], env).transport == "local"
    assert parse_stream_serve_args(["p.py", "--livekit-url", "ws://localhost:7880"], env).transport == "livekit"
    # LiveKit exported for the shell, --transport local: the way to run without it
    forced = parse_stream_serve_args(["p.py", "--transport", "local"], {**env, "CHUNKLINE_LIVEKIT_URL": "ws://x:7880"})
    assert forced.transport == "local"
    # given on the command line with --transport local, the URL would do nothing: refused, naming it
    with pytest.raises(SettingsError) as info:
        parse_stream_serve_args(["p.py", "--livekit-url", "ws://x:7880", "--transport", "local"], env)
    assert info.value.option == "--livekit-url"


def test_parse_raises_settings_error_for_bad_values() -> None:
    with pytest.raises(SettingsError) as info:
        parse_stream_serve_args(["p.py", "--num-workers", "0"], {})
    assert info.value.option == "--num-workers"


# --- main: exit code 2 naming the option ---------------------------------------------------------------------


@pytest.mark.parametrize(
    ("argv", "option"),
    [
        (["--queue-size", "-1"], "--queue-size"),
        (["--queue-size", "lots"], "--queue-size"),
        (["--port", "70000"], "--port"),
        (["--num-workers", "65"], "--num-workers"),
        (["--max-sessions-per-worker", "0"], "--max-sessions-per-worker"),
        (["--worker-mode", "threads"], "--worker-mode"),
        (["--transport", "carrier-pigeon"], "--transport"),
        (["--transport", "livekit"], "--livekit-url"),
        (["--livekit-url", "wss://lk.example"], "--livekit-api-key"),
        (["--livekit-api-secret", "short"], "--livekit-api-secret"),
        (["--control-idle-timeout", "0"], "--control-idle-timeout"),
        (["--session-timeout", "-5"], "--session-timeout"),
        (["--token-ttl", "never"], "--token-ttl"),
        (["--controller-timeout", "0"], "--controller-timeout"),
        (["--room-empty-timeout", "nan"], "--room-empty-timeout"),
        (["--num-workers", "2", "--worker-gpu-map", "0,1;1"], "--worker-gpu-map"),
        (["--worker-gpu-map", "0;1"], "--worker-gpu-map"),
        (["--assets-dir", "/definitely/not/here"], "--assets-dir"),
        (["--api-key", ""], "--api-key"),
        (["--cors-allow-origins", "a.example"], "--cors-allow-origins"),
        (["--default-fps", "500"], "--default-fps"),
        (["--max-body-bytes", "10"], "--max-body-bytes"),
        (["--max-data-message-bytes", "100"], "--max-data-message-bytes"),
        (["--max-data-message-bytes", "99999999999"], "--max-data-message-bytes"),  # a client's message is held whole
        (["--max-body-bytes", "99999999999"], "--max-body-bytes"),  # a body is read into memory
        (["--max-body-bytes-in-flight", "65536"], "--max-body-bytes-in-flight"),  # below --max-body-bytes
        (["--terminal-retention-count", "-1"], "--terminal-retention-count"),
    ],
)
def test_bad_flags_exit_2_naming_the_option(
    argv: list[str], option: str, capsys: pytest.CaptureFixture[str], fake_serve: list[ServerSettings]
) -> None:
    assert main(["stream-serve", REPLAY, *argv]) == 2
    err = capsys.readouterr().err
    assert err.startswith("chunkline stream-serve: error: ")
    assert option in err
    assert fake_serve == []


def test_a_bound_in_a_refusal_is_a_number_one_can_type(
    capsys: pytest.CaptureFixture[str], fake_serve: list[ServerSettings]
) -> None:
    """``--token-ttl 1`` was told "between 5 and 3.1536e+07" (--help: 5 s to 365 days)."""
    assert main(["stream-serve", REPLAY, "--token-ttl", "1"]) == 2
    err = capsys.readouterr().err
    assert "between 5 and 31536000" in err and "e+" not in err, err
    assert fake_serve == []


def test_bad_environment_value_exits_2_naming_option_and_variable(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str], fake_serve: list[ServerSettings]
) -> None:
    monkeypatch.setenv("CHUNKLINE_QUEUE_SIZE", "-4")
    assert main(["stream-serve", REPLAY]) == 2
    err = capsys.readouterr().err
    assert "--queue-size" in err and "CHUNKLINE_QUEUE_SIZE" in err and "'-4'" in err
    assert fake_serve == []


def test_a_chunkline_variable_that_is_no_setting_is_named_in_a_warning(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str], fake_serve: list[ServerSettings]
) -> None:
    """``CHUNKLINE_QUEUE_SIZ=5`` was ignored without a word: the server ran with no queue."""
    monkeypatch.setenv("CHUNKLINE_QUEUE_SIZ", "5")
    monkeypatch.setenv("CHUNKLINE_SOMETHING_ELSE", "x")
    monkeypatch.setenv("CHUNKLINE_CLUSTER_TOKEN", "the worker command's own: no warning")
    assert main(["stream-serve", REPLAY]) == 0
    assert capsys.readouterr().err.splitlines() == [
        "chunkline stream-serve: warning: CHUNKLINE_QUEUE_SIZ is not a chunkline setting (did you mean "
        "CHUNKLINE_QUEUE_SIZE?); it is ignored",
        "chunkline stream-serve: warning: CHUNKLINE_SOMETHING_ELSE is not a chunkline setting; it is ignored",
    ]
    assert fake_serve[0].queue_size == 0  # what the warning says: the default, unchanged


def test_duplicate_gpu_is_refused_at_startup(
    capsys: pytest.CaptureFixture[str], fake_serve: list[ServerSettings]
) -> None:
    assert main(["stream-serve", REPLAY, "--num-workers", "2", "--worker-gpu-map", "0,1;1,2"]) == 2
    err = capsys.readouterr().err
    assert "--worker-gpu-map" in err and "GPU 1 " in err
    assert fake_serve == []


def test_missing_pipe_exits_2(capsys: pytest.CaptureFixture[str], fake_serve: list[ServerSettings]) -> None:
    assert main(["stream-serve"]) == 2
    err = capsys.readouterr().err
    assert "PIPE" in err and "CHUNKLINE_PIPELINE" in err
    assert fake_serve == []


def test_nonexistent_pipe_exits_2(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], fake_serve: list[ServerSettings]
) -> None:
    assert main(["stream-serve", str(tmp_path / "nope.py")]) == 2
    assert "does not exist" in capsys.readouterr().err
    assert fake_serve == []


def test_secrets_are_not_printed_on_errors(
    capsys: pytest.CaptureFixture[str], fake_serve: list[ServerSettings]
) -> None:
    short_secret = "my-short-secret"
    assert main(["stream-serve", REPLAY, "--livekit-api-secret", short_secret]) == 2
    captured = capsys.readouterr()
    assert short_secret not in captured.err + captured.out


def test_unknown_flag_is_an_argparse_error(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as info:
        main(["stream-serve", REPLAY, "--queue-sise", "3"])
    assert info.value.code == 2
    assert "--queue-sise" in capsys.readouterr().err


# --- main: hand-off to server.serve ------------------------------------------------------------------------------


def test_good_settings_are_handed_to_serve_run(
    monkeypatch: pytest.MonkeyPatch, fake_serve: list[ServerSettings]
) -> None:
    monkeypatch.setenv("CHUNKLINE_QUEUE_SIZE", "3")
    monkeypatch.setenv("CHUNKLINE_API_KEY", "from-env")
    assert main(["stream-serve", REPLAY, "--port", "0", "--queue-size", "2"]) == 0
    [settings] = fake_serve
    assert settings.pipeline == REPLAY
    assert settings.port == 0
    assert settings.queue_size == 2
    assert settings.api_key == "from-env"
    assert settings.transport == "local"


def test_pipe_from_the_environment_reaches_serve(
    monkeypatch: pytest.MonkeyPatch, fake_serve: list[ServerSettings]
) -> None:
    monkeypatch.setenv("CHUNKLINE_PIPELINE", REPLAY)
    assert main(["stream-serve"]) == 0
    assert fake_serve[0].pipeline == REPLAY


def test_serve_exit_code_is_returned(monkeypatch: pytest.MonkeyPatch) -> None:
    module = types.ModuleType("server.serve")
    module.run = lambda settings: 3  # type: ignore[attr-defined]
    monkeypatch.setitem(sys.modules, "server.serve", module)
    assert main(["stream-serve", REPLAY]) == 3


# --- chunkline run is unchanged ------------------------------------------------------------------------------


def test_run_still_parses_as_before() -> None:
    args = build_parser().parse_args(["run", "pipe.py"])
    expected: dict[str, Any] = {
        "command": "run",
        "pipeline": "pipe.py",
        "image": None,
        "prompt": None,
        "controls": None,
        "chunks": 8,
        "device": None,
        "seed": None,
        "placement": None,
        "out": "chunkline-run",
        "option": [],
    }
    assert vars(args) == expected
    args = build_parser().parse_args(
        ["run", "p", "--chunks", "3", "--device", "cpu", "--seed", "7", "--option", "a=1", "--option", "b=x"]
    )
    assert (args.chunks, args.device, args.seed, args.option) == (3, "cpu", 7, ["a=1", "b=x"])


def test_run_still_reports_bad_input_with_exit_2(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["run", str(tmp_path / "missing.py"), "--out", str(tmp_path / "out")]) == 2
    assert "does not exist" in capsys.readouterr().err
    assert not (tmp_path / "out").exists()
