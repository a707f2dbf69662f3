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
