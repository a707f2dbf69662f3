"""What a stage handle makes of its worker's messages (omnid/supervisor/workers/stage.py: `_HANDLERS`):
its state, its running jobs and its counters, and which messages its listener hears of.

In-process, on a real `StageHandle` that spawned nothing: the test feeds it messages as its control
pipe would, and a listener records what it is told.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from omnid import protocol as P
from omnid.config import Config, parse
from omnid.supervisor.live import Live
from omnid.supervisor.workers.stage import StageHandle
from omnid.vocabulary import WorkerState


def make_config(tmp: Path) -> Config:
    return parse({"daemon": {"socket": str(tmp / "s.sock"), "state_dir": str(tmp / "state"),
                             "lock_dir": str(tmp / "lock")},
                  "stages": {"a": {"engine": "python", "function": "os:getcwd"}},
                  "pipelines": {"p": {"stages": ["a"]}}}, base=tmp)


class Listener:
    def __init__(self) -> None:
        self.heard: list[object] = []

    def on_message(self, handle: StageHandle, msg: object) -> None:
        self.heard.append(msg)

    def on_exit(self, handle: StageHandle, reason: str) -> None:
        pass

    def on_failed(self, handle: StageHandle, error: str) -> None:
        pass


def handle(tmp: Path) -> tuple[StageHandle, Listener]:
    h = StageHandle(Live(make_config(tmp)), "a", tmp / "data", tmp / "jobs", {})
    listener = Listener()
    h.attach(listener)
    return h, listener


def heartbeat(*running: str, **more: Any) -> P.Heartbeat:
    return P.Heartbeat(ts=0.0, stats=P.QueueStats(), running=running, **more)


def test_ready_then_jobs_move_the_state_and_the_listener_hears_each(tmp_path: Path) -> None:
    h, listener = handle(tmp_path)
    ready = P.Ready(pid=7, load_s=1.5, info={"engine": "python"})
    h._on_message(ready)
    assert (h.state, h.load_s, h.info) == (WorkerState.READY, 1.5, {"engine": "python"})
    assert h._attempt_over.is_set() and h._became_ready
    batch = P.Batch((P.Started(job="j1"), P.Started(job="j2"), P.Finished(job="j1", elapsed_s=0.1)))
    h._on_message(batch)
    assert (h.running, h.state, h.jobs_done) == (("j2",), WorkerState.BUSY, 1)
    h._on_message(P.Failed(job="j2", error="boom"))
    assert (h.running, h.state, h.jobs_done) == ((), WorkerState.READY, 1)
    h._on_message(P.Started(job="j3"))
    h._on_message(P.Stopped(job="j3"))
    assert (h.running, h.state, h.jobs_done) == ((), WorkerState.READY, 1)
    # The listener hears of every message but the batch itself (each of its messages instead).
    assert listener.heard == [ready, *batch.messages, P.Failed(job="j2", error="boom"),
                              P.Started(job="j3"), P.Stopped(job="j3")]


def test_a_heartbeat_is_the_handles_alone(tmp_path: Path) -> None:
    h, listener = handle(tmp_path)
    h._on_message(heartbeat("j1", tracked_jobs=3, windows=(("b", 2),)))
    assert h.state is WorkerState.STARTING          # not warm yet: a heartbeat does not make it so
    assert (h.running, h.tracked_jobs, h.windows) == (("j1",), 3, {"b": 2})
    h._on_message(P.Ready(pid=7, load_s=0.1))
    h._on_message(heartbeat("j1"))
    assert h.state is WorkerState.BUSY
    h._on_message(heartbeat())
    assert h.state is WorkerState.READY
    assert [type(m) for m in listener.heard] == [P.Ready]


def test_a_load_failure_is_kept_and_passed_on(tmp_path: Path) -> None:
    h, listener = handle(tmp_path)
    h._on_message(P.LoadFailed(error="ImportError: no module named x\n"))
    assert h._load_error == "ImportError: no module named x"
    assert h.state is WorkerState.STARTING
    assert [type(m) for m in listener.heard] == [P.LoadFailed]

