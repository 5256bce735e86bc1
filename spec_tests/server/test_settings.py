"""Server settings, their values: defaults, text parsed, validation naming the option, GPU maps, CORS origins.
(Where a value comes from, CLI > env > default, the transport chosen and secrets kept out of sight:
``test_settings_sources_and_secrets.py``.)"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import attrs
import pytest

import server.settings as settings_module
from server.settings import (
    MIN_LIVEKIT_SECRET_BYTES,
    ServerSettings,
    SettingsError,
    env_var,
    option_for,
    parse_cors_origins,
    parse_gpu_map,
)

from .settings_helpers import make


# --- defaults ----------------------------------------------------------------------------------------------


def test_defaults() -> None:
    s = make()
    assert s.pipeline == "pipe.py"
    assert s.host == "127.0.0.1"  # not the reference's 0.0.0.0
    assert s.port == 8088
    assert s.transport == "local"
    assert (s.livekit_url, s.livekit_api_key, s.livekit_api_secret) == (None, None, None)
    assert s.num_workers == 1
    assert s.worker_gpu_map is None
    assert s.max_sessions_per_worker == "auto"
    assert s.queue_size == 0
    assert s.control_idle_timeout == 10.0
    assert s.session_timeout == 1800.0
    assert s.token_ttl == 3600.0
    assert s.controller_timeout == 60.0
    assert s.room_empty_timeout == 30.0
    assert s.worker_mode == "in-process"
    assert s.skip_validation is False
    assert s.assets_dir is None
    assert s.api_key is None
    assert s.cors_allow_origins == ()  # same origin only, not "*"
    assert s.default_fps == 16.0
    assert s.max_data_message_bytes == 12288
    assert s.max_body_bytes == 8 * 1024 * 1024
    assert s.terminal_retention_seconds == 3600.0
    assert s.terminal_retention_count == 1000
    assert s.livekit_configured is False


def test_from_sources_with_nothing_but_a_pipeline_gives_the_defaults() -> None:
    assert ServerSettings.from_sources({"pipeline": "pipe.py"}, {}) == make()
    assert ServerSettings.from_sources({}, {"CHUNKLINE_PIPELINE": "pipe.py"}) == make()


def test_settings_are_frozen() -> None:
    s = make()
    with pytest.raises(attrs.exceptions.FrozenInstanceError):
        s.port = 1  # type: ignore[misc]


def test_option_and_env_names() -> None:
    assert option_for("queue_size") == "--queue-size"
    assert option_for("pipeline") == "PIPE"
    assert env_var("queue_size") == "CHUNKLINE_QUEUE_SIZE"
    assert env_var("livekit_url") == "CHUNKLINE_LIVEKIT_URL"


def test_every_field_is_documented_in_the_module_docstring_table() -> None:
    doc = settings_module.__doc__ or ""
    for name in ServerSettings.field_names():
        assert env_var(name) in doc
        if name != "pipeline":
            assert option_for(name) in doc


# --- parsing text ------------------------------------------------------------------------------------------


def test_text_values_are_parsed() -> None:
    s = make(
        port="9000",
        num_workers=" 2 ",
        worker_gpu_map="0,1; 2,3",
        max_sessions_per_worker="4",
        queue_size="7",
        control_idle_timeout="2.5",
        session_timeout="60",
        token_ttl="1e3",
        worker_mode="Process",
        skip_validation="yes",
        cors_allow_origins="https://a.example, http://localhost:3000",
        default_fps="24",
        max_data_message_bytes="2048",
        max_body_bytes="4096",
        terminal_retention_seconds="10",
        terminal_retention_count="0",
        transport="LOCAL",
    )
    assert s.port == 9000
    assert s.num_workers == 2
    assert s.worker_gpu_map == ((0, 1), (2, 3))
    assert s.max_sessions_per_worker == 4
    assert s.queue_size == 7
    assert s.control_idle_timeout == 2.5
    assert s.session_timeout == 60.0
    assert s.token_ttl == 1000.0
    assert s.worker_mode == "process"
    assert s.skip_validation is True
    assert s.cors_allow_origins == ("https://a.example", "http://localhost:3000")
    assert s.default_fps == 24.0
    assert s.max_data_message_bytes == 2048
    assert s.max_body_bytes == 4096
    assert s.terminal_retention_seconds == 10.0
    assert s.terminal_retention_count == 0
    assert s.transport == "local"


@pytest.mark.parametrize(
    ("text", "expected"),
    [("1", True), ("true", True), ("ON", True), ("yes", True), ("0", False), ("false", False), ("Off", False)],
)
def test_boolean_text(text: str, expected: bool) -> None:
    assert make(skip_validation=text).skip_validation is expected


@pytest.mark.parametrize("value", ["auto", "AUTO", " auto "])
def test_max_sessions_auto(value: str) -> None:
    assert make(max_sessions_per_worker=value).max_sessions_per_worker == "auto"


def test_port_zero_means_any_free_port() -> None:
    assert make(port=0).port == 0


# --- validation errors name the option ---------------------------------------------------------------------

BAD_VALUES: list[tuple[str, Any, str]] = [
    ("host", "", "--host"),
    ("host", "two words", "--host"),
    ("port", "-1", "--port"),
    ("port", 65536, "--port"),
    ("port", "http", "--port"),
    ("port", True, "--port"),
    ("port", 80.5, "--port"),
    ("transport", "webrtc", "--transport"),
    ("livekit_url", "lk.example", "--livekit-url"),
    ("livekit_url", "ftp://lk.example", "--livekit-url"),
    ("livekit_api_secret", "short", "--livekit-api-secret"),
    ("livekit_api_secret", "x" * (MIN_LIVEKIT_SECRET_BYTES - 1), "--livekit-api-secret"),
    ("num_workers", 0, "--num-workers"),
    ("num_workers", "65", "--num-workers"),
    ("num_workers", "one", "--num-workers"),
    ("worker_gpu_map", "0,a", "--worker-gpu-map"),
    ("worker_gpu_map", "-1", "--worker-gpu-map"),
    ("worker_gpu_map", "0;;1", "--worker-gpu-map"),
    ("worker_gpu_map", "0,", "--worker-gpu-map"),
    ("worker_gpu_map", 5, "--worker-gpu-map"),
    ("max_sessions_per_worker", "0", "--max-sessions-per-worker"),
    ("max_sessions_per_worker", 65, "--max-sessions-per-worker"),
    ("max_sessions_per_worker", "many", "--max-sessions-per-worker"),
    ("queue_size", -1, "--queue-size"),
    ("queue_size", "10001", "--queue-size"),
    ("queue_size", "", "--queue-size"),
    ("queue_size", "1.5", "--queue-size"),
    ("control_idle_timeout", 0, "--control-idle-timeout"),
    ("control_idle_timeout", "-1", "--control-idle-timeout"),
    ("control_idle_timeout", "nan", "--control-idle-timeout"),
    ("control_idle_timeout", "inf", "--control-idle-timeout"),
    ("session_timeout", "0", "--session-timeout"),
    ("session_timeout", "soon", "--session-timeout"),
    ("token_ttl", -5, "--token-ttl"),
    ("token_ttl", "1e12", "--token-ttl"),  # past year 9999: every create was a 500 (OverflowError)
    ("token_ttl", "1e-9", "--token-ttl"),  # the worker's own token expired before it joined
    ("worker_gpu_map", "\u00b2", "--worker-gpu-map"),  # "²".isdigit() is true: a traceback, exit 1
    ("worker_gpu_map", "0;\u00b9", "--worker-gpu-map"),
    ("controller_timeout", 0.0, "--controller-timeout"),
    ("room_empty_timeout", "-0.1", "--room-empty-timeout"),
    ("worker_mode", "process-nccl", "--worker-mode"),
    ("worker_mode", "thread", "--worker-mode"),
    ("skip_validation", "maybe", "--skip-validation"),
    ("skip_validation", 2, "--skip-validation"),
    ("api_key", "", "--api-key"),
    ("api_key", "   ", "--api-key"),
    # keys no client can send: every request was a 401 (an HTTP header carries no spaces at its ends, and its bytes
    # are read as Latin-1, so a key past ASCII never matched)
    ("api_key", "\u043a\u043b\u044e\u0447", "--api-key"),
    ("api_key", " spaced key ", "--api-key"),
    ("api_key", "s3cr3t-k\u00e9y", "--api-key"),
    ("cors_allow_origins", "example.com", "--cors-allow-origins"),
    ("cors_allow_origins", "https://a.example/", "--cors-allow-origins"),
    ("cors_allow_origins", "https://a.example/path", "--cors-allow-origins"),
    ("cors_allow_origins", "*,https://a.example", "--cors-allow-origins"),
    ("default_fps", "0.5", "--default-fps"),
    ("default_fps", 121, "--default-fps"),
    ("max_data_message_bytes", 1023, "--max-data-message-bytes"),
    ("max_body_bytes", "100", "--max-body-bytes"),
    ("max_body_bytes", "8MiB", "--max-body-bytes"),
    ("max_body_bytes_in_flight", 1000, "--max-body-bytes-in-flight"),
    ("max_body_bytes_in_flight", 17 * 1024**3, "--max-body-bytes-in-flight"),
    ("max_body_bytes_in_flight", "65536", "--max-body-bytes-in-flight"),  # below the default largest body
    ("terminal_retention_seconds", 0, "--terminal-retention-seconds"),
    ("terminal_retention_count", -1, "--terminal-retention-count"),
    ("cluster_port", 7700, "--cluster-port"),  # with --workers in-process nothing would listen there
    ("public_url", "http://10.0.0.5:8088", "--public-url"),
    ("cluster_host", "0.0.0.0", "--cluster-host"),
    ("ray_address", "auto", "--ray-address"),
    ("pipeline", "", "PIPE"),
    ("pipeline", None, "PIPE"),
]


@pytest.mark.parametrize(("field", "value", "option"), BAD_VALUES)
def test_bad_values_name_the_option(field: str, value: Any, option: str) -> None:
    with pytest.raises(SettingsError) as info:
        make(**{field: value})
    assert info.value.option == option
    assert option in str(info.value)
    assert isinstance(info.value, ValueError)
    if field not in ("livekit_api_secret", "api_key", "pipeline"):
        assert repr(value) in str(info.value) or str(value) in str(info.value)


@pytest.mark.parametrize(("field", "value", "option"), [bad for bad in BAD_VALUES if isinstance(bad[1], str)])
def test_bad_values_from_the_environment_name_the_option_and_the_variable(field: str, value: str, option: str) -> None:
    env = {"CHUNKLINE_PIPELINE": "pipe.py", env_var(field): value}
    with pytest.raises(SettingsError) as info:
        ServerSettings.from_sources({}, env)
    assert info.value.option == option
    assert option in str(info.value)
    assert env_var(field) in str(info.value)


def test_a_short_secret_is_refused_without_echoing_it() -> None:
    secret = "not-long-enough-secret"
    with pytest.raises(SettingsError) as info:
        make(livekit_api_secret=secret)
    assert secret not in str(info.value)
    assert f"got {len(secret)} bytes" in str(info.value)


def test_secret_length_counts_bytes_not_characters() -> None:
    assert make(livekit_api_secret="é" * 16).livekit_api_secret == "é" * 16  # 32 bytes in UTF-8
    with pytest.raises(SettingsError):
        make(livekit_api_secret="é" * 15 + "x")  # 31 bytes


def test_assets_dir_must_be_an_existing_directory(tmp_path: Path) -> None:
    assert make(assets_dir=str(tmp_path)).assets_dir == str(tmp_path)
    assert make(assets_dir=tmp_path).assets_dir == str(tmp_path)
    missing = tmp_path / "missing"
    with pytest.raises(SettingsError, match="does not exist") as info:
        make(assets_dir=str(missing))
    assert info.value.option == "--assets-dir"
    a_file = tmp_path / "file.txt"
    a_file.write_text("x")
    with pytest.raises(SettingsError, match="not a directory") as info:
        make(assets_dir=str(a_file))
    assert info.value.option == "--assets-dir"
    with pytest.raises(SettingsError) as info:
        make(assets_dir="")
    assert info.value.option == "--assets-dir"


def test_missing_pipeline_names_pipe_and_its_variable() -> None:
    with pytest.raises(SettingsError) as info:
        ServerSettings.from_sources({"queue_size": "3"}, {})
    assert info.value.option == "PIPE"
    assert "CHUNKLINE_PIPELINE" in str(info.value)


def test_unknown_cli_keys_are_a_type_error_but_command_is_ignored() -> None:
    assert ServerSettings.from_sources({"command": "stream-serve", "pipeline": "p.py"}, {}).pipeline == "p.py"
    with pytest.raises(TypeError, match="queue_sise"):
        ServerSettings.from_sources({"pipeline": "p.py", "queue_sise": 3}, {})


def test_unrelated_environment_variables_are_ignored() -> None:
    env = {"CHUNKLINE_PIPELINE": "p.py", "CHUNKLINE_SOMETHING_ELSE": "x", "QUEUE_SIZE": "-1", "queue_size": "-1"}
    assert ServerSettings.from_sources({}, env) == make(pipeline="p.py")


# --- GPU maps ----------------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("text", "expected"),
    [
        ("0,1;2,3", ((0, 1), (2, 3))),
        ("0", ((0,),)),
        (" 3 , 1 ; 0 ", ((3, 1), (0,))),
        ("", None),
        ("   ", None),
        (None, None),
        ([[0, 1], (2,)], ((0, 1), (2,))),
    ],
)
def test_parse_gpu_map(text: Any, expected: Any) -> None:
    assert parse_gpu_map(text) == expected


@pytest.mark.parametrize(("text", "gpu"), [("0,1;1,2", 1), ("0;0", 0), ("2,5;3;5", 5), ([[7], [7]], 7)])
def test_a_gpu_in_two_groups_is_refused_naming_it(text: Any, gpu: int) -> None:
    with pytest.raises(SettingsError) as info:
        parse_gpu_map(text)
    assert info.value.option == "--worker-gpu-map"
    assert f"GPU {gpu} " in str(info.value)
    assert "only one worker" in str(info.value)


def test_a_gpu_twice_in_one_group_is_refused() -> None:
    with pytest.raises(SettingsError, match="GPU 0 appears twice"):
        parse_gpu_map("0,0")


def test_gpu_map_group_count_must_equal_num_workers() -> None:
    assert make(num_workers=2, worker_gpu_map="0;1").worker_gpu_map == ((0,), (1,))
    with pytest.raises(SettingsError, match="2 worker group") as info:
        make(num_workers=3, worker_gpu_map="0;1")
    assert info.value.option == "--worker-gpu-map"
    assert "--num-workers" in str(info.value)
    with pytest.raises(SettingsError) as info:
        make(worker_gpu_map="0;1")  # one worker by default
    assert info.value.option == "--worker-gpu-map"


def test_duplicate_gpu_from_the_environment_names_the_variable() -> None:
    env = {"CHUNKLINE_PIPELINE": "p.py", "CHUNKLINE_NUM_WORKERS": "2", "CHUNKLINE_WORKER_GPU_MAP": "0,1;1"}
    with pytest.raises(SettingsError, match="GPU 1 .*CHUNKLINE_WORKER_GPU_MAP"):
        ServerSettings.from_sources({}, env)


# --- CORS origins ------------------------------------------------------------------------------------------


def test_parse_cors_origins() -> None:
    assert parse_cors_origins(None) == ()
    assert parse_cors_origins("") == ()
    assert parse_cors_origins("*") == ("*",)
    assert parse_cors_origins("https://a.example,,https://a.example, http://b:8080") == (
        "https://a.example",
        "http://b:8080",
    )
    assert parse_cors_origins(["https://a.example"]) == ("https://a.example",)


@pytest.mark.parametrize(("host", "cluster_host"), [("127.0.0.1", None), ("0.0.0.0", "127.0.0.1"), ("::", None)])
def test_a_cluster_port_that_is_the_http_port_is_refused_naming_both(host: str, cluster_host: str | None) -> None:
    """It was refused as the listener's "Address already in use", which did not say whose the port was."""
    with pytest.raises(SettingsError) as info:
        make(workers="local", port=47110, cluster_port=47110, host=host, cluster_host=cluster_host)
    assert str(info.value).endswith("--cluster-port 47110 is the server's own --port: agents dial a port of their own; "
                                    "give --cluster-port another (0: any free one)"), str(info.value)


def test_a_cluster_port_like_the_http_port_on_another_interface_is_taken() -> None:
    made = make(workers="local", port=47110, cluster_port=47110, host="127.0.0.1", cluster_host="127.0.0.2")
    assert made.cluster_port == made.port == 47110
