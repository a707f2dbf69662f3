"""Feeders: the threads that deliver jobs' own inputs to the first stages of their pipelines.

Runs in the supervisor process, one thread per replica of a source stage (`feeder-STAGE.N`). A feeder blocks on
the stage's data-plane watermark (`dataplane.sender.Sender.send`) so that the event loop never does; the
event loop only pushes items (`push`, non-blocking) and reads `is_live` through a callable that
looks a job id up in a dict (safe from another thread: a single dict lookup).
"""

from __future__ import annotations

import threading
from collections import deque
from collections.abc import Callable, Sequence

from omnid.dataplane.sender import Sender
from omnid.dataplane.wire import WorkItem


class Feeder:
    """A thread that delivers jobs' inputs to one first stage's replica, in FIFO order.

    `address_of(job)`: where the job's input goes, asked again at every attempt (a job whose replica
    was given up while it waited here is moved to another one)."""

    def __init__(self, address: str, sender: Sender, is_live: Callable[[str], bool],
                 address_of: Callable[[str], str]) -> None:
        self.address = address              # the replica this feeder's jobs were given (its thread's name)
        self._sender = sender
        self._is_live = is_live
        self._address_of = address_of
        self._items: deque[WorkItem] = deque()
        self._cv = threading.Condition()
        self._stop = False
        self._thread = threading.Thread(target=self._run, name=f"feeder-{address}", daemon=True)
        self._thread.start()

    def push(self, items: Sequence[WorkItem], front: bool = False) -> None:
        """Queue items in their order; `front`: ahead of the others (resends after a restart keep
        their place in line). One lock for all of them: the thread never sees half of a batch."""
        with self._cv:
            if front:
                self._items.extendleft(reversed(items))
            else:
                self._items.extend(items)
            self._cv.notify()

    def stop(self) -> None:
        with self._cv:
            self._stop = True
            self._cv.notify()

    def _run(self) -> None:
        while True:
            with self._cv:
                while not self._items and not self._stop:
                    if not self._cv.wait(timeout=1.0):
                        self._sender.prune()    # idle: let go of a dead stage's pool
                if self._stop:
                    self._sender.close()
                    return
                item = self._items.popleft()
            if not self._is_live(item.job):
                continue
            self._sender.send(lambda: self._address_of(item.job), item,
                              abandon=lambda: self._stop or not self._is_live(item.job))
