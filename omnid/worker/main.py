"""A stage worker's busy loop: `StageWorker`, the loop of the process that owns one stage's engine,
and the control handlers that change what it knows of its jobs.

The process is started by `omnid.worker.bootstrap` (`worker_main`, spawned by the supervisor, or
`RayStart` inside a Ray actor: one start-up for both), which loads the engine into a `StageWorker`
and then runs its threads:
- main: `StageWorker.run`, the busy loop
  (1. take input, 2. step the engine, 3. emit outputs, 4. sleep while every request waits for its
  next window). It blocks in the engine, on the input queue (briefly) and on a downstream stage's
  watermark.
- control: `control_loop` reads the supervisor's control channel (cancel, forget, resend, reroute,
  shutdown, reconfigure: one handler each); exits the process when the supervisor is gone.
- heartbeat: `heartbeat_loop` sends a heartbeat every interval, whatever the engine does, so
  the supervisor can tell a hung worker from a busy one.
- data-accept / data-conn: a local stage's data-plane listener (`dataplane.listener.Listener`).

What the worker knows of each job is one `WorkerJob` in its `JobTable` (`omnid.worker.jobs`, which
says which thread touches what, under which lock); what it sends downstream goes through its
`Handoff` (`omnid.worker.handoff`); what it tells the supervisor, through its `Reporter`
(`omnid.worker.reporter`).
"""

from __future__ import annotations

import logging
import os
import sys
import threading
import time
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import TYPE_CHECKING, Any

from omnid import protocol as P
from omnid.config import PipelineConfig
from omnid.dataplane.listener import Listener
from omnid.dataplane.sender import Sender
from omnid.dataplane.shm import ShmPool
from omnid.dataplane.wire import WorkItem
from omnid.engines import vllm_compat
from omnid.engines.base import Engine, InputStream, Outcome, RequestContext
from omnid.lora import job_adapters
from omnid.params import merged
from omnid.process_stats import rss_bytes, tree_cpu_seconds
from omnid.vocabulary import ErrorCode
from omnid.worker.handoff import DataTransport, Handoff
from omnid.worker.intake import Intake
from omnid.worker.jobs import JobTable, WorkerJob
from omnid.worker.outputs import Sink, WriteOutputs
from omnid.worker.reporter import ControlChannel, Reporter, clip

if TYPE_CHECKING:
    from omnid.worker.tracing import StageTracer


class Wakeup(threading.Event):
    """The busy loop's wake-up: an Event whose `set` (any thread) also wakes the engine, so that a
    step blocked on an engine that computes on its own (vLLM's core in a process) returns, and a
    cancel or a new job is served now, not after the step being computed."""

    def __init__(self, also: Callable[[], None]) -> None:
        super().__init__()
        self._also = also

    def set(self) -> None:
        super().set()
        self._also()


