"""The converters of the :class:`~server.settings.ServerSettings` fields that need more than a number range.

Each takes text (from a flag or an environment variable) or a value and returns the checked value, or
raises :class:`SettingsError` naming the flag; the generic parsers (integers, numbers, choices, booleans)
are in :mod:`server.setting_values`. A secret's value never appears in an error.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any, Literal

from .cluster_settings import MIN_CLUSTER_TOKEN_BYTES
from .setting_values import SettingsError, bad_value, blank_to_none, env_var, parse_choice, parse_int

__all__ = [
    "MIN_LIVEKIT_SECRET_BYTES",
    "api_key",
    "assets_dir",
    "cluster_token",
    "existing_file",
    "host_name",
    "livekit_api_key",
    "livekit_api_secret",
    "livekit_url",
    "max_sessions",
    "pipeline_path",
    "placement",
    "require_existing_pipeline",
    "public_url",
    "secret_file",
    "transport_name",
    "worker_mode",
]

MIN_LIVEKIT_SECRET_BYTES = 32  # PyJWT warns about HMAC keys shorter than this
_LIVEKIT_SCHEMES = ("ws://", "wss://", "http://", "https://")


def pipeline_path(value: Any) -> str:
    if not isinstance(value, (str, Path)) or not str(value).strip():
        raise SettingsError(
            "PIPE", f"PIPE (the pipeline file) is required: pass it as an argument or set {env_var('pipeline')}"
        )
    return str(value)


def require_existing_pipeline(path: str, variable: str | None = None) -> None:
    """Raise :class:`SettingsError` naming PIPE (and ``variable``, the environment variable it came from)
    when the pipeline file or package does not exist: checked at start, before any worker tries to load it."""
    if not Path(path).exists():
        where = f" (from environment variable {variable})" if variable else ""
        raise SettingsError("PIPE", f"PIPE {path!r} does not exist{where}")


def require_usable_gpus(settings: Any, variable: str | None = None) -> None:
    """Raise :class:`SettingsError` naming ``--worker-gpu-map`` (and ``variable``, the environment variable it came
    from) when it names a GPU this process cannot use, for workers started on this host (in-process or local agents;
    a Ray node or an external agent checks its own): such a map was taken, and the workers ran on the CPU."""
    from .gpu_devices import missing_gpus

    if settings.worker_gpu_map is None or settings.workers not in ("in-process", "local"):
        return
    problem = missing_gpus((gpu for group in settings.worker_gpu_map for gpu in group), "--worker-gpu-map")
    if problem is not None:
        where = f" (from environment variable {variable})" if variable else ""
        raise SettingsError("--worker-gpu-map", problem + where)


def host_name(value: Any) -> str:
    if not isinstance(value, str) or not value.strip() or any(ch.isspace() for ch in value.strip()):
        raise bad_value("--host", "a host name or IP address", value)
    return value.strip()


def transport_name(value: Any) -> str | None:
    if value is None:
        return None
    return parse_choice("--transport", value, ("local", "livekit"))


def livekit_url(value: Any) -> str | None:
    value = blank_to_none(value)
    if value is None:
        return None
    if not isinstance(value, str) or not value.strip().lower().startswith(_LIVEKIT_SCHEMES):
        raise bad_value("--livekit-url", "a ws://, wss://, http:// or https:// URL", value)
    return value.strip()


def public_url(value: Any) -> str:
    if not isinstance(value, str) or not value.strip().startswith("http://") or ":" not in value.strip()[7:]:
        raise bad_value("--public-url", "http://HOST:PORT", value)
    return value.strip().rstrip("/")


def livekit_api_key(value: Any) -> str | None:
    value = blank_to_none(value)
    if value is None:
        return None
    if not isinstance(value, str):
        raise SettingsError("--livekit-api-key", "--livekit-api-key must be text")
    return value.strip()


def livekit_api_secret(value: Any) -> str | None:
    value = blank_to_none(value)
    if value is None:
        return None
    if not isinstance(value, str):
        raise SettingsError("--livekit-api-secret", "--livekit-api-secret must be text")
    size = len(value.encode("utf-8"))
    if size < MIN_LIVEKIT_SECRET_BYTES:  # never echo the secret itself
        raise SettingsError(
            "--livekit-api-secret",
            f"--livekit-api-secret must be at least {MIN_LIVEKIT_SECRET_BYTES} bytes, got {size} bytes",
        )
    return value


def max_sessions(value: Any) -> int | Literal["auto"]:
    if isinstance(value, str) and value.strip().lower() == "auto":
        return "auto"
    try:
        return parse_int("--max-sessions-per-worker", value, 1, 64)
    except SettingsError:
        raise bad_value("--max-sessions-per-worker", "'auto' or an integer between 1 and 64", value) from None


def worker_mode(value: Any) -> str:
    return parse_choice("--worker-mode", value, ("in-process", "process"))


def placement(value: Any) -> str | None:
    """A placement file that exists, or inline JSON (``{...}``), a JSON object asking for no more worker processes than
    a placement may (:mod:`server.placement_size`: 500 ranks were spawned); the pipeline validates the rest."""
    from .placement_size import not_an_object, placement_problem

    value = blank_to_none(value)
    if value is None:
        return None
    if isinstance(value, Path):
        value = str(value)
    if not isinstance(value, str):
        raise bad_value("--placement", "a JSON placement file or inline JSON", value)
    if value.strip().startswith("{"):
        value = value.strip()
    else:
        path = Path(value).expanduser()
        if not path.is_file():
            problem = not_an_object(value) or f"{value!r} is not an existing file"
            raise SettingsError("--placement", f"--placement: {problem}")
        value = str(path)
    if (problem := placement_problem(value)) is not None:
        raise SettingsError("--placement", f"--placement: {problem}")
    return value


def existing_file(option: str) -> Any:
    def convert(value: Any) -> str | None:
        value = blank_to_none(value)
        if value is None:
            return None
        if not isinstance(value, (str, Path)) or not Path(value).expanduser().is_file():
            raise SettingsError(option, f"{option} {str(value)!r} is not an existing file")
        return str(Path(value).expanduser())

    return convert


def cluster_token(value: Any) -> str | None:
    value = blank_to_none(value)
    if value is None:
        return None
    if not isinstance(value, str) or len(value.encode()) < MIN_CLUSTER_TOKEN_BYTES:
        raise SettingsError("--cluster-token", f"--cluster-token must be at least {MIN_CLUSTER_TOKEN_BYTES} bytes of text")
    return value


def secret_file(option: str) -> Any:
    """The converter of a setting naming a secret's file: its path as given (blank: not set). The file is read
    only once the settings that would ignore it have been refused (:mod:`server.cluster_settings`)."""

    def convert(value: Any) -> str | None:
        value = blank_to_none(value)
        if value is None:
            return None
        if not isinstance(value, (str, Path)):
            raise bad_value(option, "the path of a file", value)
        return str(value)

    return convert


def assets_dir(value: Any) -> str | None:
    if value is None:
        return None
    if not isinstance(value, (str, Path)) or not str(value).strip():
        raise bad_value("--assets-dir", "an existing directory", value)
    path = Path(value).expanduser()
    if not path.exists():
        raise SettingsError("--assets-dir", f"--assets-dir {str(value)!r} does not exist")
    if not path.is_dir():
        raise SettingsError("--assets-dir", f"--assets-dir {str(value)!r} is not a directory")
    return str(path)


def api_key(value: Any) -> str | None:
    if value is None:
        return None
    if not isinstance(value, str) or not value.strip():
        raise SettingsError("--api-key", "--api-key must be non-empty when given (unset it to disable auth)")
    if not all("!" <= character <= "~" for character in value):  # (the key itself is never echoed)
        raise SettingsError("--api-key", "--api-key must be visible ASCII characters only, no spaces: a client sends "
                                         "it in a header, 'Authorization: Bearer <key>', which carries no others "
                                         "intact (every request would be refused)")
    return value
