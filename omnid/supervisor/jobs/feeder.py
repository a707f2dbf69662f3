"""Feeders: the threads that deliver jobs' own inputs to the first stages of their pipelines.

Runs in the supervisor process, one thread per replica of a source stage (`feeder-STAGE.N`). A feeder blocks on
the stage's data-plane watermark (`dataplane.sender.Sender.send`) so that the event loop never does; the
event loop only pushes items (`push`, non-blocking) and reads `is_live` through a callable that
looks a job id up in a dict (safe from another thread: a single dict lookup).
"""

from __future__ import annotations

import queue
import threading
from collections.abc import Callable, Sequence

from omnid.dataplane.sender import Sender
from omnid.dataplane.wire import WorkItem
from omnid.fair_queue import RankedQueue


class Feeder:
    """A thread that delivers jobs' inputs to one first stage's replica, in their ranks' order
    (priority, fair share between owners, the bound on waiting: omnid/fair_queue.py).

    `address_of(job)`: where the job's input goes, asked again at every attempt (a job whose replica
    was given up while it waited here is moved to another one)."""

    def __init__(self, address: str, sender: Sender, is_live: Callable[[str], bool],
                 address_of: Callable[[str], str], max_wait_s: Callable[[], float] = lambda: 0.0) -> None:
        self.address = address              # the replica this feeder's jobs were given (its thread's name)
        self._sender = sender
        self._is_live = is_live
        self._address_of = address_of
        self._items: RankedQueue[WorkItem] = RankedQueue(0, lambda item: item.rank, lambda item: item.since,
                                                         max_wait_s)
        self._stop = False
        self._thread = threading.Thread(target=self._run, name=f"feeder-{address}", daemon=True)
        self._thread.start()

    def push(self, items: Sequence[WorkItem], front: bool = False) -> None:
        """Queue items; each goes by its rank (a resend after a restart keeps its rank and its wait,
        so its place in line: `front` is kept for the callers, the rank decides)."""
        self._items.offer_all(items)         # (unbounded: each has its place at once)

    def stop(self) -> None:
        self._stop = True
        self._items.offer(_STOP)

    def waiting(self) -> list[WorkItem]:
        """The items not sent yet, in the order they would go now."""
        return [i for i in self._items.snapshot() if i is not _STOP]

    def _run(self) -> None:
        while True:
            try:
                item = self._items.get(timeout=1.0)
            except queue.Empty:
                self._sender.prune()            # idle: let go of a dead stage's pool
                continue
            if self._stop:
                self._sender.close()
                return
            if not self._is_live(item.job):
                continue
            self._sender.send(lambda: self._address_of(item.job), item,
                              abandon=lambda: self._stop or not self._is_live(item.job))


_STOP = WorkItem(job="", pipeline="", src=None, inputs={}, rank=(-(1 << 62), 0.0, 0))   # wakes the thread to stop
