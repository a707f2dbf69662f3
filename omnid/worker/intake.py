"""A stage worker's input side: the items the data plane brings, admitted into its input queue.

`admit` runs in the data plane's connection threads (`dataplane.listener.Listener`, or a Ray actor's `admit`
calls); `take` in the worker's main thread. A plain item blocks its sender at the queue's
watermark (`queue_capacity`); a streamed job's windows never block: the first takes a place in the
queue like any input, the later ones go straight to the job's `EdgeStream`, which has its own bound.
What each job's parts left here (`received`, `streams`) is in its `WorkerJob`, under the table's lock.
"""

from __future__ import annotations

import queue
import threading
from collections.abc import Callable

from omnid import protocol as P
from omnid.config import PipelineConfig
from omnid.dataplane.wire import Closing, WorkItem
from omnid.fair_queue import RankedQueue
from omnid.worker.jobs import JobTable
from omnid.worker.windows import EdgeStream


class Intake:
    """The input queue, its counts, and the admission of each item into it. The queue is taken
    in rank order (`omnid.fair_queue.RankedQueue`), not in arrival order.

    `send` tells the supervisor at once (`Admitted`); `wakeup` wakes the busy loop; `pipeline` finds
    a job's pipeline by its key (it may wait for a reload), for a streamed job's first window, which
    keeps it on its `WorkerJob`."""

    def __init__(self, stage: str, capacity: int, jobs: JobTable, send: Callable[[object], None],
                 wakeup: threading.Event, shutting_down: threading.Event,
                 pipeline: Callable[[str], PipelineConfig], max_wait_s: Callable[[], float] = lambda: 0.0) -> None:
        self.stage = stage
        self.capacity = capacity
        self.jobs = jobs
        self.send = send
        self.wakeup = wakeup
        self.shutting_down = shutting_down
        self.pipeline = pipeline
        # Taken by rank (priority, fair share between owners), with a bound on waiting (omnid/fair_queue.py):
        # a job that comes later with a higher priority goes ahead of those admitted before it.
        self.queue: RankedQueue[WorkItem] = RankedQueue(capacity, lambda item: item.rank,
                                                        lambda item: item.since, max_wait_s)
        # Counts for the heartbeat's `QueueStats` (each written by one kind of thread, read by any).
        self.enqueued = self.dequeued = self.dropped = 0

    def take(self, wait: bool) -> WorkItem | None:
        """The next item (main thread), waiting briefly for one when `wait`; None when there is none."""
        try:
            item = self.queue.get(timeout=0.05) if wait else self.queue.get_nowait()
        except queue.Empty:
            return None
        self.dequeued += 1
        return item

    def admit(self, item: WorkItem) -> bool | None:
        """Data-plane callback (a data-conn thread): queue the item, blocking at the watermark.

        A window of a streamed job never blocks (`_admit_window`).
        """
        if item.window is not None:
            return self._admit_window(item)
        ticket: int | None = None       # in the queue (seen by `take`), waiting for a place
        while True:
            if self.shutting_down.is_set():
                if ticket is None or self.queue.withdraw(ticket):
                    raise Closing()     # not admitted, not dropped: the sender tries our successor
                break                   # taken already: it is ours
            if self.jobs.is_dead(item.job):
                if ticket is None or self.queue.withdraw(ticket):
                    self.dropped += 1
                    return False
                break
            if ticket is None:
                with self.jobs.lock:
                    job = self.jobs.get(item.job)
                    if job is not None and item.src in job.received:
                        return True            # a resend of a part we hold already: admitted once
                # In at once, in rank order: a more urgent job waiting here for a place is taken
                # before the less urgent ones admitted earlier; the sender waits for the place.
                ticket = self.queue.offer(item)
                self.wakeup.set()
            if self.queue.admitted(ticket, timeout=0.1):
                break
        with self.jobs.lock:
            if self.jobs.is_dead(item.job):     # cancelled while we waited for room: it is dropped
                return False                    # when dequeued; keep no state for it
            self.jobs.entry(item.job).received.add(item.src)
        self.enqueued += 1
        self.send(P.Admitted(job=item.job, src=item.src, depth=self.queue.qsize()))
        self.wakeup.set()
        return True

    def _admit_window(self, item: WorkItem) -> bool | None:
        """A window of a streamed job (a data-conn thread); answers at once, None when there is no room.

        The first window starts the job here: it takes a place in the input queue, like any input.
        The later ones go straight to the job's stream, whose own bound is `queue_capacity` windows.
        """
        if self.shutting_down.is_set():
            raise Closing()
        index = item.window or 0
        # The job's pipeline, resolved once, with its first window (may wait for a reload: not under the lock)
        pipeline = self.pipeline(item.pipeline) if index == 0 else None
        keys = self.stream_keys(item, pipeline) if pipeline is not None else []
        with self.jobs.lock:
            if self.jobs.is_dead(item.job):
                self.dropped += 1
                return False
            job = self.jobs.get(item.job)
            stream = job.streams.get(item.src) if job is not None else None
            if stream is None:
                if index != 0:
                    return None                     # cannot happen: windows come in order
                name = item.job
                stream = EdgeStream(keys, self.capacity, is_cancelled=lambda: self.jobs.is_dead(name))
                stream.put(0, item.inputs, item.last)
                try:
                    self.queue.put_nowait(item)
                except queue.Full:
                    return None
                job = self.jobs.entry(item.job)
                job.pipeline = job.pipeline or pipeline
                job.streams[item.src] = stream
                job.received.add(item.src)
                first = True
            else:
                admitted = stream.put(index, item.inputs, item.last)
                first = False
        if first:
            self.enqueued += 1
            self.send(P.Admitted(job=item.job, src=item.src, depth=self.queue.qsize()))
        else:
            if not admitted:
                return admitted
        self.wakeup.set()
        return True

    def stream_keys(self, item: WorkItem, pipeline: PipelineConfig) -> list[str]:
        """The inputs a streaming edge of `pipeline` feeds: its `map`'s names, else what the first
        window (`item`) holds."""
        for edge in pipeline.incoming(self.stage):
            if edge.src == item.src and edge.map is not None:
                return list(edge.map)
        return list(item.inputs)
