"""Requests the daemon refuses: one exception that the socket API turns into its JSON error, and the
Retry-After header of a refusal that may pass by itself (every front end's).

Raised in the supervisor's event-loop thread (by the API's handlers and the scheduler's
admission checks) and caught by the API's error middleware; nothing here blocks.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, TypeVar

from omnid.vocabulary import ErrorCode

STORAGE_RETRY_AFTER_S = 10     # what a 507 (the disk is full) suggests to wait: rm, retention or an operator frees it
RETRY_AFTER_S = 2      # what 429 and 503 answers suggest to wait before trying again (507: STORAGE_RETRY_AFTER_S)


def retry_after(status: int, seconds: Any = None) -> dict[str, str]:
    """The Retry-After header of a refusal that may pass by itself (429, 503, 507); `seconds`: the
    refusal's own figure (a real-time pipeline's: when its first stream should end)."""
    if isinstance(seconds, int) and not isinstance(seconds, bool) and status in (429, 503, 507):
        return {"Retry-After": str(seconds)}
    if status == 507:
        return {"Retry-After": str(STORAGE_RETRY_AFTER_S)}
    return {"Retry-After": str(RETRY_AFTER_S)} if status in (429, 503) else {}


class Refused(Exception):
    """A request the daemon will not take: `{"error": {"code", "message", **extra}}` with `status`."""

    def __init__(self, status: int, code: ErrorCode, message: str, **extra: Any) -> None:
        super().__init__(message)
        self.status, self.code, self.message, self.extra = status, code, message, extra
        self.parts: list[Refused] = []          # a refusal of several problems (`Problems`): each one


T = TypeVar("T")


class Problems:
    """The refusals of one request, gathered so that its answer says every one at once: the first's
    status, code and fields, the messages joined by "; ", and each as `problems[]` when there are several."""

    def __init__(self) -> None:
        self.found: list[Refused] = []

    def add(self, refused: Refused) -> None:
        self.found += refused.parts or [refused]    # (a part's own gathered answer: its problems, one by one)

    def of(self, check: Callable[..., T], *args: Any) -> T | None:
        """What `check(*args)` gives; None, its refusal kept, when it refuses."""
        try:
            return check(*args)
        except Refused as e:
            self.add(e)
            return None

    def check(self) -> None:
        """Refused with every problem found, if any."""
        if len(self.found) == 1:
            raise self.found[0]
        if self.found:
            first = self.found[0]
            gathered = Refused(first.status, first.code, "; ".join(dict.fromkeys(r.message for r in self.found)),
                               **first.extra, problems=[{"code": str(r.code), "message": r.message, **r.extra}
                                                        for r in self.found])
            gathered.parts = self.found
            raise gathered
