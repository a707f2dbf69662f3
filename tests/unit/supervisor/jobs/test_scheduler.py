"""The scheduler, in-process: driven with fake stage handles, a real job store and a real data plane.

No daemon and no worker process: each test builds a `Scheduler` on an asyncio loop, plays the
workers' messages (`protocol.Started`, `Finished`, ...) into `on_message` / `on_exit` /
`on_failed`, and checks the job records, the events, and the control messages the scheduler sent
back to each stage. The first stages' inputs travel through real `Feeder` threads to a real
data-plane `Listener` that records what it admits.
"""

from __future__ import annotations

import asyncio
import dataclasses
import json
import queue
import shutil
import tempfile
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import Any

import pytest

from omnid import protocol as P
from omnid.config import Config, parse
from omnid.dataplane.listener import Listener
from omnid.dataplane.wire import WorkItem
from omnid.store import JobStore
from omnid.supervisor.errors import Refused
from omnid.supervisor.jobs import scheduler as scheduler_module
from omnid.supervisor.jobs.scheduler import Scheduler
from omnid.supervisor.jobs.submission import Submission
from omnid.supervisor.live import Live
from omnid.supervisor.workers.stage_group import StageGroup
from omnid.vocabulary import ErrorCode, JobState, StageRunState, WorkerState

FIXTURES = Path(__file__).resolve().parents[3] / "fixtures"


class FakeStage:
    """What the scheduler uses of a `StageHandle`: a name, a state, `send`, `kill`, `running`."""

    def __init__(self, name: str, replica: int = 0) -> None:
        self.name = name
        self.replica = replica
        self.label = P.replica_label(name, replica)
        self.stats = P.QueueStats()
        self.state = WorkerState.READY
        self.running: tuple[str, ...] = ()
        self.last_error: str | None = None
        self.sent: list[object] = []
        self.kills: list[tuple[str, bool]] = []
        self.listener: Any = None
        self.pipe_open = True

    def attach(self, listener: Any) -> None:
        self.listener = listener

    def send(self, msg: object) -> bool:
        if not self.pipe_open:
            return False
        self.sent.append(msg)
        return True

    def kill(self, reason: str, counts: bool = True) -> None:
        self.kills.append((reason, counts))

    async def stop(self, grace: float) -> None:
        await asyncio.sleep(getattr(self, "stop_s", 0.01))
        self.state = WorkerState.STOPPED
        self.stops = getattr(self, "stops", 0) + 1

    async def wake(self) -> None:
        await asyncio.sleep(0.01)
        self.state = WorkerState.READY
        self.wakes = getattr(self, "wakes", 0) + 1

    def sent_of(self, kind: type, job: str) -> list[Any]:
        return [m for m in self.sent if isinstance(m, kind) and getattr(m, "job", None) == job]


def make_config(tmp: Path, pipelines: dict[str, Any], stages: tuple[str, ...] = ("a", "b"),
                replicas: dict[str, int] | None = None, a: dict[str, Any] | None = None, **daemon: Any) -> Config:
    """`a`: more keys for stage a."""
    stage = {"engine": "python", "function": "teststages:echo", "python_path": [str(FIXTURES)]}
    return parse({"daemon": {"socket": str(tmp / "s.sock"), "state_dir": str(tmp / "state"),
                             "lock_dir": str(tmp / "lock"), **daemon},
                  "stages": {s: dict(stage, replicas=(replicas or {}).get(s, 1), **((a or {}) if s == "a" else {}))
                             for s in stages},
                  "pipelines": pipelines}, base=tmp)


