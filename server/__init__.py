"""The stream server (HTTP API, rooms, transports, runners). Imports states, engine and pipelines.

``server:app`` is the application built from ``CHUNKLINE_*`` environment
variables (``CHUNKLINE_PIPELINE`` names the pipeline), for
``hypercorn --worker-class trio server:app`` — plain ``hypercorn server:app``
works too. It is built on first access, so importing the package stays cheap.
"""

from __future__ import annotations

from typing import Any

__all__ = ["app", "build_app_from_environment"]

_app: Any = None


def build_app_from_environment() -> Any:
    import os

    from .app import create_app
    from .asgi_shim import TrioASGIAnyWorker
    from .settings import ServerSettings

    settings = ServerSettings.from_sources({}, os.environ)
    return TrioASGIAnyWorker(create_app(settings))


class _LazyApp:
    """A real module attribute (hypercorn looks ``app`` up with ``eval``) that builds the
    application on first use, so ``import server`` needs no configuration."""

    def _target(self) -> Any:
        global _app
        if _app is None:
            _app = build_app_from_environment()
        return _app

    async def __call__(self, scope: Any, receive: Any, send: Any) -> None:
        await self._target()(scope, receive, send)

    def __getattr__(self, name: str) -> Any:
        return getattr(self._target(), name)


app = _LazyApp()
