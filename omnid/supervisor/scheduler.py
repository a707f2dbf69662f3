"""Jobs: admission, their way through a pipeline's stages, and their end.

Runs in the supervisor's event-loop thread, except the `Feeder` threads that
push jobs' inputs into the first stages of their pipelines (they block on a
stage's high watermark so the event loop never does).

The scheduler never touches payloads between stages: workers hand them to
each other over the data plane. It follows each job through the workers'
events (admitted, started, progress, segment, output, finished, failed,
stopped, delivered) and owns the decisions: a job's state, its deadline,
cancellation (with a grace period after which a worker that ignores it is
restarted), what to do when a worker dies (fail the job it was running, ask
for the others' inputs again), and cleaning every worker's per-job state
(`Forget`) once a job is over.
"""

from __future__ import annotations

import asyncio
import json
import secrets
import threading
import time
from collections import deque
from collections.abc import Callable
from pathlib import Path
from typing import Any

import structlog

from omnid import protocol as P
from omnid.config import Config, PipelineConfig
from omnid.dataplane import Sender, WorkItem
from omnid.store import JobStore
from omnid.supervisor.stage import StageDead, StageHandle

log = structlog.get_logger("omnid.scheduler")


class Refused(Exception):
    """A request the daemon will not take; becomes an API error."""

    def __init__(self, status: int, code: str, message: str, **extra: Any) -> None:
        super().__init__(message)
        self.status, self.code, self.message, self.extra = status, code, message, extra


class Job:
    """A live (non-terminal) job: its API document plus run-time bookkeeping."""

    def __init__(self, doc: dict[str, Any], pipeline: PipelineConfig, inputs: dict[str, Any]) -> None:
        self.doc = doc
        self.pipeline = pipeline
        self.inputs = inputs                    # decoded (file inputs as bytes); doc keeps a summary
        self.seq = 0
        self.subscribers: set[asyncio.Queue[dict[str, Any] | None]] = set()
        self.timer: asyncio.TimerHandle | None = None
        self.delivered: set[tuple[str, str]] = set()
        self.attempts = 0

    @property
    def id(self) -> str:
        return self.doc["id"]

    @property
    def state(self) -> str:
        return self.doc["state"]

    def stage_state(self, stage: str) -> str:
        return self.doc["stages"][stage]["state"]


class Feeder:
    """A thread that delivers jobs' inputs to one first stage, in FIFO order."""

    def __init__(self, stage: str, sender: Sender, is_live: Callable[[str], bool]) -> None:
        self.stage = stage
        self._sender = sender
        self._is_live = is_live
        self._items: deque[WorkItem] = deque()
        self._cv = threading.Condition()
        self._stop = False
        self._thread = threading.Thread(target=self._run, name=f"feeder-{stage}", daemon=True)
        self._thread.start()

    def push(self, item: WorkItem, front: bool = False) -> None:
        with self._cv:
            (self._items.appendleft if front else self._items.append)(item)
            self._cv.notify()

    def stop(self) -> None:
        with self._cv:
            self._stop = True
            self._cv.notify()

    def _run(self) -> None:
        while True:
            with self._cv:
                while not self._items and not self._stop:
                    self._cv.wait()
                if self._stop:
                    self._sender.close()
                    return
                item = self._items.popleft()
            if not self._is_live(item.job):
                continue
            self._sender.send(self.stage, item, abandon=lambda: self._stop or not self._is_live(item.job))


def new_job_id() -> str:
    return secrets.token_hex(6)