class Harness:
    """A scheduler on a running loop, its fake stages, and the items its feeders delivered."""

    def __init__(self, tmp: Path, config: Config) -> None:
        self.tmp = tmp
        self.config = config
        self.store = JobStore(config.daemon.state_dir)
        # Real stage groups of fake replicas; `stages[name]` is a stage's first replica.
        self.groups = {name: StageGroup(Live(config), name, lambda c, n, i: FakeStage(n, i)) for name in config.stages}
        self.stages: dict[str, FakeStage] = {name: g.replicas[0] for name, g in self.groups.items()}  # type: ignore[misc]
        self.fed: queue.Queue[tuple[str, WorkItem]] = queue.Queue()
        self.listeners = [Listener(P.socket_path(tmp, P.address(name, i)), self._admit(P.replica_label(name, i)))
                          for name, st in config.stages.items() for i in range(st.replicas)]
        for listener in self.listeners:
            listener.start()
        self.sched = Scheduler(Live(config), self.store, self.groups,  # type: ignore[arg-type]
                               lambda address: P.socket_path(tmp, address))

    def _admit(self, stage: str) -> Callable[[WorkItem], bool]:
        def admit(item: WorkItem) -> bool:
            self.fed.put((stage, item))
            return True
        return admit

    def next_fed(self, timeout: float = 5.0) -> tuple[str, WorkItem]:
        return self.fed.get(timeout=timeout)

    def say(self, stage: str, msg: object) -> None:
        """A worker message, as the stage handle passes it on."""
        self.sched.on_message(self.stages[stage], msg)

    def submit(self, pipeline: str = "p", inputs: dict[str, Any] | None = None, timeout_s: float | None = None,
               uid: int = 1000) -> str:
        inputs = inputs or {"text": "hi"}
        summary = {k: {"size": len(v)} if isinstance(v, bytes) else v for k, v in inputs.items()}
        sub = Submission(self.config.pipelines[pipeline], inputs, {}, summary, uid, timeout_s)
        return self.sched.submit(sub).id

    def events(self, job: str) -> list[dict[str, Any]]:
        return self.store.events(job)

    def close(self) -> None:
        self.sched.shutdown()
        self.store.close()


def run(tmp_path: Path, pipelines: dict[str, Any], test: Callable[[Harness], Awaitable[None]],
        replicas: dict[str, int] | None = None, a: dict[str, Any] | None = None, **daemon: Any) -> None:
    """Run `test` on a fresh loop with a scheduler for `pipelines` (stages a and b)."""
    short = Path(tempfile.mkdtemp(prefix="omnid-u-", dir="/tmp"))   # AF_UNIX paths are short

    async def main() -> None:
        h = Harness(short, make_config(short, pipelines, replicas=replicas, a=a, **daemon))
        try:
            await test(h)
        finally:
            h.close()
    try:
        asyncio.run(main())
    finally:
        shutil.rmtree(short, ignore_errors=True)


CHAIN = {"p": {"stages": ["a", "b"]}}
ONE = {"p": {"stages": ["a"]}}


def test_submit_records_the_job_and_feeds_the_first_stage(tmp_path: Path) -> None:
    async def test(h: Harness) -> None:
        job = h.submit(inputs={"text": "hello"})
        record = h.sched.job(job)
        assert record is not None and record.state is JobState.QUEUED
        assert {n: r.state for n, r in record.stages.items()} == {"a": StageRunState.PENDING,
                                                                   "b": StageRunState.PENDING}
        stage, item = await asyncio.to_thread(h.next_fed)
        assert stage == "a" and item.job == job and item.inputs == {"text": "hello"} and item.src is None
        stored = h.store.get(job)
        assert stored is not None and stored.to_doc() == record.to_doc()
        assert [e["type"] for e in h.events(job)] == ["state"]
    run(tmp_path, CHAIN, test)


def test_the_scheduler_runs_the_pipeline_its_submission_carries(tmp_path: Path) -> None:
    """Admission resolved the pipeline: the scheduler takes that definition (and the key the workers
    know it by, which a reload put on it) and does not look the name up again, even when the config
    in force now names another definition so (a reload's switch between the two)."""
    async def test(h: Harness) -> None:
        resolved = dataclasses.replace(h.config.pipelines["p"], stages=("a",), edges=(), key="p~2")
        job = h.sched.submit(Submission(resolved, {"text": "x"}, {}, {"text": "x"}, owner_uid=7, timeout_s=9.0))
        assert list(job.stages) == ["a"] and job.owner_uid == 7 and job.timeout_s == 9.0
        assert h.sched.live_jobs[job.id].pipeline is resolved
        stage, item = await asyncio.to_thread(h.next_fed)
        assert stage == "a" and item.pipeline == "p~2"
    run(tmp_path, CHAIN, test)


