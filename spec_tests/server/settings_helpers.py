"""What the server settings tests share (``test_settings.py``, ``test_settings_sources_and_secrets.py``): a
LiveKit secret long enough, a full set of LiveKit values, and settings built from keyword values with a pipeline.
"""

from __future__ import annotations

from typing import Any

from server.settings import MIN_LIVEKIT_SECRET_BYTES, ServerSettings

SECRET = "s" * MIN_LIVEKIT_SECRET_BYTES
LIVEKIT = {"livekit_url": "wss://lk.example", "livekit_api_key": "APIkey", "livekit_api_secret": SECRET}


def make(**values: Any) -> ServerSettings:
    return ServerSettings(pipeline=values.pop("pipeline", "pipe.py"), **values)
