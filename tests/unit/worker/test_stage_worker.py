"""A `StageWorker`, in-process: its busy loop and control thread driven through fake channels.

No worker process, no data-plane socket and no real engine: the worker's control channel is a
`FakeControl` (the supervisor's messages in through `recv`, its events out), its data transport a
`FakeData` that records hand-offs and offered windows (and answers "no room" when told), and its
engine a `FakeEngine` defined here. The items the data plane would bring are given to
`worker.admit`, as the data plane's connection threads do. Each test runs the worker's `run` and
`control_loop` in threads and waits (a few seconds at most) for what it names.
"""

from __future__ import annotations

import os
import pickle
import queue
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest

from omnid import protocol as P
from omnid.config import parse
from omnid.dataplane.wire import WorkItem
from omnid.engines.base import Engine, InputStream, Outcome, RequestContext
from omnid.vocabulary import ErrorCode
from omnid.worker.jobs import ENDED_JOBS_KEPT, JobTable
from omnid.worker.main import StageWorker

FIXTURES = Path(__file__).resolve().parents[2] / "fixtures"


class FakeControl:
    """The worker's `ControlChannel`: `put` plays a supervisor message; `sent` is what the worker said."""

    def __init__(self) -> None:
        self.inbox: queue.Queue[object] = queue.Queue()
        self.sent: list[object] = []

    def send(self, obj: Any) -> None:
        self.sent.append(obj)

    def send_bytes(self, buf: bytes) -> None:
        msg = pickle.loads(buf)
        self.sent.extend(msg.messages if isinstance(msg, P.Batch) else [msg])

    def recv(self) -> Any:
        return self.inbox.get()         # never EOF: the control thread would exit the process

    def close(self) -> None:
        pass

    def put(self, msg: object) -> None:
        self.inbox.put(msg)

    def of(self, kind: type, job: str | None = None) -> list[Any]:
        return [m for m in list(self.sent) if isinstance(m, kind) and (job is None or getattr(m, "job", None) == job)]


class FakeData:
    """The worker's `DataTransport` (both its senders): records what it is given; `room` False makes
    every offered window find no room."""

    def __init__(self) -> None:
        self.blocked_s = 0.0
        self.sent: list[tuple[str, WorkItem]] = []
        self.offered: list[tuple[str, WorkItem]] = []
        self.offers = 0
        self.room = True

    def send(self, to: str | Callable[[], str], item: WorkItem, abandon: Callable[[], bool],
             on_wait: Callable[[], None] | None = None, busy: Callable[[], bool] | None = None) -> bool:
        self.sent.append((to() if callable(to) else to, item))
        return True

    def offer(self, dst: str, item: WorkItem) -> bool | None:
        self.offers += 1
        if not self.room:
            return None
        self.offered.append((dst, item))
        return True

    def prune(self) -> None:
        pass


class FakeEngine(Engine):
    """Each request streams `segments` segments (one a step), reports its progress, then finishes
    with its inputs' text upper-cased; `hold` keeps every request running (until aborted).
    A streamed input (an `InputStream`) is read as its windows come, and joined."""

    def __init__(self, segments: int = 0, hold: bool = False) -> None:
        self.requests: dict[str, RequestContext] = {}
        self.read: dict[str, list[Any]] = {}
        self.aborted: list[str] = []
        self.segments = segments
        self.hold = hold

    def add(self, ctx: RequestContext) -> None:
        self.requests[ctx.job] = ctx

    def step(self) -> None:
        for job, ctx in list(self.requests.items()):
            if self.hold:
                continue
            streams = [v for v in ctx.inputs.values() if isinstance(v, InputStream)]
            if streams:
                self._read(job, ctx, streams[0])
                continue
            if ctx.segments < self.segments:
                ctx.segment({"text": f"<{ctx.segments}>"})
                continue
            ctx.progress(1, 1)
            ctx.finish({"text": "".join(str(v) for _, v in sorted(ctx.inputs.items())).upper()})
            del self.requests[job]

    def _read(self, job: str, ctx: RequestContext, stream: InputStream) -> None:
        while stream.ready():
            try:
                self.read.setdefault(job, []).append(next(stream))
            except StopIteration:
                ctx.finish({"text": " ".join(self.read[job])})
                del self.requests[job]
                return

    def ready(self) -> bool:
        if self.hold:
            return False
        return any(not isinstance(v, InputStream) or v.ready() for ctx in list(self.requests.values())
                   for v in ctx.inputs.values()) or any(not ctx.inputs for ctx in self.requests.values())

    def abort(self, job: str) -> None:
        self.aborted.append(job)
        ctx = self.requests.pop(job, None)
        if ctx is not None:
            ctx.stopped()

    def has_work(self) -> bool:
        return bool(self.requests)