def test_a_job_runs_through_its_stages_to_success(tmp_path: Path) -> None:
    async def test(h: Harness) -> None:
        job = h.submit()
        h.say("a", P.Admitted(job, None, 1))
        assert h.sched.job(job).stages["a"].state is StageRunState.QUEUED
        h.say("a", P.Started(job))
        record = h.sched.job(job)
        assert record is not None and record.state is JobState.RUNNING and record.started_at is not None
        assert record.stages["a"].state is StageRunState.RUNNING and record.stages["a"].started_at
        h.say("a", P.Progress(job, 3, 10))
        h.say("a", P.Segment(job, 0, False, text="tok"))
        h.say("a", P.Finished(job, 0.123456))
        h.say("a", P.Delivered(job, "b"))
        assert record.stages["a"].elapsed_s == 0.1235 and record.state is JobState.RUNNING
        h.say("b", P.Started(job))
        h.say("b", P.Output(job, "text", "text.txt", "text", "text/plain", 3))
        h.say("b", P.Finished(job, 0.5))
        assert record.state is JobState.SUCCEEDED and record.finished_at is not None
        assert job not in h.sched.live_jobs
        assert record.outputs == [{"name": "text", "file": "text.txt", "kind": "text",
                                   "content_type": "text/plain", "size": 3, "stage": "b"}]
        manifest = json.loads((h.store.job_dir(job) / "manifest.json").read_text())
        assert manifest["outputs"] == record.outputs and manifest["id"] == job
        types = [e["type"] for e in h.events(job)]
        assert types == ["state", "stage_started", "state", "progress", "segment", "stage_finished",
                         "stage_started", "output", "stage_finished", "state"]
        assert h.events(job)[4]["text"] == "tok"
        assert h.events(job)[-1] == {**h.events(job)[-1], "type": "state", "state": "succeeded"}
        for stage in h.stages.values():          # every worker told to forget it; nobody cancelled
            assert len(stage.sent_of(P.Forget, job)) == 1 and not stage.sent_of(P.Cancel, job)
        assert h.store.get(job).to_doc() == record.to_doc()
    run(tmp_path, CHAIN, test)


def test_a_stage_failure_fails_the_job_and_cancels_the_rest(tmp_path: Path) -> None:
    async def test(h: Harness) -> None:
        job = h.submit()
        h.say("a", P.Started(job))
        h.say("a", P.Failed(job, "boom", code=ErrorCode.STAGE_FAILED))
        record = h.sched.job(job)
        assert record is not None and record.state is JobState.FAILED
        assert record.error.to_doc() == {"code": "stage_failed", "message": "stage 'a': boom", "stage": "a"}
        assert record.stages["a"].state is StageRunState.FAILED
        assert record.stages["b"].state is StageRunState.CANCELLED
        for stage in h.stages.values():
            assert [type(m) for m in stage.sent if getattr(m, "job", None) == job] == [P.Cancel, P.Forget]
        assert h.events(job)[-2]["type"] == "error" and h.events(job)[-2]["message"] == "boom"
    run(tmp_path, CHAIN, test)


def test_cancel_is_idempotent_and_kills_a_stage_that_ignores_it(tmp_path: Path) -> None:
    async def test(h: Harness) -> None:
        stubborn, polite = h.submit(), h.submit()
        for job in (stubborn, polite):
            h.say("a", P.Started(job))
        h.stages["a"].running = (stubborn, polite)
        assert h.sched.cancel(stubborn) is not None
        assert h.sched.cancel(stubborn) is None                        # not live any more: a no-op
        h.sched.cancel(polite)
        h.say("a", P.Stopped(polite))                                  # this one stops at once
        h.stages["a"].running = (stubborn,)
        record = h.sched.job(stubborn)
        assert record is not None and record.state is JobState.CANCELLED
        assert record.error.to_doc() == {"code": "cancelled", "stage": "a", "message": "cancelled by request"}
        assert [m.reason for m in h.stages["a"].sent_of(P.Cancel, stubborn)] == ["cancelled"]
        assert h.stages["a"].kills == []
        await asyncio.sleep(0.35)                                      # cancel_grace_s = 0.2
        assert len(h.stages["a"].kills) == 1
        reason, counts = h.stages["a"].kills[0]
        assert stubborn in reason and counts is False                 # a kill for a cancel is no crash
        assert h.sched.stopping == {}
    run(tmp_path, ONE, test, cancel_grace_s=0.2)


