"""An admitted request, whole: what a front end hands the scheduler to make a job of.

Admission (`omnid.supervisor.http.admission`) builds one `Submission` per request, with its pipeline
resolved there, once: the scheduler takes the definition it carries (and the key the workers know
it by, `PipelineConfig.key`) and never looks the pipeline up by name again. A plain value; made and
read in the supervisor's event-loop thread.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from omnid.config_types import PipelineConfig


@dataclass(frozen=True)
class Submission:
    """A request that passed admission."""

    pipeline: PipelineConfig                # resolved at the door, in the config then in force
    inputs: dict[str, Any]                  # decoded: files as bytes
    params: dict[str, dict[str, Any]]       # per stage, each checked by its engine's rules
    summary: dict[str, Any]                 # the inputs as the job document shows them
    owner_uid: int                          # whose job it is (the caller's uid; a key's, on the TCP listener)
    timeout_s: float | None = None          # None: the pipeline's, else the daemon's default
    trace: dict[str, str] | None = None     # the caller's W3C trace context (traceparent, tracestate), if any
    received_at: float | None = None        # when the request came (the trace's `admission` span starts there)
    priority: int = 0                       # lower runs earlier (omnid/fair_queue.py), within the owner's max_priority
    key: str | None = None                  # the API key it came with (TCP): the owner fair share counts
    weight: float = 1.0                     # the owner's share within a priority level
    max_queued: int | None = None           # the owner's bound on its queued jobs

    @property
    def owner(self) -> str:
        """Who fair share counts: the key, else the uid."""
        return f"key:{self.key}" if self.key else f"uid:{self.owner_uid}"