class Scheduler:
    def __init__(self, config: Config, store: JobStore, stages: dict[str, StageHandle],
                 data_socket: Callable[[str], Path]) -> None:
        self.config = config
        self.store = store
        self.stages = stages
        self.live: dict[str, Job] = {}
        self.stopping: dict[tuple[str, str], asyncio.TimerHandle] = {}   # (stage, job) -> grace kill
        self.resend_after_restart: dict[str, set[str]] = {s: set() for s in stages}
        self.loop = asyncio.get_running_loop()
        self.metrics: Any = None
        sources = {s for p in config.pipelines.values() for s in p.sources}
        self.feeders = {s: Feeder(s, Sender(data_socket), self.is_live) for s in sorted(sources)}

    def is_live(self, job_id: str) -> bool:
        return job_id in self.live

    # ------------------------------------------------------------------ submit

    def submit(self, owner_uid: int, pipeline_name: str, inputs: dict[str, Any],
               params: dict[str, dict[str, Any]], timeout_s: float | None,
               input_summary: dict[str, Any]) -> dict[str, Any]:
        pipeline = self.config.pipelines[pipeline_name]
        for name in pipeline.stages:
            h = self.stages[name]
            if h.state == "failed":
                raise Refused(503, "stage_failed", f"stage {name!r} of pipeline {pipeline_name!r} has failed "
                              f"and is not restarted: {h.last_error}. Fix the cause, then restart omnid "
                              "(systemctl restart omnid)", stage=name)
        queued = sum(1 for j in self.live.values() if j.pipeline.name == pipeline_name and j.state == "queued")
        limit = self.config.daemon.max_queued_jobs
        if queued >= limit:
            raise Refused(429, "queue_full", f"pipeline {pipeline_name!r} already has {queued} queued jobs "
                          f"(max_queued_jobs = {limit}); try again later", queued=queued)
        timeout = timeout_s or pipeline.timeout_s or self.config.daemon.default_timeout_s
        now = time.time()
        doc: dict[str, Any] = {
            "id": new_job_id(), "pipeline": pipeline_name, "state": "queued", "owner_uid": owner_uid,
            "created_at": now, "started_at": None, "finished_at": None, "timeout_s": timeout,
            "inputs": input_summary, "params": params,
            "stages": {s: {"state": "pending", "progress": None, "started_at": None, "finished_at": None,
                           "elapsed_s": None, "segments": 0} for s in pipeline.stages},
            "outputs": [], "error": None,
        }
        job = Job(doc, pipeline, inputs)
        self.live[job.id] = job
        self.store.save(doc)
        self._event(job, "state", state="queued")
        job.timer = self.loop.call_later(timeout, self._timed_out, job.id)
        if self.metrics:
            self.metrics.job_submitted(pipeline_name)
        for src in pipeline.sources:
            self._feed(job, src)
        return doc

    def _feed(self, job: Job, stage: str, front: bool = False) -> None:
        self.feeders[stage].push(WorkItem(job=job.id, pipeline=job.pipeline.name, src=None,
                                          inputs=job.inputs, params=job.doc["params"]), front=front)

    # ------------------------------------------------------------------ events

    def _event(self, job: Job, type_: str, **fields: Any) -> None:
        ev = {"type": type_, "job": job.id, "ts": time.time(), **fields}
        job.seq += 1
        self.store.append_event(job.id, job.seq, ev)
        for q in job.subscribers:
            q.put_nowait(ev)

    def subscribe(self, job_id: str) -> tuple[list[dict[str, Any]], asyncio.Queue[dict[str, Any] | None] | None]:
        """Past events, and a queue of the events to come (None if the job is over)."""
        past = self.store.events(job_id)
        job = self.live.get(job_id)
        if job is None:
            return past, None
        q: asyncio.Queue[dict[str, Any] | None] = asyncio.Queue()
        job.subscribers.add(q)
        return past, q

    def unsubscribe(self, job_id: str, q: asyncio.Queue[dict[str, Any] | None]) -> None:
        job = self.live.get(job_id)
        if job is not None:
            job.subscribers.discard(q)

    def on_message(self, handle: StageHandle, msg: object) -> None:
        """A stage worker said something (event-loop thread)."""
        if isinstance(msg, StageDead):
            self._stage_dead(handle, str(msg))
            return
        if isinstance(msg, P.Ready):
            self._after_restart(handle)
            return
        job_id = getattr(msg, "job", None)
        if job_id is None:
            return
        if isinstance(msg, (P.Stopped, P.Failed, P.Finished)):
            timer = self.stopping.pop((handle.name, job_id), None)
            if timer is not None:
                timer.cancel()
        job = self.live.get(job_id)
        if job is None or handle.name not in job.doc["stages"]:
            return
        st = job.doc["stages"][handle.name]
        name = handle.name
        if isinstance(msg, P.Admitted):
            if st["state"] in ("pending", "queued"):
                st["state"] = "queued"
        elif isinstance(msg, P.Started):
            st.update(state="running", started_at=time.time())
            self._event(job, "stage_started", stage=name)
            if job.state == "queued":
                job.doc["state"] = "running"
                job.doc["started_at"] = time.time()
                self._event(job, "state", state="running")
                self.store.save(job.doc)
        elif isinstance(msg, P.Progress):
            st["progress"] = {"done": msg.done, "total": msg.total}
            self._event(job, "progress", stage=name, done=msg.done, total=msg.total)
        elif isinstance(msg, P.Segment):
            st["segments"] += 1
            fields: dict[str, Any] = {"stage": name, "index": msg.index, "is_last": msg.is_last}
            if msg.text is not None:
                fields["text"] = msg.text
            self._event(job, "segment", **fields)
        elif isinstance(msg, P.Output):
            out = {"name": msg.name, "file": msg.file, "kind": msg.kind, "content_type": msg.content_type,
                   "size": msg.size, "stage": name}
            job.doc["outputs"].append(out)
            self._event(job, "output", **out)
        elif isinstance(msg, P.Finished):
            st.update(state="succeeded", finished_at=time.time(), elapsed_s=round(msg.elapsed_s, 4))
            self._event(job, "stage_finished", stage=name, elapsed_s=round(msg.elapsed_s, 4))
            self.store.save(job.doc)
            # Every stage, not only the sinks: workers report on separate pipes, so a sink's
            # Finished may be read before an upstream's (fan-in), which must not be left "running".
            if all(job.stage_state(s) == "succeeded" for s in job.pipeline.stages):
                self._finish(job, "succeeded")
        elif isinstance(msg, P.Delivered):
            job.delivered.add((name, msg.dst))
        elif isinstance(msg, P.ResendMissing):
            self._rerun(job, name)
        elif isinstance(msg, P.Failed):
            st.update(state="failed", finished_at=time.time())
            self._event(job, "error", stage=name, code=msg.code, message=msg.error)
            self._finish(job, "failed", {"code": msg.code, "message": f"stage {name!r}: {msg.error}",
                                         "stage": name})
        elif isinstance(msg, P.Stopped):
            st.update(state="cancelled", finished_at=time.time())

    # ------------------------------------------------------------------ ending jobs

    def _finish(self, job: Job, state: str, error: dict[str, Any] | None = None) -> None:
        """Move a live job to a terminal state (once), stop its work, clean every worker."""
        if job.id not in self.live:
            return
        del self.live[job.id]
        if job.timer is not None:
            job.timer.cancel()
        now = time.time()
        job.doc.update(state=state, finished_at=now, error=error)
        busy_stages = []
        for name, st in job.doc["stages"].items():
            if st["state"] in ("pending", "queued", "running"):
                if st["state"] in ("queued", "running"):    # queued: its Started may be on the way
                    busy_stages.append(name)
                st["state"] = "cancelled" if state != "succeeded" else st["state"]
        if state == "succeeded":
            self._write_manifest(job)
        self.store.save(job.doc)
        fields: dict[str, Any] = {"state": state}
        if error:
            fields["error"] = error
        self._event(job, "state", **fields)
        for q in job.subscribers:
            q.put_nowait(None)
        job.subscribers.clear()
        for name in job.pipeline.stages:
            h = self.stages[name]
            if state != "succeeded":
                h.send(P.Cancel(job.id, reason=state))
            h.send(P.Forget(job.id))
        grace = self.config.daemon.cancel_grace_s
        for name in busy_stages:
            self.stopping[(name, job.id)] = self.loop.call_later(grace, self._grace_expired, name, job.id)
        for resend in self.resend_after_restart.values():
            resend.discard(job.id)
        if self.metrics:
            self.metrics.job_finished(job.pipeline.name, state, now - job.doc["created_at"])
        log.info("job finished", job=job.id, pipeline=job.pipeline.name, state=state,
                 error=error["message"] if error else None)

    def _write_manifest(self, job: Job) -> None:
        folder = self.store.job_dir(job.id)
        folder.mkdir(parents=True, exist_ok=True)
        manifest = {k: job.doc[k] for k in ("id", "pipeline", "created_at", "finished_at", "inputs", "params")}
        manifest["outputs"] = job.doc["outputs"]
        tmp = folder / ".manifest.json.tmp"
        tmp.write_text(json.dumps(manifest, indent=2))
        tmp.replace(folder / "manifest.json")

    def _grace_expired(self, stage: str, job_id: str) -> None:
        self.stopping.pop((stage, job_id), None)
        h = self.stages[stage]
        if job_id in h.running:
            h.kill(f"job {job_id} did not stop within {self.config.daemon.cancel_grace_s:g} s of its cancel",
                   counts=False)

    def cancel(self, job_id: str, reason: str = "cancelled") -> dict[str, Any] | None:
        """Cancel a live job (idempotent); None when it is not live."""
        job = self.live.get(job_id)
        if job is None:
            return None
        where = self._where(job)
        self._finish(job, reason, {"code": reason, "stage": where[0] if where else None,
                                   "message": "cancelled by request" if reason == "cancelled" else
                                   f"timed out after {job.doc['timeout_s']:g} s"
                                   + (f" while {where[1]} stage {where[0]!r}" if where else "")})
        return job.doc

    def _where(self, job: Job) -> tuple[str, str] | None:
        for wanted, verb in (("running", "running in"), ("queued", "queued for")):
            for s in job.pipeline.stages:
                if job.stage_state(s) == wanted:
                    return s, verb
        if job.pipeline.sources:
            return job.pipeline.sources[0], "waiting for"
        return None

    def _timed_out(self, job_id: str) -> None:
        self.cancel(job_id, reason="timed_out")

    # ------------------------------------------------------------------ dead workers

    def on_exit(self, handle: StageHandle, reason: str) -> None:
        """A stage worker died: fail (or retry) what it ran, re-request what it held."""
        name = handle.name
        for key in [k for k in self.stopping if k[0] == name]:
            self.stopping.pop(key).cancel()
        for job in list(self.live.values()):
            if name not in job.doc["stages"]:
                continue
            st = job.stage_state(name)
            undelivered = st == "succeeded" and any((name, e.dst) not in job.delivered
                                                    for e in job.pipeline.outgoing(name))
            if st == "running":
                if job.attempts < job.pipeline.retries:
                    job.attempts += 1
                    self._event(job, "error", stage=name, code="worker_died",
                                message=f"stage {name!r} {reason}; retrying (attempt {job.attempts + 1})")
                    job.doc["stages"][name]["state"] = "queued"
                    self.resend_after_restart[name].add(job.id)
                else:
                    job.doc["stages"][name]["state"] = "failed"
                    msg = f"stage {name!r} {reason} while running this job"
                    self._event(job, "error", stage=name, code="worker_died", message=msg)
                    self._finish(job, "failed", {"code": "worker_died", "message": msg, "stage": name})
            elif st == "queued" or undelivered:
                job.doc["stages"][name]["state"] = "queued"
                self.resend_after_restart[name].add(job.id)

    def _after_restart(self, handle: StageHandle) -> None:
        """The worker is back: ask for the inputs its predecessor lost, oldest job first."""
        pending = self.resend_after_restart[handle.name]
        self.resend_after_restart[handle.name] = set()
        jobs = sorted((self.live[j] for j in pending if j in self.live), key=lambda j: j.doc["created_at"])
        for job in reversed(jobs):      # to the feeder's front in reverse: they keep their order
            if not job.pipeline.incoming(handle.name):
                self._feed(job, handle.name, front=True)
        for job in jobs:
            if job.pipeline.incoming(handle.name):
                self._inputs_for(job, handle.name)

    def _inputs_for(self, job: Job, stage: str) -> None:
        """Ask again for `stage`'s inputs of `job`: from the feeder, or from its upstreams."""
        incoming = job.pipeline.incoming(stage)
        if not incoming:
            self._feed(job, stage, front=True)
        for edge in incoming:
            if job.stage_state(edge.src) != "succeeded":
                continue                    # not produced yet: it will be delivered when it is
            if not self.stages[edge.src].send(P.Resend(job.id, stage)):
                self._rerun(job, edge.src)  # that worker is down: its copy is gone with it

    def _rerun(self, job: Job, stage: str) -> None:
        """`stage`'s outputs of `job` were lost with a dead worker: compute them again."""
        job.doc["stages"][stage]["state"] = "queued"
        job.delivered = {d for d in job.delivered if d[0] != stage}
        if self.stages[stage].state in ("ready", "busy"):
            self._inputs_for(job, stage)
        else:
            self.resend_after_restart[stage].add(job.id)

    def _stage_dead(self, handle: StageHandle, error: str) -> None:
        for job in list(self.live.values()):
            if handle.name in job.doc["stages"]:
                msg = f"stage {handle.name!r} has failed: {error}"
                self._finish(job, "failed", {"code": "stage_failed", "message": msg, "stage": handle.name})

    # ------------------------------------------------------------------ shutdown

    def shutdown(self) -> None:
        for job in list(self.live.values()):
            self._finish(job, "failed", {"code": "daemon_stopping",
                                         "message": "the daemon stopped before this job finished"})
        for f in self.feeders.values():
            f.stop()