def wait_for(cond: Callable[[], Any], what: str, timeout: float = 5.0) -> Any:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        value = cond()
        if value:
            return value
        time.sleep(0.005)
    raise AssertionError(f"timed out waiting for {what}")


class Harness:
    """One worker of stage `stage`, its fake channels, and its two threads."""

    def __init__(self, tmp: Path, stage: str, pipelines: dict[str, Any], engine: FakeEngine,
                 stages: tuple[str, ...] = ("a", "b")) -> None:
        py = {"engine": "python", "function": "teststages:echo", "python_path": [str(FIXTURES)],
              "queue_capacity": 4, "max_inflight": 2}
        config = parse({"daemon": {"socket": str(tmp / "s.sock"), "state_dir": str(tmp / "state"),
                                   "lock_dir": str(tmp / "lock")},
                        "stages": {s: dict(py) for s in stages}, "pipelines": pipelines}, base=tmp)
        self.jobs_dir = tmp / "jobs"
        spec = P.WorkerSpec(stage=stage, config=config, data_dir=tmp, jobs_dir=self.jobs_dir, parent_pid=os.getpid())
        self.control = FakeControl()
        self.data = FakeData()
        self.engine = engine
        self.worker = StageWorker(spec, self.control, transport=lambda: self.data)
        self.worker.engine = engine
        threading.Thread(target=self.worker.control_loop, name="control", daemon=True).start()
        self.main = threading.Thread(target=self.worker.run, name="main", daemon=True)
        self.main.start()

    def item(self, job: str, src: str | None = None, pipeline: str = "p", **inputs: Any) -> WorkItem:
        return WorkItem(job=job, pipeline=pipeline, src=src, inputs=dict(inputs) or {"text": job})

    def ended(self, job: str) -> list[Any]:
        return [m for m in self.control.of(object, job) if isinstance(m, (P.Finished, P.Failed, P.Stopped))]

    def close(self) -> None:
        self.control.put(P.Shutdown())
        self.main.join(5.0)
        assert not self.main.is_alive(), "the busy loop did not stop at Shutdown"


PLAIN = {"p": {"stages": ["a", "b"], "edges": [{"from": "a", "to": "b"}]}}
WINDOWED = {"p": {"stages": ["a", "b"], "edges": [{"from": "a", "to": "b", "window": 2}]}}


@pytest.fixture
def harness(tmp_path: Path) -> Iterator[Callable[..., Harness]]:
    made: list[Harness] = []

    def make(stage: str, pipelines: dict[str, Any], engine: FakeEngine | None = None, **kw: Any) -> Harness:
        h = Harness(tmp_path, stage, pipelines, engine or FakeEngine(), **kw)
        made.append(h)
        return h

    yield make
    for h in made:
        h.close()


# ------------------------------------------------------------------------------ admit, run, hand off


def test_an_admitted_job_runs_reports_typed_progress_and_is_handed_downstream(harness: Callable[..., Harness]) -> None:
    h = harness("a", PLAIN)
    assert h.worker.admit(h.item("j1", text="hi")) is True
    wait_for(lambda: h.control.of(P.Finished, "j1"), "j1 to finish")
    wait_for(lambda: h.control.of(P.Delivered, "j1"), "j1 to be handed to b")
    assert [type(m) for m in h.control.of(object, "j1")] == [P.Admitted, P.Started, P.Progress, P.Finished,
                                                             P.Delivered]
    assert h.control.of(P.Progress, "j1") == [P.Progress(job="j1", done=1, total=1)]
    ((dst, out),) = h.data.sent
    assert dst == "b.0" and out.job == "j1" and out.src == "a" and out.inputs == {"text": "HI"}
    assert h.worker.stats().enqueued == 1 and h.worker.stats().window_triggers == 1


