"""Where chunkline's log lines go: stderr, one format, for the commands and under hypercorn alike.

The commands (``chunkline stream-serve``, ``chunkline worker``) own their process and configure the root logger.
Under ``hypercorn server:app`` hypercorn configures only its own loggers and leaves the root alone, so every INFO
line of chunkline's (a worker ready, a drain begun and done, an agent's arrival) was dropped and only warnings
reached stderr, through Python's last-resort handler: :func:`log_under_hypercorn` gives chunkline's loggers the
commands' handler unless logging was configured (``hypercorn --log-config``, which then decides).
"""

from __future__ import annotations

import logging

__all__ = ["LOG_FORMAT", "OWN_LOGGERS", "log_to_stderr", "log_under_hypercorn"]

LOG_FORMAT = "%(asctime)s %(name)s %(levelname)s %(message)s"
#: the top loggers of chunkline's packages (``chunkline.*`` by name, ``server.*`` and ``engine.*`` by module)
OWN_LOGGERS = ("chunkline", "server", "engine")


def log_to_stderr() -> None:
    """A command's logging: INFO and up on stderr; LiveKit's SDK only at ERROR (its INFO is per-packet chatter)."""
    logging.basicConfig(level=logging.INFO, format=LOG_FORMAT)
    logging.getLogger("livekit").setLevel(logging.ERROR)


def log_under_hypercorn() -> None:
    """chunkline's INFO lines on stderr, as the commands print them, unless the root logger was configured.

    Only chunkline's own loggers get the handler (and stop propagating, so that the last-resort handler does not
    print their warnings twice): hypercorn's loggers propagate to the root, and a root handler would print each of
    their lines a second time."""
    if logging.getLogger().handlers:
        return
    handler = logging.StreamHandler()
    handler.setFormatter(logging.Formatter(LOG_FORMAT))
    for name in OWN_LOGGERS:
        logger = logging.getLogger(name)
        if not logger.handlers:
            logger.addHandler(handler)
            logger.setLevel(logging.INFO)
            logger.propagate = False
    logging.getLogger("livekit").setLevel(logging.ERROR)
