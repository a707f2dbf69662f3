"""Who goes first: the order every stage queue takes its jobs in (priority, fair share, a bound on waiting).

Standard library only: the supervisor's feeders (supervisor/jobs/feeder.py) and every worker's input
queue (worker/intake.py) order their items with `RankedQueue`, and the supervisor's `FairShare`
gives each job its rank once, when it is admitted, so that every queue of every stage agrees.

A job's rank is `(priority, tag, seq)`, smallest first:

- `priority`: an integer, lower runs earlier, 0 by default (as in vLLM). Levels are strict.
- `tag`: fair share within a level, start-time fair queuing with one virtual clock per level. Each
  owner (an API key, else a uid) has a weight `w`; its next job's tag is
  `max(clock, the owner's last tag) + 1 / w`. The level's clock is the largest tag that has started
  running. So owners backlogged together are served in proportion to their weights, and an owner
  that comes with one job is next after about one job per owner already waiting (its tag starts at
  the clock, not behind the 500 jobs another owner queued). With fair share off the tag is 0: FIFO.
- `seq`: the order of admission (ties).

The bound on waiting (`max_wait_s`): a job that has waited that long in a queue goes ahead of
every job that has not, the longest-waiting first. So no job starves: under a steady stream of
more urgent jobs, a job is taken at most `max_wait_s` after it reached the queue, plus the time
the jobs already overdue ahead of it take (those that reached the queue before it).
`take_key` is that rule as a sort key: `GET /v1/jobs/{id}` sorts a stage's waiting jobs by it to
say where a job is.
"""

from __future__ import annotations

import heapq
import itertools
import queue
import threading
import time
from collections import deque
from collections.abc import Callable, Iterable
from typing import Generic, TypeVar

Rank = tuple[int, float, int]           # (priority, fair-share tag, admission order)
PRIORITY_LIMIT = 1_000_000              # a job's priority: from -PRIORITY_LIMIT to PRIORITY_LIMIT

T = TypeVar("T")


def take_key(rank: Rank, since: float, now: float, max_wait_s: float) -> tuple[int, float, Rank]:
    """The order a queue takes its items in: the overdue ones (waited `max_wait_s` or more) first,
    the longest waiting first; then the others by rank."""
    if max_wait_s > 0 and now - since >= max_wait_s:
        return (0, since, rank)
    return (1, 0.0, rank)     # pragma: no mutate (equivalent: any constants after the overdue's 0 keep the order)


class FairShare:
    """The supervisor's ranks (event-loop thread only): one virtual clock per priority level, and
    each owner's last tag there. See the module docstring."""

    def __init__(self) -> None:
        self._clock: dict[int, float] = {}
        self._last: dict[tuple[int, str], float] = {}
        self._seq = itertools.count(1)

    def rank(self, priority: int, owner: str, weight: float, fair: bool = True) -> Rank:
        seq = next(self._seq)
        if not fair:
            return (priority, 0.0, seq)
        clock = self._clock.get(priority, 0.0)
        tag = max(clock, self._last.get((priority, owner), 0.0)) + 1.0 / max(weight, 1e-6)
        self._last[(priority, owner)] = tag
        if len(self._last) > 4096:          # owners at or behind the clock start from it anyway
            self._last = {k: v for k, v in self._last.items() if v > self._clock.get(k[0], 0.0)}
        return (priority, tag, seq)

    def started(self, rank: Rank) -> None:
        """A job of this rank started running somewhere: its level's clock moves up to its tag."""
        priority, tag = rank[0], rank[1]
        if tag > self._clock.get(priority, 0.0):
            self._clock[priority] = tag