class StageWorker:
    """The busy loop of one stage, and the control handlers that change what it knows of its jobs.

    Its three channels are pluggable (a Ray-placed worker runs this same class inside an actor):
    `conn` (control), `transport` (a factory of data senders) and `write_sink` (a last stage's
    outputs into the job's folder); `live_sink` says whether a last stage streams its segments to
    files as it runs (only where the job's folder is on this machine)."""

    def __init__(self, spec: P.WorkerSpec, conn: ControlChannel,
                 transport: Callable[[], DataTransport] | None = None,
                 write_sink: WriteOutputs | None = None, live_sink: bool = True) -> None:
        self.spec = spec
        self.config = spec.config
        self.stage = spec.config.stages[spec.stage].for_replica(spec.replica)
        self.conn = conn
        self.running: dict[str, WorkerJob] = {}     # main: the jobs whose request is in the engine
        self.busy_s = 0.0                   # main thread writes, heartbeat reads: seconds in add and step
        self.cpu_base_s = 0.0               # the worker's CPU seconds when it became ready (`mark_ready`)
        reporter = Reporter(conn, self._flush_live)
        self.send: Callable[[object], None] = reporter.send
        self.post: Callable[[object], None] = reporter.post
        self.flush = reporter.flush
        self.end_step = reporter.end_step
        self.tracer: StageTracer | None = None      # `[daemon] tracing`: this stage's spans of its jobs
        if spec.config.daemon.tracing is not None:
            from omnid.worker.tracing import StageTracer, engine_environment
            engine_environment(spec.config.daemon.tracing, spec.stage)
            self.tracer = StageTracer(spec.config.daemon.tracing, spec.stage, spec.replica,
                                      engine_spans=self.stage.engine == "vllm")
            self.send, self.post = self.tracer.watch(reporter.send), self.tracer.watch(reporter.post)
        self.jobs = JobTable()                  # what the worker knows of each job (and its lock)
        self.wakeup = Wakeup(self._wake_engine)  # a window, an input or a cancel arrived: the loop looks again
        self.shutting_down = threading.Event()
        self._reconfigured = threading.Condition()   # `config` replaced by a reload
        self.intake = Intake(self.stage.name, self.stage.queue_capacity, self.jobs, self.send, self.wakeup,
                             self.shutting_down, self._pipeline, lambda: self.config.daemon.max_wait_s)
        self.listener: Listener | None = None
        make_sender: Callable[[], DataTransport] = transport or (
            lambda: Sender(spec.socket_for, spec.config.daemon.shm_min_bytes))
        self.sink = Sink(self.stage.name, spec.jobs_dir, write_sink, live_sink)
        self.handoff = Handoff(self.stage.name, self.jobs, make_sender, self.post, self.flush, self.shutting_down)
        self.pool: ShmPool | None = None                 # this stage's shared memory for large inputs
        self.engine: Engine = _NoEngine()          # until load_engine() returns
        # LoRA adapters: the set in force (from the config a Reconfigure brings) and the one the
        # engine was last given; the main thread gives the engine a new set between two steps.
        self._adapters: Mapping[str, Path] = dict(self.stage.adapters)
        self._engine_adapters: Mapping[str, Path] = dict(self.stage.adapters)
        self._loop_stepping = False             # the busy loop's own engine step runs (`_input_next`)

    # ------------------------------------------------------------------ plumbing

    def _wake_engine(self) -> None:
        self.engine.wake()      # a step that waits on a self-stepping engine's outputs returns now

    def _flush_live(self) -> None:
        for job in self.running.values():
            if job.live_outputs is not None:
                job.live_outputs.flush()    # a step's live output segments, for ?stream=1 readers

    def stats(self) -> P.QueueStats:
        used, slots = self.pool.usage() if self.pool is not None else (0, 0)
        intake = self.intake
        hits, misses = getattr(self.engine, "cache_counts", (0, 0))     # a diffusers stage's DiT cache
        return P.QueueStats(enqueued=intake.enqueued, dequeued=intake.dequeued, dropped=intake.dropped,
                            depth=intake.queue.qsize(), blocked_s=self.handoff.sender.blocked_s,
                            window_triggers=self.handoff.triggers, shm_capacity=self.pool.capacity if self.pool else 0,
                            shm_used=used, shm_slots=slots, cache_hits=hits, cache_misses=misses,
                            busy_s=self.busy_s, cpu_s=max(0.0, tree_cpu_seconds(os.getpid()) - self.cpu_base_s))

    def mark_ready(self) -> None:
        """Its stats' CPU seconds count from now: what loading the engine cost is not serving work (a
        real-time pipeline's capacity is measured from these, its warm-up job first)."""
        self.cpu_base_s = tree_cpu_seconds(os.getpid())

    def admit(self, item: WorkItem) -> bool | None:
        """Data-plane callback (a data-conn thread): `Intake.admit`."""
        if self.tracer is not None:
            self.tracer.arrived(item)
        return self.intake.admit(item)

    # ------------------------------------------------------------------ control thread

    def control_loop(self) -> None:
        """Control thread: apply the supervisor's messages (one handler each); exit when it is gone."""
        handlers: dict[type, Callable[[Any], None]] = {
            P.Cancel: self.on_cancel, P.Forget: self.on_forget, P.Resend: self.on_resend,
            P.Reroute: self.on_reroute, P.Shutdown: self.on_shutdown, P.Reconfigure: self.on_reconfigure,
            P.Deadline: self.on_deadline,
        }
        while True:
            try:
                msg = self.conn.recv()
            except (EOFError, OSError):
                os._exit(P.EXIT_ORPHANED)
            handler = handlers.get(type(msg))
            if handler is not None:
                handler(msg)

    def on_cancel(self, msg: P.Cancel) -> None:
        if self.tracer is not None:
            self.tracer.cancelled(msg.job, msg.reason)
        with self.jobs.lock:
            job = self.jobs.end(msg.job, msg.reason)
            for stream in job.streams.values() if job is not None else ():
                stream.cancel()             # a function waiting for its next window stops now
        self.wakeup.set()

    def on_deadline(self, msg: P.Deadline) -> None:
        job = self.running.get(msg.job)     # (a single read of the main thread's dict)
        if job is not None:
            job.request.deadline = msg.at   # the engine's next step orders its sessions by it

    def on_forget(self, msg: P.Forget) -> None:
        if self.tracer is not None:
            self.tracer.forgotten(msg.job)
        with self.jobs.lock:
            job = self.jobs.forget(msg.job)
            for stream in job.streams.values() if job is not None else ():
                stream.cancel()
        self.wakeup.set()                   # the main thread drops the job's unsent windows

    def on_resend(self, msg: P.Resend) -> None:
        self.on_reroute(P.Reroute(msg.job, msg.dst, msg.replica))
        self.handoff.resends.put(msg)   # served by the main thread, between engine steps

    def on_reroute(self, msg: P.Reroute) -> None:
        with self.jobs.lock:
            if not self.jobs.is_dead(msg.job):
                self.jobs.entry(msg.job).reroutes[msg.stage] = msg.replica

    def on_shutdown(self, msg: P.Shutdown) -> None:
        self.shutting_down.set()
        self.wakeup.set()               # a step waiting on the engine returns: the loop sees the shutdown
        if self.listener is not None:
            self.listener.close()       # senders now wait for the next worker at our address

    def on_reconfigure(self, msg: P.Reconfigure) -> None:
        with self._reconfigured:
            self.config = msg.config
            mine = msg.config.stages.get(self.stage.name)
            if mine is not None and mine.lora is not None:
                self._adapters = dict(mine.adapters)      # (adapters added or removed: run time, reload)
                self.wakeup.set()
            self._reconfigured.notify_all()

    def _sync_adapters(self, wanted: Mapping[str, float] | None = None) -> None:
        """Main thread: give the engine the adapter set in force if it changed. A job that names an
        adapter this worker has not heard of yet (added at run time: its Reconfigure may come just
        after the job, on another channel) waits for it a little."""
        if wanted and any(name not in self._adapters for name in wanted):
            with self._reconfigured:
                self._reconfigured.wait_for(lambda: all(n in self._adapters for n in wanted), timeout=10.0)
        adapters = self._adapters
        if adapters != self._engine_adapters:
            self.engine.set_adapters(adapters)
            self._engine_adapters = adapters

    def _pipeline(self, key: str) -> PipelineConfig:
        """A pipeline by the key its jobs carry. A job of a pipeline added by a reload may reach
        this worker (data plane) just before the new config does (control pipe): wait for it."""
        with self._reconfigured:
            self._reconfigured.wait_for(lambda: key in self.config.pipelines, timeout=10.0)
            return self.config.pipelines[key]

    def heartbeat_loop(self) -> None:
        interval = self.config.daemon.heartbeat_interval_s
        while True:
            self.send(P.Heartbeat(ts=time.time(), stats=self.stats(), running=tuple(self.running),
                                  gpu_memory_bytes=_gpu_memory(), tracked_jobs=len(self.jobs),
                                  windows=tuple(self.handoff.windows_sent.items()), rss_bytes=rss_bytes(os.getpid()),
                                  live_info=self.engine.live_info()))
            time.sleep(interval)

    # ------------------------------------------------------------------ the busy loop

    def run(self) -> None:
        engine, handoff = self.engine, self.handoff
        engine.on_step_ended(self.end_step)     # (an engine that takes several steps of its own in one)
        engine.on_input_waiting(self._input_next)
        while not self.shutting_down.is_set():
            handoff.handle_resends(on_wait=self._step, busy=engine.has_work)
            # 1. take input: block briefly only when the engine has nothing to do; take none while
            #    a downstream has no room for a streamed job's first window (the stage's watermark).
            #    An engine that steps on its own (vLLM's core in a process) is taken from while it
            #    computes, up to the moment its next step's outputs are there: a wave of new jobs,
            #    each rendered and tokenized here, never holds back the running ones' next tokens.
            while len(self.running) < self.stage.max_inflight and not self.shutting_down.is_set() \
                    and not handoff.backlog():
                if not self._take_input() or engine.outputs_waiting():
                    break
            if self._adapters is not self._engine_adapters:
                try:
                    self._sync_adapters()
                except Exception:
                    logging.getLogger("omnid.worker").exception("changing the stage's adapters failed")
            # 2. abort what was cancelled, step the engine
            self._loop_stepping = True
            try:
                self._step()
            finally:
                self._loop_stepping = False
            # 3. emit outputs of the requests that completed (the same: the rest after the next step)
            for job in [j for j, running in self.running.items() if running.request.done]:
                self._complete(self.running.pop(job))     # (no local keeps the job's inputs alive)
                if engine.outputs_waiting():
                    break
            handoff.offer_windows()
            self.flush(more_soon=self._steps_on())
            handoff.prune()
            # 4. every request waits for its next window: sleep until one (or a cancel) arrives
            self.wakeup.clear()                 # before looking: a window that comes after wakes us
            if engine.has_work() and not engine.ready():
                self.wakeup.wait(0.05)
        engine.close()

    def _input_next(self) -> bool:
        """The engine's probe (main thread, in a step): a job waits in the input queue that the busy
        loop takes right after this step (its own step, not one a hand-off or a resend waits in; a
        place free, no downstream backlog)."""
        return self._loop_stepping and not self.handoff.backlog() and self.intake.queue.qsize() > 0 \
            and sum(not job.request.done for job in self.running.values()) < self.stage.max_inflight

    def _take_input(self) -> bool:
        """Move one item from the input queue into the engine; False when there is none.

        (A method of its own so that nothing of the job stays referenced in the loop's locals:
        a job's inputs, and the shared memory they may sit on, go as soon as the job does.)
        """
        item = self.intake.take(wait=not self.engine.has_work())
        if item is None:
            return False
        job = self._assemble(item)
        if job is None:
            return True
        self.running[job.id] = job
        self.post(P.Started(job=job.id))
        self.flush()                        # before `add`: a plain function runs to its end in it
        ctx = job.request
        try:
            if self._adapters is not self._engine_adapters or ctx.params.get("adapter") or ctx.params.get("adapters"):
                self._sync_adapters(job_adapters(merged(self.stage.defaults, ctx.params)))
            t0 = time.perf_counter()
            self.engine.add(ctx)                # (a plain function runs here; a session opens: its prefill)
            self.busy_s += time.perf_counter() - t0
        except Exception as e:                 # per-request error: the engine lives on
            ctx.fail(f"{type(e).__name__}: {e}")
        return True

    def _step(self) -> None:
        """Abort the cancelled requests, then advance the engine by one step.

        Also called while a hand-off waits at a downstream watermark, so that a batching
        engine keeps serving (and aborting) its other requests meanwhile.
        """
        engine = self.engine
        aborted = False
        for job, running in list(self.running.items()):
            ctx = running.request
            if not ctx.done and self.jobs.is_dead(job):
                try:
                    engine.abort(job)          # idempotent in every engine
                except Exception as e:
                    ctx.fail(f"abort failed: {type(e).__name__}: {e}")
                ctx.stopped()
                aborted = True
        self.handoff.offer_windows()
        if aborted or not engine.has_work():
            return      # (aborted: the loop frees their places and takes the next jobs before a step)
        t0 = time.perf_counter()
        try:
            engine.step()
            self.busy_s += time.perf_counter() - t0     # (the capacity a real-time pipeline measures)
            self.flush(more_soon=self._steps_on())
        except Exception as e:
            self.flush()
            if vllm_compat.is_engine_dead(e):
                raise                           # sticky: this worker exits and is restarted
            # A request the engine could not serve (a bad parameter value, say): fail what was
            # in flight, and keep the engine for the next jobs.
            error = clip(f"{type(e).__name__}: {e}")
            for job, running in list(self.running.items()):
                ctx = running.request
                if not ctx.done:
                    ctx.fail(error)
                    try:
                        engine.abort(job)
                    except Exception:
                        pass

    def _steps_on(self) -> bool:
        """Another short engine step follows at once (the reporter may join this step's segments
        with its, while the supervisor has not read the last ones)."""
        engine = self.engine
        caps = getattr(engine, "capabilities", None)        # (none while the engine loads)
        return caps is not None and caps.short_steps and engine.has_work() and engine.ready()

    def _assemble(self, item: WorkItem) -> WorkerJob | None:
        """Gather a job's parts (one per incoming edge); the job, with its request, once all are here.
        The job's pipeline is resolved by its key once, by its first part, and kept on its `WorkerJob`."""
        known = self.jobs.get(item.job)     # (a lone read: a job's pipeline, once set, never changes)
        pipeline = known.pipeline if known is not None and known.pipeline is not None \
            else self._pipeline(item.pipeline)      # (may wait for a reload: not under the lock)
        expected = max(1, len(pipeline.incoming(self.stage.name)))
        with self.jobs.lock:                # checked under the lock: a Forget cannot slip in between
            if self.jobs.is_dead(item.job):
                self.intake.dropped += 1
                return None
            entry = self.jobs.entry(item.job)
            pipeline = entry.pipeline = entry.pipeline or pipeline
            parts = [p for p in entry.parts if p.src != item.src] + [item]
            if len(parts) < expected:
                entry.parts = parts
                return None
            entry.parts = []
        inputs: dict[str, Any] = {}
        for p in parts:
            inputs.update(p.inputs)
        if item.window is not None:         # a streamed input: the function iterates its windows
            with self.jobs.lock:
                found = self.jobs.get(item.job)
                stream = found.streams.get(item.src) if found is not None else None
            if stream is None:              # forgotten meanwhile
                return None
            inputs = {key: InputStream(stream, key) for key in stream.keys}
        entry.item = item
        job = item.job
        streaming = [e for e in pipeline.outgoing(self.stage.name) if e.window > 0]
        live_outputs = entry.live_outputs = self.sink.open_live(job, pipeline)

        # The context's hooks find the job by its id (`running`): holding it would be a reference
        # cycle through `entry.ctx`, keeping the job's inputs until the cyclic GC runs.
        def on_segment(outputs: dict[str, Any], is_last: bool) -> str | None:
            running = self.running.get(job)
            error = self.handoff.on_segment(running, item, streaming, outputs, is_last) if running else None
            if error is not None:
                return error
            if live_outputs is not None and outputs:
                live_outputs.append(pipeline.kept(self.stage.name, outputs))
            return None

        ctx = RequestContext(
            job=job, stage=self.stage.name, inputs=inputs, params=dict(item.params.get(self.stage.name, {})),
            priority=item.priority,
            trace_headers=self.tracer.headers(job) if self.tracer is not None else None,
            wants=self.stage.tensor_outputs & (pipeline.asks(self.stage.name) | frozenset(self.stage.outputs)))
        ctx.attach(emit=self.post, is_cancelled=lambda: self.jobs.is_dead(job), on_segment=on_segment,
                   is_held=lambda: self.handoff.held(self.running.get(job), streaming, self.stage.queue_capacity))
        entry.ctx = ctx
        return entry

    def _complete(self, job: WorkerJob) -> None:
        """A request ended: report it, hand its outputs on; the job keeps no more of it here."""
        ctx, item = job.request, job.item
        job.ctx = job.item = None
        assert item is not None
        if job.live_outputs is not None:
            job.live_outputs.flush()        # what it streamed is in its files before it is reported
        if ctx.outcome is Outcome.FAILED:
            try:
                self.engine.abort(ctx.job)      # a request that failed mid-way leaves the engine too
            except Exception:
                pass
        pipeline = job.pipeline
        assert pipeline is not None         # (set by `_assemble`)
        try:
            self._report(job, ctx, item, pipeline)
        finally:
            writer, job.live_outputs = job.live_outputs, None
            self.sink.close_live(ctx.job, pipeline, writer)

    def _report(self, job: WorkerJob, ctx: RequestContext, item: WorkItem, pipeline: PipelineConfig) -> None:
        """Tell the supervisor how the request ended; hand its outputs on (or write them, in a last stage)."""
        builders, job.builders = job.builders, {}
        if ctx.outcome is Outcome.STOPPED or self.jobs.is_dead(ctx.job):    # a job that ended meanwhile writes nothing
            self.post(P.Stopped(job=ctx.job))
            return
        if ctx.outcome is Outcome.FAILED:
            self.post(P.Failed(job=ctx.job, error=clip(ctx.error or "failed"),
                               code=ctx.error_code or ErrorCode.STAGE_FAILED))
            return
        elapsed = (ctx.ended or time.monotonic()) - ctx.started
        edges = pipeline.outgoing(self.stage.name)
        if self.sink.is_for(pipeline):      # a sink (or a kept stage): outputs that are the job's
            try:
                events = self.sink.write(ctx.job, pipeline, ctx.outputs or {})
            except Exception as e:
                self.post(P.Failed(job=ctx.job, error=clip(f"writing outputs failed: {type(e).__name__}: {e}"),
                                   code=ErrorCode.OUTPUT_FAILED))
                return
            for ev in events:
                self.post(ev)
            if not edges:
                self.post(P.Finished(job=ctx.job, elapsed_s=elapsed, usage=ctx.usage, finish_reason=ctx.finish_reason))
                return
        handoffs = self.handoff.build(job, ctx, item, edges, builders)
        if handoffs is None:
            return
        self.post(P.Finished(job=ctx.job, elapsed_s=elapsed, usage=ctx.usage, finish_reason=ctx.finish_reason))
        self.handoff.hand_off(job, handoffs, on_wait=self._step, busy=self.engine.has_work)