def test_a_started_job_moves_fair_share_so_a_late_owners_backlog_interleaves(tmp_path: Path) -> None:
    """The scheduler tells fair share each job that starts: an owner arriving late with a backlog
    is ranked from the level's clock, not ahead of everything the first owner still has waiting."""
    async def test(h: Harness) -> None:
        early = [h.submit(uid=1000) for _ in range(6)]
        for job in early[:3]:
            h.say("a", P.Started(job))
        late = [h.submit(uid=2000) for _ in range(3)]
        waiting = sorted(early[3:] + late, key=lambda j: h.sched.live_jobs[j].rank)
        assert ["late" if j in late else "early" for j in waiting] == ["early", "late"] * 3
    run(tmp_path, ONE, test)


def test_a_timeout_says_where_the_job_was(tmp_path: Path) -> None:
    async def test(h: Harness) -> None:
        job = h.submit(timeout_s=0.1)
        h.say("a", P.Started(job))
        h.say("a", P.Finished(job, 0.01))
        h.say("b", P.Admitted(job, "a", 1))
        await asyncio.sleep(0.3)
        record = h.sched.job(job)
        assert record is not None and record.state is JobState.TIMED_OUT
        assert record.error.to_doc() == {"code": "timed_out", "stage": "b",
                                "message": "timed out after 0.1 s while queued for stage 'b'"}
        assert [m.reason for m in h.stages["b"].sent_of(P.Cancel, job)] == ["timed_out"]
    run(tmp_path, CHAIN, test)


def test_admission_refuses_a_full_queue_and_a_failed_stage(tmp_path: Path) -> None:
    async def test(h: Harness) -> None:
        h.submit()
        h.submit()
        with pytest.raises(Refused) as full:
            h.submit()
        assert (full.value.status, full.value.code, full.value.extra) == (429, ErrorCode.QUEUE_FULL, {"queued": 2})
        h.stages["a"].state = WorkerState.FAILED
        h.stages["a"].last_error = "it broke"
        with pytest.raises(Refused) as failed:
            h.submit()
        assert failed.value.status == 503 and failed.value.code is ErrorCode.STAGE_FAILED
        assert "it broke" in failed.value.message
    run(tmp_path, ONE, test, max_queued_jobs=2)


def test_a_worker_death_fails_its_running_job_and_requeues_the_rest(tmp_path: Path) -> None:
    async def test(h: Harness) -> None:
        running, queued, done_upstream = h.submit(), h.submit(), h.submit()
        for _ in range(3):
            await asyncio.to_thread(h.next_fed)
        h.say("a", P.Started(running))
        h.say("a", P.Admitted(queued, None, 1))
        h.say("a", P.Started(done_upstream))
        h.say("a", P.Finished(done_upstream, 0.1))         # produced, but not yet handed to b
        h.sched.on_exit(h.stages["a"], "worker (pid 1) was killed by SIGKILL")
        failed = h.sched.job(running)
        assert failed is not None and failed.state is JobState.FAILED
        assert failed.error.to_doc() == {"code": "worker_died", "stage": "a",
                                "message": "stage 'a' worker (pid 1) was killed by SIGKILL while running this job"}
        assert h.sched.recovery.resend_after_restart["a.0"] == {queued, done_upstream}
        h.say("a", P.Ready(pid=2, load_s=0.1))                  # back: the lost inputs are asked for again
        refed = {(await asyncio.to_thread(h.next_fed))[1].job for _ in range(2)}
        assert refed == {queued, done_upstream}
        assert h.sched.recovery.pending() == 0
    run(tmp_path, CHAIN, test)


def test_pipeline_retries_rerun_a_job_whose_worker_died(tmp_path: Path) -> None:
    async def test(h: Harness) -> None:
        job = h.submit()
        await asyncio.to_thread(h.next_fed)
        h.say("a", P.Started(job))
        h.sched.on_exit(h.stages["a"], "exited with status 1")
        record = h.sched.job(job)
        assert record is not None and record.state is JobState.RUNNING
        assert record.stages["a"].state is StageRunState.QUEUED
        assert h.events(job)[-1]["code"] == "worker_died" and "retrying" in h.events(job)[-1]["message"]
        h.say("a", P.Ready(pid=2, load_s=0.1))
        assert (await asyncio.to_thread(h.next_fed))[1].job == job
        h.say("a", P.Started(job))
        h.sched.on_exit(h.stages["a"], "exited with status 1")
        assert record.state is JobState.FAILED                  # one retry, not two
    run(tmp_path, {"p": {"stages": ["a"], "retries": 1}}, test)


