"""Whether a stage worker lives, as its handle's `Liveness` watches it (omnid/supervisor/workers/liveness.py).

In-process, on a real event loop and real (forked) child processes; the handle is a stand-in
(`Living`: a label, a state, a heartbeat's time, the config's timeout, and a `kill` that records).
"""

from __future__ import annotations

import asyncio
import multiprocessing
import os
import time
from multiprocessing.process import BaseProcess
from typing import Any

from omnid.supervisor.workers.liveness import Liveness
from omnid.vocabulary import WorkerState


class Handle:
    def __init__(self, state: WorkerState = WorkerState.READY, silent_s: float = 0.0, alive: bool = True) -> None:
        self.label = "a"
        self.state = state
        self.alive = alive
        self.last_heartbeat = time.monotonic() - silent_s
        self.config: Any = type("C", (), {"daemon": type("D", (), {"heartbeat_timeout_s": 5.0})()})()
        self.kills: list[tuple[str, bool]] = []

    def kill(self, reason: str, counts: bool = True) -> None:
        self.kills.append((reason, counts))


def _exit_after(seconds: float, code: int) -> None:
    time.sleep(seconds)
    os._exit(code)


def child(seconds: float, code: int) -> BaseProcess:
    proc = multiprocessing.get_context("fork").Process(target=_exit_after, args=(seconds, code), daemon=True)
    proc.start()
    return proc


def test_an_exit_is_heard_at_once_and_once_only() -> None:
    async def main() -> None:
        exited: list[BaseProcess] = []
        live = Liveness(Handle(), exited.append)
        proc = child(0.05, 3)
        live.watch(proc)
        deadline = time.monotonic() + 5.0
        while not exited and time.monotonic() < deadline:
            await asyncio.sleep(0.01)
        assert exited == [proc] and proc.exitcode == 3      # its exit status there to read
        live.check()                                        # handled: not again
        await asyncio.sleep(0.05)
        assert exited == [proc]
    asyncio.run(main())


def test_an_exit_whose_wake_was_lost_is_found_by_the_check() -> None:
    async def main() -> None:
        exited: list[BaseProcess] = []
        live = Liveness(Handle(), exited.append)
        proc = child(0.0, 0)
        live.watch(proc)
        proc.join(5.0)                  # exited, and its wake not read yet (the loop did not run)
        live.check()
        assert exited == [proc]
        await asyncio.sleep(0.05)       # the wake's reader is gone with it: heard once
        assert exited == [proc]
    asyncio.run(main())


def test_a_warm_worker_without_heartbeats_is_killed_as_hung() -> None:
    async def main() -> None:
        hung, fresh = Handle(silent_s=6.0), Handle(silent_s=1.0)
        loading, gone = Handle(WorkerState.LOADING, silent_s=60.0), Handle(silent_s=60.0, alive=False)
        for h in (hung, fresh, loading, gone):
            Liveness(h, lambda proc: None).check()
        assert hung.kills == [("hung: no heartbeat for 5 s", True)]
        assert fresh.kills == loading.kills == gone.kills == []
    asyncio.run(main())
