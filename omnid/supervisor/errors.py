"""Requests the daemon refuses: one exception that the socket API turns into its JSON error.

Raised in the supervisor's event-loop thread (by the API's handlers and the scheduler's
admission checks) and caught by the API's error middleware; nothing here blocks.
"""

from __future__ import annotations

from typing import Any

from omnid.vocabulary import ErrorCode


STORAGE_RETRY_AFTER_S = 10     # what a 507 (the disk is full) suggests to wait: rm, retention or an operator frees it


class Refused(Exception):
    """A request the daemon will not take: `{"error": {"code", "message", **extra}}` with `status`."""

    def __init__(self, status: int, code: ErrorCode, message: str, **extra: Any) -> None:
        super().__init__(message)
        self.status, self.code, self.message, self.extra = status, code, message, extra