def test_a_part_admitted_twice_is_taken_once(harness: Callable[..., Harness]) -> None:
    h = harness("a", PLAIN, FakeEngine(hold=True))
    assert h.worker.admit(h.item("j1")) is True
    assert h.worker.admit(h.item("j1")) is True         # a resend of what we hold: admitted, not queued
    wait_for(lambda: h.control.of(P.Started, "j1"), "j1 to start")
    time.sleep(0.1)
    assert len(h.control.of(P.Admitted, "j1")) == 1 and len(h.control.of(P.Started, "j1")) == 1
    assert h.worker.stats().enqueued == 1 and h.worker.stats().dequeued == 1


def test_a_job_waits_for_every_incoming_part_and_a_last_stage_writes_its_outputs(
        harness: Callable[..., Harness]) -> None:
    fan_in = {"p": {"stages": ["a", "b", "c"], "edges": [{"from": "a", "to": "c"}, {"from": "b", "to": "c"}]}}
    h = harness("c", fan_in, stages=("a", "b", "c"))
    assert h.worker.admit(h.item("j1", src="a", left="l")) is True
    time.sleep(0.2)
    assert not h.control.of(P.Started, "j1"), "started with one part of two"
    assert h.worker.admit(h.item("j1", src="b", right="r")) is True
    wait_for(lambda: h.control.of(P.Finished, "j1"), "j1 to finish")
    (output,) = h.control.of(P.Output, "j1")
    assert output.name == "text" and (h.jobs_dir / "j1" / output.file).read_text() == "LR"
    assert not h.data.sent                      # a last stage hands nothing on


def test_an_edge_that_cannot_map_the_outputs_fails_the_job_with_edge_failed(harness: Callable[..., Harness]) -> None:
    mapped = {"p": {"stages": ["a", "b"], "edges": [{"from": "a", "to": "b", "map": {"x": "nothing"}}]}}
    h = harness("a", mapped)
    h.worker.admit(h.item("j1"))
    (failed,) = wait_for(lambda: h.control.of(P.Failed, "j1"), "j1 to fail")
    assert failed.code == ErrorCode.EDGE_FAILED and "'nothing'" in failed.error
    assert not h.control.of(P.Finished, "j1") and not h.data.sent


# ------------------------------------------------------------------------------ cancel and forget


def test_cancel_aborts_the_running_request_and_it_reports_stopped(harness: Callable[..., Harness]) -> None:
    engine = FakeEngine(hold=True)
    h = harness("a", PLAIN, engine)
    h.worker.admit(h.item("j1"))
    wait_for(lambda: h.control.of(P.Started, "j1"), "j1 to start")
    assert tuple(h.worker.running) == ("j1",)
    h.control.put(P.Cancel("j1"))
    wait_for(lambda: h.ended("j1"), "j1 to end")
    assert engine.aborted == ["j1"] and [type(m) for m in h.ended("j1")] == [P.Stopped]
    assert not h.worker.running and not h.data.sent


class SelfSteppingEngine(FakeEngine):
    """Computes on its own, as vLLM's core in a process: while it has work, a step's outputs wait.
    Its first `add` blocks until `gate` is set (so a second job is queued behind it)."""

    def __init__(self) -> None:
        super().__init__(hold=True)
        self.calls: list[str] = []
        self.gate = threading.Event()

    def add(self, ctx: RequestContext) -> None:
        self.calls.append(f"add {ctx.job}")
        if len(self.calls) == 1:
            self.gate.wait(5)
        super().add(ctx)

    def step(self) -> None:
        self.calls.append("step")
        super().step()

    def outputs_waiting(self) -> bool:
        return self.has_work()


def test_new_jobs_wait_while_a_self_stepping_engine_has_outputs_for_the_running_ones(
        harness: Callable[..., Harness]) -> None:
    engine = SelfSteppingEngine()
    h = harness("a", PLAIN, engine)
    h.worker.admit(h.item("j1"))
    wait_for(lambda: engine.calls, "j1's add")
    h.worker.admit(h.item("j2"))                    # queued while j1 is being added
    engine.gate.set()
    wait_for(lambda: "add j2" in engine.calls, "j2's add")
    # j1's outputs were taken (a step) before j2 was added: a wave of new jobs never holds back
    # the running ones' tokens. (Without the check the two adds come back to back.)
    assert "step" in engine.calls and engine.calls.index("step") < engine.calls.index("add j2"), engine.calls


