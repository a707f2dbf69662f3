"""A stage worker's outgoing side: its jobs' outputs handed to the next stages, and resent on demand.

Main thread only (the busy loop of `omnid.worker.main.StageWorker`), except `resends`, which the
control thread fills. Two kinds of edge:

- a plain edge: the job's outputs, mapped through the edge (`apply_edge`), go downstream once the
  request has completed (`deliver`). The hand-off blocks at the downstream's watermark; while it
  waits, the engine keeps stepping (`on_wait`). What was handed on stays in the job's `outbox`
  until its Forget, so that a downstream that restarted can be given it again (`handle_resends`).
- a streaming edge (`window = N`): the request's segments are built into windows as the engine
  streams them (`WindowBuilder`, one per job and edge), mapped and queued (`queue_window`), then
  offered downstream in order (`offer_windows`), which never waits: a window that finds no room is
  offered again on a later turn.
"""

from __future__ import annotations

import queue
import threading
import time
from collections import deque
from collections.abc import Callable, Sequence
from typing import Any, Protocol

from omnid import protocol as P
from omnid.config import EdgeConfig
from omnid.dataplane.wire import WorkItem
from omnid.engines.base import RequestContext
from omnid.vocabulary import ErrorCode
from omnid.worker.jobs import JobTable, WorkerJob
from omnid.worker.reporter import clip
from omnid.worker.windows import WindowBuilder


class DataTransport(Protocol):
    """How a worker hands items to other stages (`dataplane.sender.Sender`: Unix sockets and shared
    memory on this machine; `ray_actor.RaySender`: through the supervisor's Ray bridge)."""

    blocked_s: float

    def send(self, to: str | Callable[[], str], item: WorkItem, abandon: Callable[[], bool],
             on_wait: Callable[[], None] | None = None, busy: Callable[[], bool] | None = None) -> bool: ...

    def offer(self, dst: str, item: WorkItem) -> bool | None: ...

    def prune(self) -> None: ...


