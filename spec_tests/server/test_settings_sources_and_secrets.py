"""Server settings, where they come from and what they show: CLI > environment > default (every field read from
its variable), the transport chosen from the LiveKit values given, and secrets redacted in repr and the public
dict. (Defaults, parsing, validation, GPU maps and CORS origins: ``test_settings.py``.)"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import trustme

from server.settings import ServerSettings, SettingsError, env_var

from .settings_helpers import LIVEKIT, SECRET, make


# --- precedence: CLI > environment > default ---------------------------------------------------------------


@pytest.mark.parametrize(
    ("field", "cli_value", "env_value", "default", "cli_expected", "env_expected"),
    [
        ("queue_size", "5", "9", 0, 5, 9),
        ("port", "9001", "9002", 8088, 9001, 9002),
        ("host", "0.0.0.0", "10.0.0.1", "127.0.0.1", "0.0.0.0", "10.0.0.1"),
        ("control_idle_timeout", "1.5", "3", 10.0, 1.5, 3.0),
        ("max_sessions_per_worker", "2", "auto", "auto", 2, "auto"),
        ("worker_mode", "process", "in-process", "in-process", "process", "in-process"),
        ("skip_validation", False, "true", False, False, True),
        ("token_ttl", "60", "120", 3600.0, 60.0, 120.0),
        (
            "cors_allow_origins",
            "https://a.example",
            "https://b.example",
            (),
            ("https://a.example",),
            ("https://b.example",),
        ),
        ("max_body_bytes", "2048", "4096", 8 * 1024 * 1024, 2048, 4096),
        ("pipeline", "cli.py", "env.py", None, "cli.py", "env.py"),
    ],
)
def test_precedence(
    field: str, cli_value: Any, env_value: str, default: Any, cli_expected: Any, env_expected: Any
) -> None:
    base_cli = {} if field == "pipeline" else {"pipeline": "pipe.py"}
    env = {env_var(field): env_value}
    assert getattr(ServerSettings.from_sources({**base_cli, field: cli_value}, env), field) == cli_expected
    assert getattr(ServerSettings.from_sources({**base_cli, field: None}, env), field) == env_expected
    if field != "pipeline":
        assert getattr(ServerSettings.from_sources({**base_cli, field: None}, {}), field) == default


def test_a_good_cli_value_hides_a_bad_environment_value() -> None:
    env = {"CHUNKLINE_QUEUE_SIZE": "lots", "CHUNKLINE_PIPELINE": "p.py"}
    assert ServerSettings.from_sources({"queue_size": "3"}, env).queue_size == 3
    with pytest.raises(SettingsError, match="CHUNKLINE_QUEUE_SIZE"):
        ServerSettings.from_sources({"queue_size": None}, env)


def test_a_bad_cli_value_is_not_blamed_on_the_environment() -> None:
    env = {"CHUNKLINE_QUEUE_SIZE": "3", "CHUNKLINE_PIPELINE": "p.py"}
    with pytest.raises(SettingsError) as info:
        ServerSettings.from_sources({"queue_size": "-2"}, env)
    assert info.value.option == "--queue-size"
    assert "CHUNKLINE_QUEUE_SIZE" not in str(info.value)


def test_every_field_reads_its_environment_variable(tmp_path: Path) -> None:
    env = {
        "CHUNKLINE_PIPELINE": "env.py",
        "CHUNKLINE_PLACEMENT": '{"mode": "in-process"}',
        "CHUNKLINE_HOST": "0.0.0.0",
        "CHUNKLINE_PORT": "1234",
        "CHUNKLINE_TRANSPORT": "livekit",
        "CHUNKLINE_LIVEKIT_URL": "ws://localhost:7880",
        "CHUNKLINE_LIVEKIT_API_KEY": "devkey",
        "CHUNKLINE_LIVEKIT_API_SECRET": SECRET,
        "CHUNKLINE_NUM_WORKERS": "2",
        "CHUNKLINE_WORKER_GPU_MAP": "0;1",
        "CHUNKLINE_MAX_SESSIONS_PER_WORKER": "3",
        "CHUNKLINE_QUEUE_SIZE": "4",
        "CHUNKLINE_CONTROL_IDLE_TIMEOUT": "5",
        "CHUNKLINE_SESSION_TIMEOUT": "6",
        "CHUNKLINE_TOKEN_TTL": "7",
        "CHUNKLINE_CONTROLLER_TIMEOUT": "8",
        "CHUNKLINE_ROOM_EMPTY_TIMEOUT": "9",
        "CHUNKLINE_WORKER_MODE": "process",
        "CHUNKLINE_SKIP_VALIDATION": "1",
        "CHUNKLINE_ASSETS_DIR": str(tmp_path),
        "CHUNKLINE_API_KEY": "hunter2",
        "CHUNKLINE_CORS_ALLOW_ORIGINS": "*",
        "CHUNKLINE_DEFAULT_FPS": "30",
        "CHUNKLINE_MAX_DATA_MESSAGE_BYTES": "4096",
        "CHUNKLINE_MAX_BODY_BYTES": "65536",
        "CHUNKLINE_MAX_BODY_BYTES_IN_FLIGHT": "131072",
        "CHUNKLINE_SOCKET_SEND_BUFFER": "524288",
        "CHUNKLINE_TERMINAL_RETENTION_SECONDS": "11",
        "CHUNKLINE_TERMINAL_RETENTION_COUNT": "12",
        "CHUNKLINE_WORKERS": "ray",
        "CHUNKLINE_CLUSTER_HOST": "0.0.0.0",
        "CHUNKLINE_CLUSTER_PORT": "7070",
        "CHUNKLINE_CLUSTER_TOKEN": "a-cluster-token-of-16+",
        "CHUNKLINE_CLUSTER_TLS_CERT": str(tmp_path / "cert.pem"),
        "CHUNKLINE_CLUSTER_TLS_KEY": str(tmp_path / "key.pem"),
        "CHUNKLINE_PUBLIC_URL": "http://10.0.0.5:8088",
        "CHUNKLINE_HEARTBEAT_INTERVAL": "2",
        "CHUNKLINE_HEARTBEAT_DEADLINE": "9",
        "CHUNKLINE_RAY_ADDRESS": "auto",
    }
    issued = trustme.CA().issue_cert("127.0.0.1")  # a real pair: the settings check that they are one
    issued.cert_chain_pems[0].write_to_path(str(tmp_path / "cert.pem"))
    issued.private_key_pem.write_to_path(str(tmp_path / "key.pem"))
    # the token's file is the token's other source, one at a time: read below, in the token's place
    assert set(env) | {"CHUNKLINE_CLUSTER_TOKEN_FILE"} == {env_var(name) for name in ServerSettings.field_names()}
    s = ServerSettings.from_sources({}, env)
    assert s.public_dict() == {
        "pipeline": "env.py",
        "placement": '{"mode": "in-process"}',
        "host": "0.0.0.0",
        "port": 1234,
        "livekit_url": "ws://localhost:7880",
        "livekit_api_key": "devkey",
        "livekit_api_secret": "***",
        "transport": "livekit",
        "num_workers": 2,
        "worker_gpu_map": [[0], [1]],
        "max_sessions_per_worker": 3,
        "queue_size": 4,
        "control_idle_timeout": 5.0,
        "session_timeout": 6.0,
        "token_ttl": 7.0,
        "controller_timeout": 8.0,
        "room_empty_timeout": 9.0,
        "worker_mode": "process",
        "skip_validation": True,
        "assets_dir": str(tmp_path),
        "api_key": "***",
        "cors_allow_origins": ["*"],
        "default_fps": 30.0,
        "max_data_message_bytes": 4096,
        "max_body_bytes": 65536,
        "max_body_bytes_in_flight": 131072,
        "socket_send_buffer": 524288,
        "terminal_retention_seconds": 11.0,
        "terminal_retention_count": 12,
        "workers": "ray",
        "cluster_host": "0.0.0.0",
        "cluster_port": 7070,
        "cluster_token": "***",
        "cluster_token_file": None,
        "cluster_tls_cert": str(tmp_path / "cert.pem"),
        "cluster_tls_key": str(tmp_path / "key.pem"),
        "public_url": "http://10.0.0.5:8088",
        "heartbeat_interval": 2.0,
        "heartbeat_deadline": 9.0,
        "ray_address": "auto",
    }
    (tmp_path / "token").write_text("a-token-from-its-file\n")
    env["CHUNKLINE_CLUSTER_TOKEN_FILE"] = str(tmp_path / "token")
    del env["CHUNKLINE_CLUSTER_TOKEN"]
    s = ServerSettings.from_sources({}, env)
    assert (s.cluster_token, s.cluster_token_file) == ("a-token-from-its-file", str(tmp_path / "token"))
    assert s.public_dict()["cluster_token"] == "***"


# --- transport ---------------------------------------------------------------------------------------------


def test_transport_is_local_without_a_livekit_url() -> None:
    assert make().transport == "local"
    assert make(livekit_api_key="k", livekit_api_secret=SECRET).transport == "local"


def test_transport_is_livekit_when_a_url_is_set() -> None:
    s = make(**LIVEKIT)
    assert s.transport == "livekit"
    assert s.livekit_configured


def test_transport_local_can_be_forced_with_a_url_set() -> None:
    s = make(transport="local", livekit_url="wss://lk.example")
    assert s.transport == "local"


def test_blank_livekit_values_mean_unset() -> None:
    s = make(livekit_url="", livekit_api_key=" ", livekit_api_secret="")
    assert (s.transport, s.livekit_url, s.livekit_api_key, s.livekit_api_secret) == ("local", None, None, None)


@pytest.mark.parametrize(
    ("given", "missing"),
    [
        ({}, ["--livekit-url", "--livekit-api-key", "--livekit-api-secret"]),
        ({"livekit_url": "wss://lk.example"}, ["--livekit-api-key", "--livekit-api-secret"]),
        ({"livekit_url": "wss://lk.example", "livekit_api_key": "k"}, ["--livekit-api-secret"]),
        ({"livekit_api_key": "k", "livekit_api_secret": SECRET}, ["--livekit-url"]),
    ],
)
def test_livekit_without_credentials_names_the_missing_ones(given: dict[str, str], missing: list[str]) -> None:
    with pytest.raises(SettingsError) as info:
        make(transport="livekit", **given)
    assert info.value.option == missing[0]
    for flag in missing:
        assert flag in str(info.value)
    for flag in {"--livekit-url", "--livekit-api-key", "--livekit-api-secret"} - set(missing):
        assert flag not in str(info.value)


def test_a_url_alone_selects_livekit_and_then_asks_for_the_key_and_secret() -> None:
    with pytest.raises(SettingsError, match="--livekit-api-key, --livekit-api-secret"):
        ServerSettings.from_sources({"pipeline": "p.py"}, {"CHUNKLINE_LIVEKIT_URL": "ws://localhost:7880"})


# --- secrets -----------------------------------------------------------------------------------------------


def test_secrets_are_redacted_in_repr_and_public_dict() -> None:
    s = make(api_key="the-api-key-value", **LIVEKIT)
    text = repr(s)
    assert SECRET not in text
    assert "the-api-key-value" not in text
    assert "livekit_api_secret='***'" in text
    assert "api_key='***'" in text
    assert "livekit_api_key='APIkey'" in text  # the key id is not a secret
    public = s.public_dict()
    assert public["livekit_api_secret"] == "***"
    assert public["api_key"] == "***"
    assert SECRET not in str(public) and "the-api-key-value" not in str(public)
    assert s.redacted() == public
    assert set(public) == set(ServerSettings.field_names())
    # the real values are still there for the server to use
    assert s.livekit_api_secret == SECRET
    assert s.api_key == "the-api-key-value"


def test_unset_secrets_show_as_none() -> None:
    s = make()
    assert s.public_dict()["api_key"] is None
    assert s.public_dict()["livekit_api_secret"] is None
    assert "api_key=None" in repr(s)


def test_public_dict_is_json_ready() -> None:
    import json

    s = make(num_workers=2, worker_gpu_map="0,1;2", cors_allow_origins="https://a.example")
    data = json.loads(json.dumps(s.public_dict()))
    assert data["worker_gpu_map"] == [[0, 1], [2]]
    assert data["cors_allow_origins"] == ["https://a.example"]