class SlowCoreEngine(FakeEngine):
    """Its step waits (up to `step_s`) for the next outputs of a core computing elsewhere, unless
    `wake` is called, as VllmEngine's step waits on its core's output queue."""

    def __init__(self, step_s: float) -> None:
        super().__init__(hold=True)
        self.step_s = step_s
        self.woken = threading.Event()
        self.steps = 0

    def step(self) -> None:
        self.steps += 1
        self.woken.wait(self.step_s)
        self.woken.clear()

    def ready(self) -> bool:
        return self.has_work()

    def wake(self) -> None:
        self.woken.set()


def test_a_cancel_wakes_a_step_waiting_on_the_engine_and_the_next_job_starts_now(
        harness: Callable[..., Harness]) -> None:
    engine = SlowCoreEngine(step_s=30.0)
    h = harness("a", PLAIN, engine)
    for job in ("j1", "j2", "j3"):
        h.worker.admit(h.item(job))                     # max_inflight 2: j3 is queued
    wait_for(lambda: h.control.of(P.Started, "j2") and engine.steps, "j1 and j2 to start, a step to wait")
    time.sleep(0.1)
    t0 = time.monotonic()
    h.control.put(P.Cancel("j1"))
    wait_for(lambda: h.control.of(P.Started, "j3"), "j3 to start")
    # The step in flight gave way to the cancel: without the wake-up j3 would wait out its 30 s.
    assert time.monotonic() - t0 < 5
    assert engine.aborted == ["j1"] and [type(m) for m in h.ended("j1")] == [P.Stopped]


def test_a_cancelled_job_is_dropped_at_the_door(harness: Callable[..., Harness]) -> None:
    h = harness("a", PLAIN)
    h.control.put(P.Cancel("j1"))
    wait_for(lambda: h.worker.jobs.is_dead("j1"), "the cancel to arrive")
    assert h.worker.admit(h.item("j1")) is False
    time.sleep(0.1)
    assert h.worker.stats().dropped == 1 and not h.control.of(object, "j1")
    assert len(h.worker.jobs) == 0


def test_forget_drops_everything_of_the_job_in_one_removal(harness: Callable[..., Harness]) -> None:
    h = harness("a", PLAIN)
    h.worker.admit(h.item("j1"))
    h.worker.admit(h.item("j2"))
    wait_for(lambda: h.control.of(P.Delivered, "j1") and h.control.of(P.Delivered, "j2"), "both to be handed on")
    assert len(h.worker.jobs) == 2          # each keeps what it handed on, for a Resend, until its Forget
    h.control.put(P.Forget("j1"))
    wait_for(lambda: len(h.worker.jobs) == 1, "j1 to be forgotten")
    assert h.worker.jobs.get("j1") is None and h.worker.jobs.get("j2") is not None
    assert h.worker.admit(h.item("j1")) is False        # a late part of a forgotten job is dropped
    h.control.put(P.Resend("j1", "b"))      # nothing is kept of it: no resend, and no ResendMissing either
    h.control.put(P.Resend("j2", "b"))
    wait_for(lambda: len(h.data.sent) == 3, "j2's resend")
    assert [item.job for _, item in h.data.sent] == ["j1", "j2", "j2"]
    assert not h.control.of(P.ResendMissing)
    h.control.put(P.Forget("j2"))
    wait_for(lambda: len(h.worker.jobs) == 0, "j2 to be forgotten")


def test_a_job_forgotten_while_it_runs_ends_and_leaves_nothing(harness: Callable[..., Harness]) -> None:
    engine = FakeEngine(hold=True)
    h = harness("a", PLAIN, engine)
    h.worker.admit(h.item("j1"))
    wait_for(lambda: h.control.of(P.Started, "j1"), "j1 to start")
    h.control.put(P.Cancel("j1"))
    h.control.put(P.Forget("j1"))
    wait_for(lambda: h.ended("j1"), "j1 to end")
    wait_for(lambda: not h.worker.running and len(h.worker.jobs) == 0, "no state left of j1")
    assert engine.aborted == ["j1"] and not h.data.sent


# ------------------------------------------------------------------------------ resends and reroutes