def test_a_downstream_restart_asks_the_upstream_to_resend(tmp_path: Path) -> None:
    async def test(h: Harness) -> None:
        job = h.submit()
        h.say("a", P.Started(job))
        h.say("a", P.Finished(job, 0.1))
        h.say("a", P.Delivered(job, "b"))
        h.say("b", P.Started(job))
        h.sched.on_exit(h.stages["b"], "exited")   # (it retries: retries = 1)
        h.say("b", P.Ready(pid=3, load_s=0.1))
        assert h.stages["a"].sent_of(P.Resend, job) == [P.Resend(job, "b")]
        h.say("a", P.ResendMissing(job, "b"))                  # a restarted too: its copy is gone
        record = h.sched.job(job)
        assert record is not None and record.stages["a"].state is StageRunState.QUEUED
        assert (await asyncio.to_thread(h.next_fed))[1].job == job   # fed once at submit...
        assert (await asyncio.to_thread(h.next_fed))[1].job == job   # ...and again, to recompute
    run(tmp_path, {"p": {"stages": ["a", "b"], "retries": 1}}, test)


def test_a_stage_given_up_fails_every_job_that_needs_it(tmp_path: Path) -> None:
    async def test(h: Harness) -> None:
        jobs = [h.submit("p"), h.submit("p")]
        other = h.submit("q")
        h.sched.on_failed(h.stages["b"], "crashed 6 times")
        for job in jobs:
            record = h.sched.job(job)
            assert record is not None and record.state is JobState.FAILED
            assert record.error.to_doc() == {"code": "stage_failed", "stage": "b",
                                    "message": "stage 'b' has failed: crashed 6 times"}
        assert h.sched.job(other).state is JobState.QUEUED
    run(tmp_path, {"p": {"stages": ["a", "b"]}, "q": {"stages": ["a"]}}, test)


def test_late_messages_of_an_ended_job_change_nothing_and_no_state_is_kept(tmp_path: Path) -> None:
    async def test(h: Harness) -> None:
        job = h.submit()
        h.say("a", P.Started(job))
        h.sched.cancel(job)
        before = h.sched.job(job).to_doc()
        n_events = len(h.events(job))
        for msg in (P.Progress(job, 1, 2), P.Segment(job, 1, True), P.Finished(job, 1.0), P.Failed(job, "x"),
                    P.Output(job, "o", "o.txt", "text", "text/plain", 1), P.Stopped(job)):
            h.say("a", msg)
        assert h.sched.job(job).to_doc() == before
        assert len(h.events(job)) == n_events
        assert h.sched.live_jobs == {} and h.sched.stopping == {} and h.sched.recovery.pending() == 0
    run(tmp_path, ONE, test)


def test_subscribers_get_the_past_then_the_live_events_then_the_end(tmp_path: Path) -> None:
    async def test(h: Harness) -> None:
        job = h.submit()
        past, q = h.sched.subscribe(job)
        assert [e["type"] for e in past] == ["state"] and q is not None
        h.say("a", P.Started(job))
        h.say("a", P.Finished(job, 0.1))
        got = []
        while (event := q.get_nowait()) is not None:
            got.append(event["type"])
        assert got == ["stage_started", "state", "stage_finished", "state"]
        assert h.sched.subscribe(job)[1] is None                  # over: the past only
    run(tmp_path, ONE, test)


def test_shutdown_keeps_what_is_live_for_the_next_start(tmp_path: Path) -> None:
    async def test(h: Harness) -> None:
        queued, running = h.submit(inputs={"text": "q", "file": b"\x00bytes"}), h.submit()
        h.say("a", P.Started(running))
        h.sched.shutdown()
        left = {u.record.id: u for u in h.store.unfinished()}
        assert {j: u.record.state for j, u in left.items()} == {queued: JobState.QUEUED, running: JobState.RUNNING}
        assert left[queued].inputs == {"text": "q", "file": b"\x00bytes"}     # the whole inputs, files too
        assert left[running].events == 3                                    # queued, stage_started, running
    run(tmp_path, ONE, test)