class _NoEngine(Engine):
    """Stands in for the engine while it loads: has no work, takes none."""

    def add(self, ctx: RequestContext) -> None:
        ctx.fail("the engine is not loaded")

    def step(self) -> None:
        pass

    def abort(self, job: str) -> None:
        pass

    def has_work(self) -> bool:
        return False


def _gpu_memory() -> int | None:
    """The GPU memory this worker holds, as nvidia-smi counts it where NVML can tell (its CUDA
    context, torch's reserve and any library's own allocations, its children's too), else torch's
    reserved memory (which leaves the context out). None until the worker has used CUDA."""
    torch = sys.modules.get("torch")
    try:
        if torch is None or not torch.cuda.is_available() or not torch.cuda.is_initialized():
            return None
        used = _nvml_memory()
        if used is not None:
            return used
        return int(sum(torch.cuda.memory_reserved(i) for i in range(torch.cuda.device_count())))
    except Exception:
        return None


_nvml_state: list[bool] = []         # [True] once NVML answered, [False] once it could not


def _nvml_memory() -> int | None:
    """The memory NVML lists for this process and its children, on every GPU (NVML ignores
    CUDA_VISIBLE_DEVICES); None without pynvml (nvidia-ml-py), or where NVML lists none of them
    (a pid namespace it does not see through)."""
    if _nvml_state == [False]:
        return None
    try:
        import importlib

        import psutil
        pynvml: Any = importlib.import_module("pynvml")    # nvidia-ml-py (vLLM's too); no type hints
        if not _nvml_state:
            pynvml.nvmlInit()
            _nvml_state.append(True)
        pids = {os.getpid(), *(c.pid for c in psutil.Process().children(recursive=True))}
        used, seen = 0, False
        for i in range(pynvml.nvmlDeviceGetCount()):
            for proc in pynvml.nvmlDeviceGetComputeRunningProcesses(pynvml.nvmlDeviceGetHandleByIndex(i)):
                if proc.pid in pids and proc.usedGpuMemory is not None:
                    used, seen = used + int(proc.usedGpuMemory), True
        return used if seen else None
    except Exception:
        if not _nvml_state:
            _nvml_state.append(False)    # no pynvml, or no NVML: torch's figure from now on
        return None
