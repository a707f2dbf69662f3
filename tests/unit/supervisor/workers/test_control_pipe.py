"""Unit tests of `ControlPipe` with a real `multiprocessing.Pipe` and a real asyncio event loop.

Runs in the pytest process's main thread, in-process: each test runs its own event loop
(`asyncio.run`), the pipe's far end is read or written from the same thread or from a helper
thread. Waits are bounded: `wait_until` gives up after a few seconds.
"""

from __future__ import annotations

import asyncio
import multiprocessing
import threading
import time
from collections.abc import Callable
from multiprocessing.connection import Connection

from omnid import protocol as P
from omnid.supervisor.workers.control_pipe import ControlPipe


async def wait_until(cond: Callable[[], bool], timeout: float = 5.0) -> None:
    deadline = time.monotonic() + timeout
    while not cond():
        assert time.monotonic() < deadline, "timed out"
        await asyncio.sleep(0.005)


def pipe_pair() -> tuple[Connection, Connection]:
    ours, theirs = multiprocessing.get_context("spawn").Pipe(duplex=True)
    return ours, theirs


def test_messages_arrive_in_order() -> None:
    async def main() -> None:
        ours, theirs = pipe_pair()
        got: list[object] = []
        pipe = ControlPipe(ours, got.append)
        sent = [P.Started(f"job{i}") for i in range(200)] + [P.Finished("job0", 1.5)]
        for msg in sent:
            theirs.send(msg)
        await wait_until(lambda: len(got) == len(sent))
        assert got == sent
        assert not pipe.closed
        pipe.close()
        theirs.close()

    asyncio.run(main())


def test_sends_reach_the_worker_in_order() -> None:
    async def main() -> None:
        ours, theirs = pipe_pair()
        pipe = ControlPipe(ours, lambda msg: None)
        msgs = [P.Cancel("job1"), P.Forget("job1"), P.Resend("j", "dst"), P.Shutdown()]
        for msg in msgs:
            assert pipe.send(msg) is True
        assert pipe.queued == 0
        assert [theirs.recv() for _ in msgs] == msgs
        pipe.close()
        theirs.close()

    asyncio.run(main())


def test_send_never_blocks_when_the_worker_does_not_read() -> None:
    async def main() -> None:
        ours, theirs = pipe_pair()
        pipe = ControlPipe(ours, lambda msg: None)
        sent: list[P.Cancel] = []
        slowest = 0.0
        # Fill the pipe: the worker is "frozen" (reads nothing). Each send must return at once.
        while pipe.queued < 50:
            msg = P.Cancel(f"job{len(sent)}", reason="x" * 1000)
            t = time.monotonic()
            assert pipe.send(msg) is True
            slowest = max(slowest, time.monotonic() - t)
            sent.append(msg)
            assert len(sent) < 100_000, "the pipe never filled"
        assert slowest < 0.5
        # The worker wakes up and reads everything: the queued rest follows, in order, on its own.
        received: list[object] = []
        reader = threading.Thread(target=lambda: received.extend(theirs.recv() for _ in sent), daemon=True)
        reader.start()
        await wait_until(lambda: not reader.is_alive(), timeout=10.0)
        assert received == sent
        assert pipe.queued == 0
        pipe.close()
        theirs.close()

    asyncio.run(main())


def test_eof_detaches_after_delivering_what_came_before() -> None:
    async def main() -> None:
        ours, theirs = pipe_pair()
        got: list[object] = []
        pipe = ControlPipe(ours, got.append)
        theirs.send(P.LoadFailed("no memory"))
        theirs.send(P.Failed("job1", "boom"))
        theirs.close()                                   # the worker died
        await wait_until(lambda: pipe.closed)
        assert got == [P.LoadFailed("no memory"), P.Failed("job1", "boom")]
        assert pipe.send(P.Shutdown()) is False
        assert pipe.queued == 0
        pipe.close()                                     # idempotent

    asyncio.run(main())


def test_close_drops_queued_messages_and_stops_watching() -> None:
    async def main() -> None:
        ours, theirs = pipe_pair()
        got: list[object] = []
        pipe = ControlPipe(ours, got.append)
        n = 0
        while pipe.queued == 0:
            pipe.send(P.Cancel(f"job{n}", reason="x" * 1000))
            n += 1
            assert n < 100_000
        pipe.close()
        assert pipe.closed and pipe.queued == 0
        assert pipe.send(P.Shutdown()) is False
        # What went in before the close is readable; what was queued is gone, and the pipe is closed.
        count = 0
        while True:
            try:
                theirs.recv()
            except EOFError:
                break
            count += 1
        assert 0 < count < n
        assert got == []
        theirs.close()

    asyncio.run(main())


def test_drain_reads_what_is_there_now() -> None:
    async def main() -> None:
        ours, theirs = pipe_pair()
        got: list[object] = []
        pipe = ControlPipe(ours, got.append)
        theirs.send(P.Started("a"))
        theirs.send(P.Finished("a", 0.1))
        pipe.drain()                                     # without waiting for the loop's callback
        assert got == [P.Started("a"), P.Finished("a", 0.1)]
        pipe.close()
        theirs.close()

    asyncio.run(main())