def test_the_next_start_runs_queued_jobs_in_order_and_reruns_or_fails_running_ones(tmp_path: Path) -> None:
    short = Path(tempfile.mkdtemp(prefix="omnid-u-", dir="/tmp"))
    pipelines = {"p": {"stages": ["a"], "retries": 1}, "q": {"stages": ["a"]}}

    async def first() -> list[str]:
        h = Harness(short, make_config(short, pipelines))
        jobs = [h.submit("p"), h.submit("q"), h.submit("p"), h.submit("p")]
        for _ in jobs:
            await asyncio.to_thread(h.next_fed)
        h.say("a", P.Started(jobs[1]))           # running, no retries left: fails on the next start
        h.say("a", P.Started(jobs[2]))           # running, may run again
        h.close()                                # (as SIGTERM past the drain, or kill -9)
        for listener in h.listeners:
            listener._sock.close()
        return jobs

    async def second(jobs: list[str]) -> None:
        h = Harness(short, make_config(short, pipelines))
        try:
            h.sched.restore(h.store.unfinished())
            fed = [(await asyncio.to_thread(h.next_fed))[1].job for _ in range(3)]
            assert fed == [jobs[0], jobs[2], jobs[3]]                 # in their order
            failed = h.sched.job(jobs[1])
            assert failed is not None and failed.state is JobState.FAILED
            assert failed.error is not None and failed.error.code == "daemon_restarted"
            assert "interrupted while this job was running" in failed.error.message
            rerun = h.sched.job(jobs[2])
            assert rerun is not None and rerun.state is JobState.RUNNING        # never back to queued
            assert rerun.stages["a"].state is StageRunState.PENDING
            events = h.events(jobs[2])
            assert [e["type"] for e in events] == ["state", "stage_started", "state", "error"]
            assert "running the job again (attempt 2)" in events[-1]["message"]
            assert h.sched.job(jobs[0]).state is JobState.QUEUED
            assert h.store.unfinished()[1].attempts == 1                         # the retry is used up
            h.say("a", P.Started(jobs[0]))
            h.say("a", P.Finished(jobs[0], 0.1))
            assert h.sched.job(jobs[0]).state is JobState.SUCCEEDED
            assert jobs[0] not in {u.record.id for u in h.store.unfinished()}   # its inputs are gone
        finally:
            h.close()

    try:
        jobs = asyncio.run(first())
        asyncio.run(second(jobs))
    finally:
        shutil.rmtree(short, ignore_errors=True)


def test_drain_sets_queued_jobs_aside_and_lets_running_ones_finish(tmp_path: Path) -> None:
    async def test(h: Harness) -> None:
        running, queued = h.submit(), h.submit()
        h.say("a", P.Started(running))
        assert h.sched.drain() == 1
        assert set(h.sched.live_jobs) == {running} and h.sched.running() == 1
        assert [type(m) for m in h.stages["a"].sent if getattr(m, "job", None) == queued] == [P.Cancel, P.Forget]
        assert h.store.get(queued).state is JobState.QUEUED
        h.say("a", P.Finished(running, 0.1))
        assert h.sched.running() == 0 and h.sched.job(running).state is JobState.SUCCEEDED
        assert [u.record.id for u in h.store.unfinished()] == [queued]
    run(tmp_path, ONE, test)


def test_every_per_job_worker_message_has_a_handler() -> None:
    per_job = {cls for cls in vars(P).values()
               if isinstance(cls, type) and cls.__module__ == P.__name__ and "job" in getattr(cls, "__annotations__", {})
               and cls not in (P.Cancel, P.Forget, P.Resend, P.Reroute, P.Deadline)}   # those go the other way
    assert per_job == set(scheduler_module._HANDLERS)
    for cls, handler in scheduler_module._HANDLERS.items():
        assert handler.__name__.startswith("on_"), (cls, handler)


def test_a_cancel_of_a_job_still_queued_in_a_stage_is_watched_too(tmp_path: Path) -> None:
    async def test(h: Harness) -> None:
        job = h.submit()
        h.say("a", P.Admitted(job, None, 1))
        h.sched.cancel(job)
        h.stages["a"].running = (job,)               # its Started was already on the way: it runs anyway
        await asyncio.sleep(0.35)
        assert [counts for _, counts in h.stages["a"].kills] == [False]
    run(tmp_path, ONE, test, cancel_grace_s=0.2)