class RankedQueue(Generic[T]):
    """A thread-safe queue taken by `take_key` (rank, and the bound on waiting), bounded when
    `maxsize` > 0. Its interface is `queue.Queue`'s that the worker uses: `put` (blocking with a
    timeout, else `queue.Full`), `put_nowait`, `get` / `get_nowait` (`queue.Empty`), `qsize`.

    The bound is on admissions, not on presence: `offer` puts an item in at once, where `get` sees
    it in rank order, and `admitted` says when it has a place among the `maxsize` (or was taken).
    A data-plane sender blocked at the watermark thus still has its item looked at: the worker takes
    a more urgent job that waits for room before the less urgent ones admitted earlier. (Each
    sender has one item waiting at most; the item is in this process's memory already.)

    `rank_of(item)` and `since_of(item)` (the wall-clock time it began to wait) are read once, at `offer`.
    """

    def __init__(self, maxsize: int, rank_of: Callable[[T], Rank], since_of: Callable[[T], float],
                 max_wait_s: Callable[[], float]) -> None:
        self.maxsize = maxsize
        self._rank_of = rank_of
        self._since_of = since_of
        self._max_wait_s = max_wait_s
        self._by_rank: list[tuple[Rank, int]] = []
        self._by_age: list[tuple[float, int]] = []
        self._items: dict[int, T] = {}
        self._placed: set[int] = set()      # admitted (within maxsize), not taken yet
        self._waiting: deque[int] = deque()  # in, but waiting for a place (their senders wait)
        self._count = itertools.count()
        self._cv = threading.Condition()

    def qsize(self) -> int:
        """The items admitted (within the bound) and not taken."""
        with self._cv:
            return len(self._placed)

    def _full(self) -> bool:
        return self.maxsize > 0 and len(self._placed) >= self.maxsize

    def offer(self, item: T) -> int:
        """Put the item in now (`get` sees it); its ticket, for `admitted` and `withdraw`."""
        return self.offer_all([item])[0]

    def offer_all(self, batch: Iterable[T]) -> list[int]:
        """`offer` each item, under one lock: a taker never sees half of the batch."""
        with self._cv:
            tickets = [self._offer(item) for item in batch]
            self._cv.notify_all()
            return tickets

    def _offer(self, item: T) -> int:
        """(The lock held.)"""
        n = next(self._count)
        since = self._since_of(item) or time.time()
        self._items[n] = item
        heapq.heappush(self._by_rank, (self._rank_of(item), n))
        heapq.heappush(self._by_age, (since, n))
        if self._full() or self._waiting:
            self._waiting.append(n)
        else:
            self._placed.add(n)
        return n

    def admitted(self, ticket: int, timeout: float | None = None) -> bool:
        """Wait up to `timeout` for the item to have a place (or to be taken already)."""
        with self._cv:
            return self._cv.wait_for(lambda: ticket not in self._items or ticket in self._placed, timeout)

    def withdraw(self, ticket: int) -> bool:
        """Take the item out again (its sender gave up); False when it was taken already."""
        with self._cv:
            if self._items.pop(ticket, None) is None:
                return False
            self._placed.discard(ticket)
            if ticket in self._waiting:
                self._waiting.remove(ticket)
            self._promote()
            self._cv.notify_all()
            return True

    def put(self, item: T, block: bool = True, timeout: float | None = None) -> None:
        if not block:
            with self._cv:
                if self._full():
                    raise queue.Full
        ticket = self.offer(item)
        if not self.admitted(ticket, timeout if block else 0) and self.withdraw(ticket):
            raise queue.Full

    def put_nowait(self, item: T) -> None:
        self.put(item, block=False)

    def get(self, block: bool = True, timeout: float | None = None) -> T:
        with self._cv:
            if not self._items:
                if not block or not self._cv.wait_for(lambda: bool(self._items), timeout):
                    raise queue.Empty
            item = self._pop()
            self._cv.notify_all()
            return item

    def get_nowait(self) -> T:
        return self.get(block=False)

    def _promote(self) -> None:
        """Places freed: the items waiting for one get them, in the order they came."""
        while self._waiting and not self._full():
            self._placed.add(self._waiting.popleft())

    def _pop(self) -> T:
        """The next item (the lock held, the queue not empty)."""
        ages, ranks, items = self._by_age, self._by_rank, self._items
        while ages[0][1] not in items:
            heapq.heappop(ages)
        while ranks[0][1] not in items:
            heapq.heappop(ranks)
        wait = self._max_wait_s()
        if wait > 0 and time.time() - ages[0][0] >= wait:
            n = heapq.heappop(ages)[1]
        else:
            n = heapq.heappop(ranks)[1]
        if n in self._placed:
            self._placed.discard(n)
        else:
            self._waiting.remove(n)
        self._promote()
        return items.pop(n)

    def snapshot(self) -> list[T]:
        """The items, in the order they would be taken now (for tests and reports)."""
        with self._cv:
            now, wait = time.time(), self._max_wait_s()
            since = {n: s for s, n in self._by_age if n in self._items}
            rank = {n: r for r, n in self._by_rank if n in self._items}
            order = sorted(self._items, key=lambda n: take_key(rank[n], since[n], now, wait))
            return [self._items[n] for n in order]


def positions(waiting: Iterable[tuple[str, Rank, float]], now: float, max_wait_s: float) -> list[str]:
    """Job ids in the order a queue would take them: `waiting` holds (job, rank, since)."""
    return [job for job, _r, _s in sorted(waiting, key=lambda w: take_key(w[1], w[2], now, max_wait_s))]