def test_a_resend_delivers_what_was_handed_on_to_the_replica_it_names(harness: Callable[..., Harness]) -> None:
    h = harness("a", PLAIN)
    h.worker.admit(h.item("j1", text="x"))
    wait_for(lambda: h.control.of(P.Delivered, "j1"), "j1 to be handed on")
    h.control.put(P.Resend("j1", "b", replica=1))
    wait_for(lambda: len(h.data.sent) == 2, "the resend")
    (first_dst, first), (again_dst, again) = h.data.sent
    assert (first_dst, again_dst) == ("b.0", "b.1") and again == first
    wait_for(lambda: len(h.control.of(P.Delivered, "j1")) == 2, "the resend's Delivered")


def test_a_resend_of_outputs_the_worker_does_not_have_says_so(harness: Callable[..., Harness]) -> None:
    h = harness("a", PLAIN)
    h.control.put(P.Resend("ghost", "b"))
    assert wait_for(lambda: h.control.of(P.ResendMissing, "ghost"), "ResendMissing") == [
        P.ResendMissing(job="ghost", dst="b")]
    assert not h.data.sent


def test_a_reroute_sends_the_jobs_hand_off_to_its_new_replica(harness: Callable[..., Harness]) -> None:
    engine = FakeEngine(hold=True)
    h = harness("a", PLAIN, engine)
    h.worker.admit(h.item("j1"))
    wait_for(lambda: h.control.of(P.Started, "j1"), "j1 to start")
    h.control.put(P.Reroute("j1", "b", 2))
    wait_for(lambda: h.worker.jobs.get("j1") is not None and h.worker.jobs.get("j1").reroutes, "the reroute")
    engine.hold = False
    wait_for(lambda: h.data.sent, "the hand-off")
    assert [dst for dst, _ in h.data.sent] == ["b.2"]


# ------------------------------------------------------------------------------ streaming edges


def test_windows_are_offered_in_order_and_the_last_one_is_delivered(harness: Callable[..., Harness]) -> None:
    h = harness("a", WINDOWED, FakeEngine(segments=3))
    h.worker.admit(h.item("j1"))
    wait_for(lambda: h.control.of(P.Delivered, "j1"), "j1's last window")
    windows = [item for _, item in h.data.offered]
    assert [(w.window, w.last) for w in windows] == [(0, False), (1, True)]
    assert windows[0].inputs == {"text": "<0><1>"} and windows[1].inputs == {"text": "<2>"}
    assert {dst for dst, _ in h.data.offered} == {"b.0"} and not h.data.sent
    assert [s.index for s in h.control.of(P.Segment, "j1")] == [0, 1, 2]
    assert h.worker.stats().window_triggers == 2 and h.worker.handoff.windows_sent == {"b": 2}
    assert len(h.control.of(P.Delivered, "j1")) == 1


def test_a_first_window_without_room_is_offered_again_and_holds_new_input(harness: Callable[..., Harness]) -> None:
    h = harness("a", WINDOWED, FakeEngine(segments=2))
    h.data.room = False
    h.worker.admit(h.item("j1"))
    wait_for(lambda: h.control.of(P.Finished, "j1"), "j1 to finish")
    h.worker.admit(h.item("j2"))
    offers = h.data.offers
    wait_for(lambda: h.data.offers > offers + 2, "the window to be offered again")
    assert not h.control.of(P.Started, "j2"), "took new input while a first window found no room"
    h.data.room = True
    wait_for(lambda: h.control.of(P.Delivered, "j1") and h.control.of(P.Delivered, "j2"), "both jobs' windows")
    assert [(item.job, item.window) for _, item in h.data.offered] == [("j1", 0), ("j1", 1), ("j2", 0), ("j2", 1)]


def test_forget_drops_the_windows_not_sent_yet(harness: Callable[..., Harness]) -> None:
    h = harness("a", WINDOWED, FakeEngine(segments=2))
    h.data.room = False
    h.worker.admit(h.item("j1"))
    wait_for(lambda: h.control.of(P.Finished, "j1"), "j1 to finish")
    h.control.put(P.Cancel("j1"))
    h.control.put(P.Forget("j1"))
    wait_for(lambda: len(h.worker.jobs) == 0, "j1 to be forgotten")
    # The main thread drops the windows at its next offer. (Room only after that: an offer it had
    # begun before the cancel may still be under way, and would find it.)
    wait_for(lambda: "j1" not in h.worker.handoff._offering, "j1's unsent windows to be dropped")
    h.data.room = True
    h.worker.admit(h.item("j2"))            # taken at once: nothing of j1 holds the input back any more
    wait_for(lambda: h.control.of(P.Delivered, "j2"), "j2's windows")
    assert [item.job for _, item in h.data.offered] == ["j2", "j2"]
    assert not h.control.of(P.Delivered, "j1")