def test_inputs_asked_for_again_keep_the_jobs_order(tmp_path: Path) -> None:
    async def test(h: Harness) -> None:
        jobs = [h.submit(inputs={"text": str(k)}) for k in range(4)]
        for _ in jobs:
            await asyncio.to_thread(h.next_fed)
        for job in jobs:
            h.say("a", P.Admitted(job, None, 1))
        h.sched.on_exit(h.stages["a"], "exited with status 1")
        h.say("a", P.Ready(pid=2, load_s=0.1))
        refed = [(await asyncio.to_thread(h.next_fed))[1].job for _ in jobs]
        assert refed == jobs                                          # oldest first, as submitted
    run(tmp_path, ONE, test)


def test_a_subscriber_that_falls_behind_is_dropped_and_catches_up_from_the_store(tmp_path: Path) -> None:
    from omnid.supervisor.jobs.live_job import LAGGED, SUBSCRIBER_BACKLOG

    async def test(h: Harness) -> None:
        job = h.submit()
        past, q = h.sched.subscribe(job)
        assert q is not None and len(past) == 1
        n = SUBSCRIBER_BACKLOG + 200
        for i in range(n):                       # nobody reads q meanwhile
            h.say("a", P.Progress(job, i + 1, n))
        assert q.qsize() == 1 and q.get_nowait() is LAGGED      # bounded: its backlog was dropped
        assert q not in h.sched.live_jobs[job].events._subscribers
        rest, q2 = h.sched.subscribe(job, after=len(past))
        assert [e["done"] for e in rest] == list(range(1, n + 1))  # nothing lost: it is all stored
        assert q2 is not None and q2.empty()
    run(tmp_path, ONE, test)


# ------------------------------------------------------------------ replicas

def replica(h: Harness, stage: str, i: int) -> FakeStage:
    return h.groups[stage].replicas[i]      # type: ignore[return-value]


def test_jobs_go_to_the_least_loaded_replica_and_are_fed_there(tmp_path: Path) -> None:
    async def test(h: Harness) -> None:
        jobs = [h.submit(inputs={"text": f"j{k}"}) for k in range(4)]
        routes = [h.sched.job(j).stages["a"].replica for j in jobs]
        assert routes == [0, 1, 0, 1]
        fed = [await asyncio.to_thread(h.next_fed) for _ in range(4)]
        assert {item.job: where for where, item in fed} == {j: f"a#{r}" if r else "a" for j, r in zip(jobs, routes)}
        assert all(item.routes == {"a": routes[jobs.index(item.job)]} for _, item in fed)
        # replica 1 finishes its two: the next job goes there (least work), though replica 0 is next
        # in turn (round robin alone would send it to replica 0, which has two jobs still)
        for j in jobs[1::2]:
            h.sched.on_message(replica(h, "a", 1), P.Started(j))
            h.sched.on_message(replica(h, "a", 1), P.Finished(j, 0.1))
        assert h.sched.job(h.submit()).stages["a"].replica == 1
        # a replica's word about a job it does not serve is ignored
        h.sched.on_message(replica(h, "a", 1), P.Finished(jobs[0], 0.1))
        assert h.sched.job(jobs[0]).state is JobState.QUEUED
    run(tmp_path, ONE, test, replicas={"a": 2})


def test_a_dead_replica_touches_only_its_own_jobs(tmp_path: Path) -> None:
    async def test(h: Harness) -> None:
        jobs = [h.submit(inputs={"text": f"j{k}"}) for k in range(4)]     # replicas 0, 1, 0, 1
        for _ in jobs:
            await asyncio.to_thread(h.next_fed)
        for j, r in zip(jobs, (0, 1, 0, 1)):
            h.sched.on_message(replica(h, "a", r), P.Admitted(j, None, 1))
        for j, r in zip(jobs[:2], (0, 1)):
            h.sched.on_message(replica(h, "a", r), P.Started(j))
        h.sched.on_exit(replica(h, "a", 1), "worker (pid 9) was killed by SIGKILL")
        states = [h.sched.job(j).state for j in jobs]
        assert states == [JobState.RUNNING, JobState.FAILED, JobState.QUEUED, JobState.QUEUED]
        assert "(replica 1)" in h.sched.job(jobs[1]).error.message
        assert h.sched.recovery.resend_after_restart == {"a.1": {jobs[3]}}
    run(tmp_path, ONE, test, replicas={"a": 2})


