"""A live job inside the supervisor: its record, its event stream, and run-time bookkeeping.

Runs in the supervisor's event-loop thread only. Emitting an event appends one row to the job
store (a short sqlite write) and puts the event on each subscriber's asyncio queue (never blocks).
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable
from typing import TYPE_CHECKING, Any, cast

from typing_extensions import Unpack

from omnid.config import PipelineConfig
from omnid.store import JobStore
from omnid.vocabulary import Event, EventFields, EventType, JobRecord, StageRun

if TYPE_CHECKING:
    from omnid.supervisor.jobs.tracing import JobTrace

# What a subscriber receives: an event; None once the stream is over; LAGGED when it fell more
# than SUBSCRIBER_BACKLOG events behind (its queue was dropped: it reads the rest from the store).
# (a mark, matched by identity and never sent: not one of the EventTypes)
LAGGED = cast(Event, {"type": "lagged"})
SUBSCRIBER_BACKLOG = 1000
EventQueue = asyncio.Queue[Event | None]


def _offer(q: EventQueue, event: Event | None) -> bool:
    """Queue for a subscriber without ever waiting or growing past its bound; False: it lagged."""
    try:
        q.put_nowait(event)
        return True
    except asyncio.QueueFull:
        while not q.empty():                # it will read what it missed from the store
            q.get_nowait()
        q.put_nowait(LAGGED)
        return False


class EventStream:
    """One job's events: numbered, stored, and fanned out to the live subscribers.

    A subscriber that does not keep up (a client that stopped reading) never slows the job nor
    grows the supervisor's memory: past SUBSCRIBER_BACKLOG events its queue is dropped for a
    LAGGED mark, and it catches up from the store (`Scheduler.subscribe(after=...)`).
    """

    def __init__(self, job_id: str, store: JobStore, seq: int = 0) -> None:
        self.job_id = job_id
        self._store = store
        self._seq = seq                     # events so far (a job restored after a restart has some)
        self._subscribers: set[EventQueue] = set()
        self.observer: Callable[[Event], None] | None = None   # the job's trace (tracing on)

    def emit(self, type_: EventType, **fields: Unpack[EventFields]) -> None:
        """One event (`vocabulary.Event`: what each type says, `EventFields`) to the store and the subscribers."""
        event: Event = {"type": type_, "job": self.job_id, "ts": time.time(), **fields}
        self._seq += 1
        self._store.append_event(self.job_id, self._seq, event)
        if self.observer is not None:
            try:
                self.observer(event)
            except Exception:               # a trace never costs a job anything
                self.observer = None
        for q in list(self._subscribers):
            if not _offer(q, event):
                self._subscribers.discard(q)

    def subscribe(self) -> EventQueue:
        q: EventQueue = asyncio.Queue(maxsize=SUBSCRIBER_BACKLOG + 1)
        self._subscribers.add(q)
        return q

    def unsubscribe(self, q: EventQueue) -> None:
        self._subscribers.discard(q)

    def close(self) -> None:
        """The job is over: end every subscriber's stream."""
        for q in self._subscribers:
            _offer(q, None)
        self._subscribers.clear()


class LiveJob:
    """A job that is queued or running: what the API shows (`record`) plus what only the scheduler needs."""

    def __init__(self, record: JobRecord, pipeline: PipelineConfig, inputs: dict[str, Any],
                 store: JobStore, events: int = 0) -> None:
        self.record = record
        self.pipeline = pipeline
        self.inputs = inputs                    # decoded (file inputs as bytes); the record keeps a summary
        self.events = EventStream(record.id, store, events)
        self.timer: asyncio.TimerHandle | None = None
        self.delivered: set[tuple[str, str]] = set()    # (src, dst) hand-offs the downstream admitted
        self.attempts = 0                       # retries used (pipeline `retries`)
        self.key = pipeline.key or pipeline.name    # the definition's key the workers know it by (`name~N`
                                                    # after a reload changed the pipeline)
        self.streamed = False                   # a window of it reached a downstream stage
        self.first_output_segment: float | None = None  # when a last stage's first segment came
        # Its audio, as a player would hear it (a last stage's WAV segments): when the first came, how
        # much came, when what came so far ends playing, and the packets that came after that.
        self.first_audio: float | None = None
        self.audio_s = 0.0
        self.audio_plays_until = 0.0
        self.underruns = 0
        # Its place in every stage's queue (omnid/fair_queue.py): (priority, fair-share tag, admission
        # order), given at admission (or a restart's restore); `since`: when it began to wait, per stage.
        self.rank: tuple[int, float, int] = (record.priority, 0.0, 0)
        self.since: dict[str, float] = {}
        self.trace: JobTrace | None = None      # its spans (`[daemon] tracing`)
        self.admitted_at: dict[str, float] = {}         # stage -> when its input first entered the stage's queue
        self.first_segment_at: dict[str, float] = {}    # stage -> when it streamed its first segment

    @property
    def id(self) -> str:
        return self.record.id

    def stage(self, name: str) -> StageRun:
        return self.record.stages[name]

    def route(self, stage: str) -> int:
        """The replica of `stage` that serves this job."""
        run = self.record.stages.get(stage)
        return run.replica or 0 if run is not None else 0

    @property
    def routes(self) -> dict[str, int]:
        """stage -> replica, for every stage of the job (what its work items carry)."""
        return {name: run.replica or 0 for name, run in self.record.stages.items()}
