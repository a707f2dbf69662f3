"""structlog set-up, shared by the supervisor and the stage workers.

Logs go to stderr (journald picks them up under systemd); `console` renders
for people, `json` for log shippers. Called once per process, at start.
"""

from __future__ import annotations

import logging
import sys

import structlog

_LEVELS = {"debug": logging.DEBUG, "info": logging.INFO, "warning": logging.WARNING, "error": logging.ERROR}


def configure(level: str = "info", fmt: str = "console", process: str = "supervisor") -> None:
    lvl = _LEVELS.get(level, logging.INFO)
    logging.basicConfig(stream=sys.stderr, level=max(lvl, logging.WARNING), format="%(name)s: %(message)s")
    renderer = structlog.processors.JSONRenderer() if fmt == "json" else \
        structlog.dev.ConsoleRenderer(colors=False)
    structlog.configure(
        processors=[
            structlog.contextvars.merge_contextvars,
            structlog.processors.add_log_level,
            structlog.processors.TimeStamper(fmt="iso", utc=False),
            lambda _, __, ev: {**ev, "process": process},
            renderer,
        ],
        wrapper_class=structlog.make_filtering_bound_logger(lvl),
        logger_factory=structlog.PrintLoggerFactory(file=sys.stderr),
        cache_logger_on_first_use=True,
    )