def test_a_streamed_input_is_read_window_by_window(harness: Callable[..., Harness]) -> None:
    engine = FakeEngine()
    h = harness("b", WINDOWED, engine)

    def window(i: int, text: str, last: bool = False) -> WorkItem:
        return WorkItem(job="j1", pipeline="p", src="a", inputs={"text": text}, window=i, last=last)

    assert h.worker.admit(window(0, "x")) is True
    wait_for(lambda: h.control.of(P.Started, "j1"), "j1 to start on its first window")
    assert len(h.control.of(P.Admitted, "j1")) == 1      # the first window takes a place in the queue
    assert h.worker.admit(window(1, "y")) is True
    assert h.worker.admit(window(1, "y")) is True        # resent: taken once
    assert h.worker.admit(window(2, "z", last=True)) is True
    wait_for(lambda: h.control.of(P.Finished, "j1"), "j1 to finish")
    assert engine.read["j1"] == ["x", "y", "z"]
    assert len(h.control.of(P.Admitted, "j1")) == 1
    (output,) = h.control.of(P.Output, "j1")
    assert (h.jobs_dir / "j1" / output.file).read_text() == "x y z"


def test_a_job_s_pipeline_is_resolved_once_in_the_worker(harness: Callable[..., Harness],
                                                        monkeypatch: pytest.MonkeyPatch) -> None:
    """By its first part (a fan-in's other parts, a stream's later windows and the job's end read the
    one its `WorkerJob` keeps)."""
    looked_up: list[str] = []
    resolve = StageWorker._pipeline

    def counting(self: StageWorker, key: str) -> Any:
        looked_up.append(key)
        return resolve(self, key)
    monkeypatch.setattr(StageWorker, "_pipeline", counting)
    fan_in = {"p": {"stages": ["a", "b", "c"], "edges": [{"from": "a", "to": "c"}, {"from": "b", "to": "c"}]}}
    h = harness("c", fan_in, stages=("a", "b", "c"))
    assert h.worker.admit(h.item("j1", src="a", left="l")) and h.worker.admit(h.item("j1", src="b", right="r"))
    wait_for(lambda: h.control.of(P.Finished, "j1"), "j1 to finish")
    assert looked_up == ["p"]
    looked_up.clear()
    s = harness("b", WINDOWED)
    for i, text in enumerate("xyz"):
        assert s.worker.admit(WorkItem(job="j2", pipeline="p", src="a", inputs={"text": text}, window=i,
                                       last=i == 2)) is True
    wait_for(lambda: s.control.of(P.Finished, "j2"), "j2 to finish")
    assert looked_up == ["p"]


# ------------------------------------------------------------------------------ the pieces


def test_the_job_table_forgets_in_one_step_and_bounds_its_record_of_ended_jobs() -> None:
    table = JobTable()
    with table.lock:
        job = table.entry("j")
        job.received.add("a")
        job.reroutes["b"] = 1
        assert table.entry("j") is job and len(table) == 1
        assert table.forget("j") is job
    assert len(table) == 0 and table.is_dead("j") and table.ended["j"] == "forgotten"
    with table.lock:
        for i in range(ENDED_JOBS_KEPT + 10):
            table.end(f"x{i}", "cancelled")
    assert len(table.ended) == ENDED_JOBS_KEPT and not table.is_dead("j") and table.is_dead(f"x{ENDED_JOBS_KEPT + 9}")


def test_a_request_context_emits_typed_events_and_ends_once() -> None:
    events: list[object] = []
    ctx = RequestContext(job="j", stage="s", inputs={}, params={}, _emit=events.append)
    ctx.progress(2, 5)
    ctx.segment({"text": "hi"}, is_last=True)
    ctx.finish({"text": "hi"})
    ctx.fail("too late")
    assert events == [P.Progress(job="j", done=2, total=5), P.Segment(job="j", index=0, is_last=True, text="hi")]
    assert ctx.outcome is Outcome.FINISHED and ctx.outcome == "finished" and ctx.error is None