def test_a_replica_given_up_moves_its_jobs_to_the_others(tmp_path: Path) -> None:
    async def test(h: Harness) -> None:
        jobs = [h.submit(inputs={"text": f"j{k}"}) for k in range(4)]     # a: 0, 1, 0, 1; b: 0, 1, 0, 1
        for _ in jobs:
            await asyncio.to_thread(h.next_fed)
        assert [h.sched.job(j).stages["b"].replica for j in jobs] == [0, 1, 0, 1]
        dead = replica(h, "b", 1)
        dead.state = WorkerState.FAILED
        h.sched.on_failed(dead, "crashed 6 times")
        assert all(h.sched.job(j).state is JobState.QUEUED for j in jobs), "a degraded stage fails nothing"
        assert [h.sched.job(j).stages["b"].replica for j in jobs] == [0, 0, 0, 0]
        # the upstream replicas were told where the moved jobs' hand-offs go now
        told = [m for r in (0, 1) for m in replica(h, "a", r).sent if isinstance(m, P.Reroute)]
        assert sorted((m.job, m.stage, m.replica) for m in told) == sorted(
            (j, "b", 0) for j in jobs[1::2] for _ in (0, 1))
        assert h.groups["b"].state is WorkerState.DEGRADED
        # the last one given up: the stage fails, and so does every job that needs it
        last = replica(h, "b", 0)
        last.state = WorkerState.FAILED
        h.sched.on_failed(last, "crashed 6 times")
        assert h.groups["b"].state is WorkerState.FAILED
        assert all(h.sched.job(j).state is JobState.FAILED for j in jobs)
        with pytest.raises(Refused) as refused:
            h.submit()
        assert refused.value.code is ErrorCode.STAGE_FAILED
    run(tmp_path, CHAIN, test, replicas={"a": 2, "b": 2})


# ------------------------------------------------------------------ sleeping stages

def test_an_idle_stage_sleeps_and_a_job_wakes_it(tmp_path: Path) -> None:
    async def test(h: Harness) -> None:
        group = h.groups["a"]
        group.idle_since -= 10
        h.sched.tend_sleep()
        assert group.dozing
        await asyncio.sleep(0.1)
        assert group.sleeping and group.state is WorkerState.SLEEPING and h.stages["a"].stops == 1
        job = h.submit()
        await asyncio.sleep(0.1)
        assert not group.sleeping and group.state is WorkerState.READY and h.stages["a"].wakes == 1
        assert [e["type"] for e in h.events(job)] == ["state", "stage_waking", "stage_awake"]
        assert h.sched.has_work("a")
        h.sched.tend_sleep()                # it has work: not idle
        assert not group.dozing and group.idle_for() < 1
    run(tmp_path, ONE, test, a={"idle_unload_s": 5})


def test_a_job_that_comes_while_it_falls_asleep_wakes_it_without_resending_anything(tmp_path: Path) -> None:
    async def test(h: Harness) -> None:
        group = h.groups["a"]
        h.sched.put_to_sleep(group)
        job = h.submit()                    # before the sleep even started: it is called off
        await asyncio.sleep(0.1)
        assert not group.sleeping and group.state is WorkerState.READY
        assert getattr(h.stages["a"], "stops", 0) == 0
        assert h.sched.recovery.pending() == 0
        assert h.sched.job(job).state is JobState.QUEUED
        h.say("a", P.Started(job))
        h.say("a", P.Finished(job, 0.1))
        assert not h.sched.has_work("a")
        h.stages["a"].stop_s = 0.2          # its workers take a while to stop
        h.sched.put_to_sleep(group)
        await asyncio.sleep(0.05)
        assert group.dozing and not group.sleeping
        late = h.submit()                   # comes while they stop: it waits for the sleep, then wakes it
        await asyncio.sleep(0.4)
        assert not group.sleeping and h.stages["a"].stops == 1 and h.stages["a"].wakes == 1
        assert [e["type"] for e in h.events(late)] == ["state", "stage_waking", "stage_awake"]
    run(tmp_path, ONE, test)
