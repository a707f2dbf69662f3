"""`http_common.follow_batches`, in-process: what a job's event readers get, and in what lists.

A fake scheduler hands out the past and a queue, as `Scheduler.subscribe` does; a fake request
stands for the caller (its transport closing = a hang-up). What arrived at once must come as one
list (one write per stream), every event exactly once, and the end, a hang-up and a lag as the
one-at-a-time `follow` had them.
"""

from __future__ import annotations

import asyncio
from contextlib import aclosing
from typing import Any

import pytest

from omnid.supervisor.http.http_common import follow, follow_batches
from omnid.supervisor.jobs.live_job import LAGGED


class _Transport:
    def __init__(self) -> None:
        self.closing = False

    def is_closing(self) -> bool:
        return self.closing


class _Request:
    def __init__(self) -> None:
        self.transport = _Transport()


class _Scheduler:
    """`subscribe(job, after)`: the stored events past `after` and a live queue (None when ended)."""

    def __init__(self, stored: list[dict[str, Any]], live: bool = True) -> None:
        self.stored = stored
        self.live = live
        self.queues: list[asyncio.Queue[Any]] = []
        self.unsubscribed = 0

    def subscribe(self, job: str, after: int = 0) -> tuple[list[dict[str, Any]], asyncio.Queue[Any] | None]:
        if not self.live:
            return self.stored[after:], None
        q: asyncio.Queue[Any] = asyncio.Queue()
        self.queues.append(q)
        return self.stored[after:], q

    def unsubscribe(self, job: str, q: asyncio.Queue[Any]) -> None:
        self.unsubscribed += 1


def ev(i: int) -> dict[str, Any]:
    return {"type": "segment", "index": i, "text": f"t{i}"}


async def _collect(sched: _Scheduler, request: _Request, feed: Any = None) -> list[list[dict[str, Any]]]:
    got: list[list[dict[str, Any]]] = []
    async with aclosing(follow_batches(request, sched, "j")) as batches:   # type: ignore[arg-type]
        async for batch in batches:
            got.append(batch)
            if feed is not None:
                feed(len(got))
    return got


def test_the_past_is_one_list_and_what_is_queued_at_once_the_next() -> None:
    async def main() -> list[list[dict[str, Any]]]:
        sched = _Scheduler([ev(0), ev(1)])
        request = _Request()

        def feed(n: int) -> None:
            q = sched.queues[0]
            if n == 1:                  # a step's tokens of three streams' worth, all at once
                for i in (2, 3, 4):
                    q.put_nowait(ev(i))
            elif n == 2:
                q.put_nowait(ev(5))
                q.put_nowait(None)      # the job ended
        return await _collect(sched, request, feed)

    got = asyncio.run(main())
    assert [[e["index"] for e in b] for b in got] == [[0, 1], [2, 3, 4], [5]]


def test_an_ended_job_is_its_stored_events_once() -> None:
    got = asyncio.run(_collect(_Scheduler([ev(0), ev(1), ev(2)], live=False), _Request()))
    assert [[e["index"] for e in b] for b in got] == [[0, 1, 2]]


def test_a_lagged_reader_catches_up_from_the_store_without_repeats() -> None:
    async def main() -> list[list[dict[str, Any]]]:
        sched = _Scheduler([ev(0)])

        def feed(n: int) -> None:
            if n == 1:
                sched.queues[0].put_nowait(ev(1))
                sched.queues[0].put_nowait(LAGGED)          # its queue overflowed after event 1
                sched.stored.extend([ev(1), ev(2), ev(3)])  # the store has everything
            elif n == 3:
                sched.queues[1].put_nowait(None)
        return await _collect(sched, _Request(), feed)

    got = asyncio.run(main())
    assert [e["index"] for b in got for e in b] == [0, 1, 2, 3]


def test_a_hang_up_raises_and_unsubscribes() -> None:
    async def main() -> _Scheduler:
        sched = _Scheduler([])
        request = _Request()
        task = asyncio.ensure_future(_collect(sched, request))
        await asyncio.sleep(0.01)
        request.transport.closing = True
        sched.queues[0].put_nowait(ev(0))            # the next wake-up finds the caller gone
        with pytest.raises(ConnectionResetError):
            await task
        return sched

    sched = asyncio.run(main())
    assert sched.unsubscribed == 1


def test_follow_gives_the_same_events_one_at_a_time() -> None:
    async def main() -> list[dict[str, Any]]:
        sched = _Scheduler([ev(0), ev(1)])
        out = []
        async with aclosing(follow(_Request(), sched, "j")) as events:   # type: ignore[arg-type]
            async for e in events:
                out.append(e)
                if len(out) == 2:
                    for i in (2, 3):
                        sched.queues[0].put_nowait(ev(i))
                    sched.queues[0].put_nowait(None)
        return out

    assert [e["index"] for e in asyncio.run(main())] == [0, 1, 2, 3]