class Handoff:
    """What one stage sends downstream, and its counts (see the module docstring).

    `post` queues a message for the supervisor, `flush` sends the queued ones now (the worker's);
    `shutting_down` makes a waiting hand-off give up."""

    def __init__(self, stage: str, jobs: JobTable, make_sender: Callable[[], DataTransport],
                 post: Callable[[object], None], flush: Callable[[], None],
                 shutting_down: threading.Event) -> None:
        self.stage = stage
        self.jobs = jobs
        self.post = post
        self.flush = flush
        self.shutting_down = shutting_down
        self.window_sender = make_sender()      # never blocks
        self.sender = make_sender()
        self.resends: queue.Queue[P.Resend] = queue.Queue()     # control thread -> main
        self.windows_sent: dict[str, int] = {}  # dst -> windows admitted there
        self.triggers = 0                       # hand-offs and windows admitted downstream
        # The jobs with windows not offered (or not admitted) yet, in the order they had their first.
        self._offering: dict[str, WorkerJob] = {}
        self._pruned_at = 0.0

    def address(self, item: WorkItem, dst: str) -> str:
        """Where the job's work for stage `dst` goes: the replica the supervisor chose (or moved it to)."""
        job = self.jobs.get(item.job)
        replica = job.reroutes.get(dst) if job is not None else None
        return P.address(dst, item.routes.get(dst, 0) if replica is None else replica)

    def prune(self) -> None:
        """Once a second: a dead downstream's pool is unmapped within a second."""
        if time.monotonic() >= self._pruned_at + 1.0:
            self._pruned_at = time.monotonic()
            self.sender.prune()
            self.window_sender.prune()

    # ------------------------------------------------------------------ plain edges

    def build(self, job: WorkerJob, ctx: RequestContext, item: WorkItem, edges: Sequence[EdgeConfig],
              builders: dict[str, WindowBuilder]) -> list[tuple[str, WorkItem]] | None:
        """A completed request's outputs for each outgoing edge: the plain edges' items to hand on
        (`hand_off`); a streaming edge's rest goes as its last window. None when an edge failed
        (the job's `Failed` is posted)."""
        handoffs: list[tuple[str, WorkItem]] = []
        for edge in edges:
            if edge.window > 0:             # streamed: what is left of it goes as the last window
                builder = builders.get(edge.dst) or WindowBuilder(edge.sizes)
                window = builder.finish(ctx.outputs or {})
                error = self.queue_window(job, item, edge, *window, last=True) if window is not None else None
                if error is not None:
                    self.post(P.Failed(job=ctx.job, error=clip(error), code=ErrorCode.EDGE_FAILED))
                    return None
                continue
            try:
                inputs = apply_edge(edge, self.stage, ctx.outputs or {})
            except EdgeError as e:
                self.post(P.Failed(job=ctx.job, error=clip(str(e)), code=ErrorCode.EDGE_FAILED))
                return None
            handoffs.append((edge.dst, WorkItem(job=ctx.job, pipeline=item.pipeline, src=self.stage,
                                                inputs=inputs, params=item.params, routes=item.routes,
                                                rank=item.rank, trace=item.trace)))
        return handoffs

    def hand_off(self, job: WorkerJob, handoffs: list[tuple[str, WorkItem]], on_wait: Callable[[], None],
                 busy: Callable[[], bool]) -> None:
        """Keep each item for a Resend, and deliver it; stop once the job has ended."""
        for dst, out in handoffs:
            with self.jobs.lock:
                if self.jobs.is_dead(job.id):
                    return
                job.outbox[dst] = out
            self.deliver(dst, out, on_wait, busy)

    def deliver(self, dst: str, item: WorkItem, on_wait: Callable[[], None], busy: Callable[[], bool]) -> None:
        """Hand one job's outputs to a downstream stage; blocks at its watermark.

        While it waits, `on_wait` keeps the engine stepping its other in-flight requests: no new
        input is taken, so the stage as a whole still stops at the watermark.
        """
        self.flush()                        # what happened so far is known before we wait here
        try:
            ok = self.sender.send(lambda: self.address(item, dst), item,
                                  abandon=lambda: self.jobs.is_dead(item.job) or self.shutting_down.is_set(),
                                  on_wait=on_wait, busy=busy)
        except Exception as e:              # an output that cannot be sent (not picklable): this job alone
            self.post(P.Failed(job=item.job, error=clip(f"handing its outputs to stage {dst!r} failed: "
                                                       f"{type(e).__name__}: {e}"),
                               code=ErrorCode.EDGE_FAILED))
            return
        if ok:
            self.triggers += 1
            self.post(P.Delivered(job=item.job, dst=dst))

    def handle_resends(self, on_wait: Callable[[], None], busy: Callable[[], bool]) -> None:
        """Serve the Resends the control thread queued: deliver again what the job's outbox holds."""
        while True:
            try:
                msg = self.resends.get_nowait()
            except queue.Empty:
                return
            with self.jobs.lock:
                job = self.jobs.get(msg.job)
                item = job.outbox.get(msg.dst) if job is not None else None
            if self.jobs.is_dead(msg.job):
                continue
            if item is None:
                self.post(P.ResendMissing(job=msg.job, dst=msg.dst))
            else:
                self.deliver(msg.dst, item, on_wait, busy)

    # ------------------------------------------------------------------ streaming edges

    def on_segment(self, job: WorkerJob, item: WorkItem, streaming: Sequence[EdgeConfig], outputs: dict[str, Any],
                   is_last: bool) -> str | None:
        """One segment of the request, into each streaming edge's window; the error if an edge
        cannot map a window."""
        for edge in streaming:
            builder = job.builders.get(edge.dst)
            if builder is None:
                builder = job.builders[edge.dst] = WindowBuilder(edge.sizes)
            window = builder.add(outputs, is_last)
            if window is not None:
                error = self.queue_window(job, item, edge, *window, last=builder.closed)
                if error is not None:
                    return error
        return None

    def queue_window(self, job: WorkerJob, item: WorkItem, edge: EdgeConfig, index: int, values: dict[str, Any],
                     last: bool) -> str | None:
        """Map one window through its edge and queue it for `offer_windows`; the error if the edge
        cannot map it."""
        if self.jobs.is_dead(item.job):
            return None
        try:
            # An empty last window only says "that was all": nothing to map.
            # After the first window, an output that only some segments carry (a vllm stage's
            # prompt_token_ids, in its first) may be absent from a window.
            inputs = apply_edge(edge, self.stage, values, partial=index > 0) if values else {}
        except EdgeError as e:
            return str(e)
        window = WorkItem(job=item.job, pipeline=item.pipeline, src=self.stage, inputs=inputs,
                          params=item.params, window=index, last=last, routes=item.routes, rank=item.rank, trace=item.trace)
        line = job.unsent.get(edge.dst)
        if line is None:
            line = job.unsent[edge.dst] = deque()
        line.append(window)
        self._offering.setdefault(job.id, job)
        return None

    def held(self, job: WorkerJob | None, streaming: Sequence[EdgeConfig], capacity: int) -> bool:
        """Windows for a downstream pile up (`capacity` of them): the running request (`job`) should
        let it catch up."""
        return job is not None and any(len(job.unsent.get(e.dst, ())) >= capacity for e in streaming)

    def offer_windows(self) -> None:
        """Offer each streamed job's next windows downstream, in order; never waits for room.

        A window that finds no room stays first in its job's line and is offered again on a later
        turn, while other jobs' windows go on: a downstream busy with one job's stream is never
        blocked from the windows it waits for by another job's.
        """
        for job in list(self._offering.values()):
            for dst in list(job.unsent):
                line = job.unsent[dst]
                while line and not self.jobs.is_dead(job.id):
                    try:
                        answer = self.window_sender.offer(self.address(line[0], dst), line[0])
                    except Exception as e:      # a window that cannot be sent (not picklable): this job alone
                        line.clear()
                        self.post(P.Failed(job=job.id, error=clip(f"streaming to stage {dst!r} failed: "
                                                                  f"{type(e).__name__}: {e}"),
                                           code=ErrorCode.EDGE_FAILED))
                        break
                    if answer is None:
                        break                   # no room (or restarting): later
                    window = line.popleft()
                    if not answer:
                        line.clear()            # the job is over there
                        break
                    self.triggers += 1
                    self.windows_sent[dst] = self.windows_sent.get(dst, 0) + 1
                    if window.last:
                        self.post(P.Delivered(job=job.id, dst=dst))
                if not line or self.jobs.is_dead(job.id):
                    del job.unsent[dst]
            if not job.unsent:
                del self._offering[job.id]

    def backlog(self) -> bool:
        """A downstream has no room for a streamed job's first window: take no new input."""
        return any(line and line[0].window == 0 for job in self._offering.values() for line in job.unsent.values())


class EdgeError(Exception):
    """An edge could not turn a stage's outputs into the next stage's inputs; the message names it."""


def apply_edge(edge: EdgeConfig, src: str, outputs: dict[str, Any], partial: bool = False) -> dict[str, Any]:
    """Map upstream outputs to downstream inputs: by `map`, through `transform`, or by name.

    Every failure is an EdgeError whose message names the edge. `partial` (a window after the
    first): a mapped output the window lacks is left out instead.
    """
    try:
        return _apply_edge(edge, src, outputs, partial)
    except EdgeError:
        raise
    except Exception as e:
        raise EdgeError(f"edge {src} -> {edge.dst}: {type(e).__name__}: {e}") from e


def _apply_edge(edge: EdgeConfig, src: str, outputs: dict[str, Any], partial: bool = False) -> dict[str, Any]:
    where = f"edge {src} -> {edge.dst}"
    if edge.transform:
        from omnid.engines.python_engine import import_ref, user_error
        try:
            result = import_ref(edge.transform)(dict(outputs))
        except Exception as e:      # the user's code (or its import): a per-job error naming the edge
            raise EdgeError(f"{where}: transform {edge.transform} failed: {user_error(e)}") from e
        if not isinstance(result, dict):
            raise EdgeError(f"{where}: transform {edge.transform} returned "
                            f"{type(result).__name__}, not a dict")
        outputs = result
    if edge.map is None:
        return dict(outputs)
    missing = [up for up in edge.map.values() if up not in outputs]
    if missing and partial:
        return {down: outputs[up] for down, up in edge.map.items() if up in outputs}
    if missing:
        # Not a KeyError: its str() would wrap the whole message in quotes.
        raise EdgeError(f"{where} maps {', '.join(repr(m) for m in missing)}, but stage "
                        f"{src!r} gave only {', '.join(repr(k) for k in outputs) or 'nothing'}")
    return {down: outputs[up] for down, up in edge.map.items()}
