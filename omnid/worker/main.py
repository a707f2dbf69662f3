"""A stage worker: the process that owns one stage's engine.

Entry point `worker_main(spec, conn)`, started by the supervisor with the
spawn method (non-daemonic: engines may start children of their own).

Threads in this process:
- main: loads the engine, then runs `StageWorker.run`, the busy loop
  (1. take input, 2. step the engine, 3. emit outputs). It blocks in the
  engine, on the input queue (briefly) and on a downstream stage's watermark.
- control: reads the supervisor's control pipe (cancel, forget, resend,
  shutdown); exits the process when the supervisor is gone.
- heartbeat: sends a heartbeat every interval, whatever the engine does, so
  the supervisor can tell a hung worker from a busy one.
- data-accept / data-conn: the stage's data-plane listener (`dataplane.Listener`).

The worker dies with its parent: PR_SET_PDEATHSIG, plus EOF on the control pipe.

Its fds 1 and 2 (and so its engine's and its children's output) are the write end of a pipe the
supervisor made for it (`_capture_output`, first thing in `worker_main`): the supervisor stores
each line in the stage's log file and forwards it to the daemon's stderr; a write blocks only
when the supervisor falls a pipe's buffer (1 MiB) behind.
"""

from __future__ import annotations

import ctypes
import os
import pickle
import queue
import shutil
import signal
import sys
import threading
import time
import traceback
from collections import OrderedDict, deque
from collections.abc import Callable
from multiprocessing.connection import Connection
from typing import Any, Protocol

from omnid import cuda_ipc
from omnid import protocol as P
from omnid.config import EdgeConfig, PipelineConfig
from omnid.dataplane import Closing, Listener, Sender, WorkItem
from omnid.engines.base import Engine, RequestContext
from omnid.shm import ShmPool
from omnid.worker.outputs import StreamWriter, clear_stream
from omnid.worker.windows import EdgeStream, InputStream, WindowBuilder

_PR_SET_PDEATHSIG = 1
_PR_SET_NAME = 15
_DEAD_JOBS_KEPT = 4096


def _die_with_parent(parent_pid: int) -> None:
    """Ask the kernel to SIGKILL us when the supervisor dies (even by SIGKILL)."""
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        libc.prctl(_PR_SET_PDEATHSIG, signal.SIGKILL, 0, 0, 0)
    except (OSError, AttributeError):
        pass
    if os.getppid() != parent_pid:   # the parent died before prctl took effect
        os._exit(P.EXIT_ORPHANED)


def _set_process_name(name: str) -> None:
    """The name `ps -o comm`, `top` and `pgrep omnid` show (15 bytes at most)."""
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        libc.prctl(_PR_SET_NAME, ctypes.c_char_p(name.encode()[:15]), 0, 0, 0)
    except (OSError, AttributeError):
        pass


def _setup_environment(spec: P.WorkerSpec) -> None:
    """Device visibility and quiet, offline libraries, before any heavy import."""
    stage = spec.config.stages[spec.stage].for_replica(spec.replica)
    os.environ["CUDA_VISIBLE_DEVICES"] = ",".join(str(d) for d in stage.devices)
    for var in ("NOTIFY_SOCKET", "WATCHDOG_USEC", "WATCHDOG_PID"):   # systemd talks to the supervisor only
        os.environ.pop(var, None)
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    os.environ.setdefault("TRANSFORMERS_VERBOSITY", "error")
    os.environ.setdefault("DIFFUSERS_VERBOSITY", "error")
    os.environ.setdefault("HF_HUB_DISABLE_PROGRESS_BARS", "1")
    if stage.engine == "vllm":
        # Keep the engine core inside this process: one stage = one process tree we own.
        os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
        os.environ.setdefault("VLLM_LOGGING_LEVEL", "WARNING")
    for k, v in stage.env.items():
        os.environ[k] = v
    # The stage's python_path serves its function and the transforms of its outgoing edges.
    sys.path[:0] = [str(p) for p in stage.python_path if str(p) not in sys.path]


class ControlChannel(Protocol):
    """The worker's end of its control channel: the supervisor's messages in, its events out.

    A local worker's is its multiprocessing pipe (`Connection`); a Ray-placed one's is a pair of
    queues inside its actor (`omnid.worker.ray_actor`). `send_bytes` takes a pickled message."""

    def send(self, obj: Any) -> None: ...

    def send_bytes(self, buf: bytes) -> None: ...

    def recv(self) -> Any: ...

    def close(self) -> None: ...


class DataTransport(Protocol):
    """How a worker hands items to other stages (`dataplane.Sender`: Unix sockets and shared
    memory on this machine; `ray_actor.RaySender`: through the supervisor's Ray bridge)."""

    blocked_s: float

    def send(self, to: str | Callable[[], str], item: WorkItem, abandon: Callable[[], bool],
             on_wait: Callable[[], None] | None = None, busy: Callable[[], bool] | None = None) -> bool: ...

    def offer(self, dst: str, item: WorkItem) -> bool | None: ...

    def prune(self) -> None: ...


# A sink's outputs -> their files in the job's folder, one `Output` event each (job, outputs, prefix).
WriteOutputs = Callable[[str, dict[str, Any], str], list[P.Output]]


class StageWorker:
    """The busy loop of one stage, and the per-job state it keeps (and cleans).

    Its two channels are pluggable (a Ray-placed worker runs this same class inside an actor):
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
        self._send_lock = threading.Lock()
        self._lock = threading.Lock()          # guards the dicts below (control thread vs main)
        self.inbox: queue.Queue[WorkItem] = queue.Queue(maxsize=self.stage.queue_capacity)
        self.dead: OrderedDict[str, str] = OrderedDict()     # job -> reason; bounded LRU
        self.partial: dict[str, list[WorkItem]] = {}         # fan-in parts waiting for the rest
        self.outbox: dict[tuple[str, str], WorkItem] = {}    # (job, dst) -> what we sent, until Forget
        self.received: set[tuple[str, str | None]] = set()   # (job, src) parts taken, until Forget
        self.resends: queue.Queue[P.Resend] = queue.Queue()
        self.reroutes: dict[tuple[str, str], int] = {}   # (job, stage) -> its new replica there, until Forget
        self.listener: Listener | None = None
        self.inflight: dict[str, RequestContext] = {}    # job -> its request, in the engine
        self.items: dict[str, WorkItem] = {}             # job -> the item that started it
        self.live_outputs: dict[str, StreamWriter] = {}  # job -> a last stage's stream files, while it runs
        # Streaming edges (window = N). Upstream side, main thread only: windows being built and
        # windows offered downstream but not yet admitted there (in order, per job and edge).
        self.builders: dict[tuple[str, str], WindowBuilder] = {}      # (job, dst)
        self.unsent: dict[tuple[str, str], deque[WorkItem]] = {}      # (job, dst)
        self.windows_sent: dict[str, int] = {}                        # dst -> windows admitted there
        make_sender: Callable[[], DataTransport] = transport or (
            lambda: Sender(spec.socket_for, spec.config.daemon.shm_min_bytes))
        self.write_sink: WriteOutputs = write_sink or self._write_sink
        self.live_sink = live_sink
        self.window_sender = make_sender()      # never blocks
        # Downstream side (under _lock): each streamed job's windows, read by its InputStreams.
        self.streams: dict[tuple[str, str | None], EdgeStream] = {}   # (job, src)
        self.wakeup = threading.Event()      # a window, an input or a cancel arrived: the loop looks again
        self._reconfigured = threading.Condition()   # `config` replaced by a reload
        self._posted: list[object] = []      # main-thread messages not sent yet (`post`, `flush`)
        self._pruned_at = 0.0
        self._flushed_at = 0.0
        self.shutting_down = threading.Event()
        self.sender = make_sender()
        self.pool: ShmPool | None = None                 # this stage's shared memory for large inputs
        self.engine: Engine = _NoEngine()          # until load_engine() returns
        self.enqueued = self.dequeued = self.dropped = self.triggers = 0

    # ------------------------------------------------------------------ plumbing

    def send(self, msg: object) -> None:
        """Send one message to the supervisor now (any thread)."""
        with self._send_lock:
            try:
                self.conn.send(msg)
            except (OSError, EOFError, BrokenPipeError):
                os._exit(P.EXIT_ORPHANED)

    def post(self, msg: object) -> None:
        """Queue a message of the main thread: what one engine step says goes in one `Batch`.

        Messages that come rarely go at once (no latency is added to a slow stream); when they
        come fast (a batch of token streams) they wait for the end of the step, or BATCH_DELAY_S.
        """
        self._posted.append(msg)
        if time.monotonic() - self._flushed_at >= BATCH_DELAY_S:
            self.flush()

    def flush(self) -> None:
        """Send the queued messages of the main thread, coalesced: a job's consecutive progress
        reports become the last one, its consecutive text segments one segment."""
        self._flushed_at = time.monotonic()
        if not self._posted:
            return
        for writer in self.live_outputs.values():
            writer.flush()                  # a step's live output segments, for ?stream=1 readers
        messages = _coalesce(self._posted)
        self._posted = []
        for data in _packs(messages):
            with self._send_lock:
                try:
                    self.conn.send_bytes(data)   # pickled once (`_packs` measured it), as send() would
                except (OSError, EOFError, BrokenPipeError):
                    os._exit(P.EXIT_ORPHANED)

    def is_dead(self, job: str) -> bool:
        return job in self.dead

    def stats(self) -> P.QueueStats:
        used, slots = self.pool.usage() if self.pool is not None else (0, 0)
        hits, misses = getattr(self.engine, "cache_counts", (0, 0))     # a diffusers stage's DiT cache
        return P.QueueStats(enqueued=self.enqueued, dequeued=self.dequeued, dropped=self.dropped,
                            depth=self.inbox.qsize(), blocked_s=self.sender.blocked_s,
                            window_triggers=self.triggers, shm_capacity=self.pool.capacity if self.pool else 0,
                            shm_used=used, shm_slots=slots, cache_hits=hits, cache_misses=misses)

    def tracked_jobs(self) -> int:
        """How many jobs this worker keeps any state for (the bounded `dead` LRU aside)."""
        while True:
            try:        # `items`/`inflight` belong to the main thread: retry if it changed them meanwhile
                with self._lock:
                    jobs = {j for j, _ in self.outbox} | set(self.partial) | {j for j, _ in self.received} \
                        | {j for j, _ in self.streams} | {j for j, _ in self.reroutes}
                windows = {j for j, _ in self.builders} | {j for j, _ in self.unsent}
                return len(jobs | windows | set(self.items) | set(self.inflight) | set(self.live_outputs))
            except RuntimeError:
                continue

    def admit(self, item: WorkItem) -> bool | None:
        """Data-plane callback (a data-conn thread): queue the item, blocking at the watermark.

        A window of a streamed job never blocks (`_admit_window`).
        """
        if item.window is not None:
            return self._admit_window(item)
        while True:
            if self.shutting_down.is_set():
                raise Closing()         # not admitted, not dropped: the sender tries our successor
            if self.is_dead(item.job):
                self.dropped += 1
                return False
            with self._lock:
                if (item.job, item.src) in self.received:
                    return True            # a resend of a part we hold already: admitted once
            try:
                self.inbox.put(item, timeout=0.1)
            except queue.Full:
                continue
            with self._lock:
                if self.is_dead(item.job):     # cancelled while we waited for room: it is dropped
                    return False               # when dequeued; keep no state for it
                self.received.add((item.job, item.src))
            self.enqueued += 1
            self.send(P.Admitted(job=item.job, src=item.src, depth=self.inbox.qsize()))
            self.wakeup.set()
            return True

    def _admit_window(self, item: WorkItem) -> bool | None:
        """A window of a streamed job (a data-conn thread); answers at once, None when there is no room.

        The first window starts the job here: it takes a place in the input queue, like any input.
        The later ones go straight to the job's stream, whose own bound is `queue_capacity` windows.
        """
        if self.shutting_down.is_set():
            raise Closing()
        index = item.window or 0
        key = (item.job, item.src)
        keys = self._stream_keys(item) if index == 0 else []     # (may wait for a reload: not under the lock)
        with self._lock:
            if self.is_dead(item.job):
                self.dropped += 1
                return False
            stream = self.streams.get(key)
            if stream is None:
                if index != 0:
                    return None                     # cannot happen: windows come in order
                job = item.job
                stream = EdgeStream(keys, self.stage.queue_capacity,
                                    is_cancelled=lambda: self.is_dead(job))
                stream.put(0, item.inputs, item.last)
                try:
                    self.inbox.put_nowait(item)
                except queue.Full:
                    return None
                self.streams[key] = stream
                self.received.add(key)
                first = True
            else:
                admitted = stream.put(index, item.inputs, item.last)
                first = False
        if first:
            self.enqueued += 1
            self.send(P.Admitted(job=item.job, src=item.src, depth=self.inbox.qsize()))
        else:
            if not admitted:
                return admitted
        self.wakeup.set()
        return True

    def _stream_keys(self, item: WorkItem) -> list[str]:
        """The inputs a streaming edge feeds: its `map`'s names, else what the first window holds."""
        for edge in self._pipeline(item.pipeline).incoming(self.stage.name):
            if edge.src == item.src and edge.map is not None:
                return list(edge.map)
        return list(item.inputs)

    def control_loop(self) -> None:
        """Control thread: apply the supervisor's messages (one handler each); exit when it is gone."""
        handlers: dict[type, Callable[[Any], None]] = {
            P.Cancel: self.on_cancel, P.Forget: self.on_forget, P.Resend: self.on_resend,
            P.Reroute: self.on_reroute, P.Shutdown: self.on_shutdown, P.Reconfigure: self.on_reconfigure,
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
        with self._lock:
            self.dead[msg.job] = msg.reason
            self._trim_dead()
            for (job, _), stream in self.streams.items():
                if job == msg.job:
                    stream.cancel()         # a function waiting for its next window stops now
        self.wakeup.set()

    def on_forget(self, msg: P.Forget) -> None:
        with self._lock:
            self.dead.setdefault(msg.job, "forgotten")
            self._trim_dead()
            self.partial.pop(msg.job, None)
            self.received = {k for k in self.received if k[0] != msg.job}
            for key in [k for k in self.outbox if k[0] == msg.job]:
                del self.outbox[key]
            for route in [k for k in self.reroutes if k[0] == msg.job]:
                del self.reroutes[route]
            for stream_key in [k for k in self.streams if k[0] == msg.job]:
                self.streams.pop(stream_key).cancel()
        self.wakeup.set()                   # the main thread drops the job's unsent windows

    def on_resend(self, msg: P.Resend) -> None:
        self.on_reroute(P.Reroute(msg.job, msg.dst, msg.replica))
        self.resends.put(msg)           # served by the main thread, between engine steps

    def on_reroute(self, msg: P.Reroute) -> None:
        with self._lock:
            if not self.is_dead(msg.job):
                self.reroutes[(msg.job, msg.stage)] = msg.replica

    def on_shutdown(self, msg: P.Shutdown) -> None:
        self.shutting_down.set()
        if self.listener is not None:
            self.listener.close()       # senders now wait for the next worker at our address

    def address(self, item: WorkItem, dst: str) -> str:
        """Where the job's work for stage `dst` goes: the replica the supervisor chose (or moved it to)."""
        replica = self.reroutes.get((item.job, dst))
        return P.address(dst, item.routes.get(dst, 0) if replica is None else replica)

    def on_reconfigure(self, msg: P.Reconfigure) -> None:
        with self._reconfigured:
            self.config = msg.config
            self._reconfigured.notify_all()

    def _pipeline(self, key: str) -> PipelineConfig:
        """A pipeline by the key its jobs carry. A job of a pipeline added by a reload may reach
        this worker (data plane) just before the new config does (control pipe): wait for it."""
        with self._reconfigured:
            self._reconfigured.wait_for(lambda: key in self.config.pipelines, timeout=10.0)
            return self.config.pipelines[key]

    def _trim_dead(self) -> None:
        while len(self.dead) > _DEAD_JOBS_KEPT:
            self.dead.popitem(last=False)

    def heartbeat_loop(self) -> None:
        interval = self.config.daemon.heartbeat_interval_s
        while True:
            self.send(P.Heartbeat(ts=time.time(), stats=self.stats(), running=tuple(self.inflight),
                                  gpu_memory_bytes=_gpu_memory(), tracked_jobs=self.tracked_jobs(),
                                  windows=tuple(self.windows_sent.items()), rss_bytes=_own_rss()))
            time.sleep(interval)

    # ------------------------------------------------------------------ the busy loop

    def run(self) -> None:
        engine = self.engine
        while not self.shutting_down.is_set():
            self._handle_resends()
            # 1. take input: block briefly only when the engine has nothing to do; take none while
            #    a downstream has no room for a streamed job's first window (the stage's watermark)
            while len(self.inflight) < self.stage.max_inflight and not self.shutting_down.is_set() \
                    and not self._window_backlog():
                if not self._take_input():
                    break
            # 2. abort what was cancelled, step the engine
            self._step()
            # 3. emit outputs of the requests that completed
            for job in [j for j, ctx in self.inflight.items() if ctx.done]:
                self._complete(self.inflight.pop(job))     # (no local keeps the job's inputs alive)
            self._offer_windows()
            self.flush()
            if time.monotonic() >= self._pruned_at + 1.0:
                self._pruned_at = time.monotonic()
                self.sender.prune()             # a dead downstream's pool is unmapped within a second
                self.window_sender.prune()
            # 4. every request waits for its next window: sleep until one (or a cancel) arrives
            self.wakeup.clear()                 # before looking: a window that comes after wakes us
            if engine.has_work() and not engine.ready():
                self.wakeup.wait(0.05)
        engine.close()

    def _take_input(self) -> bool:
        """Move one item from the input queue into the engine; False when there is none.

        (A method of its own so that nothing of the job stays referenced in the loop's locals:
        a job's inputs, and the shared memory they may sit on, go as soon as the job does.)
        """
        try:
            item = self.inbox.get(timeout=0.05) if not self.engine.has_work() else self.inbox.get_nowait()
        except queue.Empty:
            return False
        self.dequeued += 1
        ctx = self._assemble(item)
        if ctx is None:
            return True
        self.inflight[ctx.job] = ctx
        self.post(P.Started(job=ctx.job))
        self.flush()                        # before `add`: a plain function runs to its end in it
        try:
            self.engine.add(ctx)
        except Exception as e:                 # per-request error: the engine lives on
            ctx.fail(f"{type(e).__name__}: {e}")
        return True

    def _step(self) -> None:
        """Abort the cancelled requests, then advance the engine by one step.

        Also called while a hand-off waits at a downstream watermark, so that a batching
        engine keeps serving (and aborting) its other requests meanwhile.
        """
        engine = self.engine
        for job, ctx in list(self.inflight.items()):
            if not ctx.done and self.is_dead(job):
                try:
                    engine.abort(job)          # idempotent in every engine
                except Exception as e:
                    ctx.fail(f"abort failed: {type(e).__name__}: {e}")
                ctx.stopped()
        self._offer_windows()
        if not engine.has_work():
            return
        try:
            engine.step()
            self.flush()
        except Exception as e:
            self.flush()
            if type(e).__name__ == "EngineDeadError":
                raise                           # sticky: this worker exits and is restarted
            # A request the engine could not serve (a bad parameter value, say): fail what was
            # in flight, and keep the engine for the next jobs.
            error = _clip(f"{type(e).__name__}: {e}")
            for job, ctx in list(self.inflight.items()):
                if not ctx.done:
                    ctx.fail(error)
                    try:
                        engine.abort(job)
                    except Exception:
                        pass

    def _assemble(self, item: WorkItem) -> RequestContext | None:
        """Gather a job's parts (one per incoming edge); a context once all are here."""
        pipeline = self._pipeline(item.pipeline)
        expected = max(1, len(pipeline.incoming(self.stage.name)))
        with self._lock:                    # checked under the lock: a Forget cannot slip in between
            if self.is_dead(item.job):
                self.dropped += 1
                return None
            parts = self.partial.setdefault(item.job, [])
            parts = [p for p in parts if p.src != item.src] + [item]
            if len(parts) < expected:
                self.partial[item.job] = parts
                return None
            self.partial.pop(item.job, None)
        inputs: dict[str, Any] = {}
        for p in parts:
            inputs.update(p.inputs)
        if item.window is not None:         # a streamed input: the function iterates its windows
            with self._lock:
                stream = self.streams.get((item.job, item.src))
            if stream is None:              # forgotten meanwhile
                return None
            inputs = {key: InputStream(stream, key) for key in self._stream_keys(item)}
        self.items[item.job] = item
        job = item.job
        outgoing = pipeline.outgoing(self.stage.name)
        streaming = [e for e in outgoing if e.window > 0]
        sink_dir = self.spec.jobs_dir / job if self.stage.name in pipeline.sinks else None
        prefix = self._sink_prefix(pipeline)
        if sink_dir is not None and self.live_sink:
            clear_stream(sink_dir, prefix)  # what an earlier attempt (before a retry) streamed
            live_outputs = self.live_outputs[job] = StreamWriter(sink_dir, prefix)

        def emit(kind: str, data: dict[str, Any]) -> None:
            self._emit(job, kind, data)

        def on_segment(outputs: dict[str, Any], is_last: bool) -> str | None:
            for edge in streaming:
                builder = self.builders.setdefault((job, edge.dst), WindowBuilder(edge.sizes))
                window = builder.add(outputs, is_last)
                if window is not None:
                    error = self._queue_window(item, edge, *window, last=builder.closed)
                    if error is not None:
                        return error
            if sink_dir is not None and outputs and self.live_sink:
                kept = pipeline.kept(self.stage.name, outputs)
                if kept:
                    live_outputs.append(kept)
            return None

        def held() -> bool:                 # windows for a downstream pile up: let it catch up
            return any(len(self.unsent.get((job, e.dst), ())) >= self.stage.queue_capacity for e in streaming)

        ctx = RequestContext(job=job, stage=self.stage.name, inputs=inputs,
                             params=dict(item.params.get(self.stage.name, {})),
                             _emit=emit, _is_cancelled=lambda: self.is_dead(job), _on_segment=on_segment,
                             _is_held=held, wants=self.stage.tensor_outputs & (
                                 pipeline.asks(self.stage.name) | frozenset(self.stage.outputs)))
        return ctx

    def _write_sink(self, job: str, outputs: dict[str, Any], prefix: str) -> list[P.Output]:
        from omnid.worker.outputs import write_outputs
        return write_outputs(job, self.spec.jobs_dir / job, outputs, prefix)

    def _sink_prefix(self, pipeline: PipelineConfig) -> str:
        """How this last stage's outputs are named apart from the other last stages' ones."""
        return f"{self.stage.name}." if len(pipeline.sinks) > 1 else ""

    def _emit(self, job: str, kind: str, data: dict[str, Any]) -> None:
        if kind == "progress":
            self.post(P.Progress(job=job, done=data["done"], total=data["total"]))
        elif kind == "segment":
            self.post(P.Segment(job=job, index=data["index"], is_last=data["is_last"], text=data["text"],
                                audio_s=float(data.get("audio_s") or 0.0)))

    def _complete(self, ctx: RequestContext) -> None:
        if ctx.outcome == "failed":
            try:
                self.engine.abort(ctx.job)      # a request that failed mid-way leaves the engine too
            except Exception:
                pass
        item = self.items.pop(ctx.job)
        pipeline = self._pipeline(item.pipeline)
        try:
            self._report(ctx, item, pipeline)
        finally:
            writer = self.live_outputs.pop(ctx.job, None)
            if writer is not None:
                writer.close()
            if self.stage.name in pipeline.sinks and self.live_sink:
                # A last stage's segments were streamed to files for `?stream=1` readers (who keep
                # their open file); from now on the job's outputs are its final files.
                clear_stream(self.spec.jobs_dir / ctx.job, self._sink_prefix(pipeline))

    def _report(self, ctx: RequestContext, item: WorkItem, pipeline: PipelineConfig) -> None:
        """Tell the supervisor how the request ended; hand its outputs on (or write them, in a last stage)."""
        builders = {dst: self.builders.pop((j, dst)) for j, dst in list(self.builders) if j == ctx.job}
        if ctx.outcome == "stopped" or self.is_dead(ctx.job):    # a job that ended meanwhile writes nothing
            self.post(P.Stopped(job=ctx.job))
            return
        if ctx.outcome == "failed":
            self.post(P.Failed(job=ctx.job, error=_clip(ctx.error or "failed")))
            return
        elapsed = (ctx.ended or time.monotonic()) - ctx.started
        edges = pipeline.outgoing(self.stage.name)
        if self.stage.name in pipeline.sinks:      # a sink (or a kept stage): outputs that are the job's
            prefix = self._sink_prefix(pipeline)
            try:
                events = self.write_sink(ctx.job, pipeline.kept(self.stage.name, ctx.outputs or {}), prefix)
            except Exception as e:
                self.post(P.Failed(job=ctx.job, error=_clip(f"writing outputs failed: {type(e).__name__}: {e}"),
                                   code="output_failed"))
                return
            for ev in events:
                self.post(ev)
            if not edges:
                self.post(P.Finished(job=ctx.job, elapsed_s=elapsed, usage=ctx.usage))
                return
        handoffs: list[tuple[str, WorkItem]] = []
        for edge in edges:
            if edge.window > 0:             # streamed: what is left of it goes as the last window
                builder = builders.get(edge.dst) or WindowBuilder(edge.sizes)
                window = builder.finish(ctx.outputs or {})
                error = self._queue_window(item, edge, *window, last=True) if window is not None else None
                if error is not None:
                    self.post(P.Failed(job=ctx.job, error=_clip(error), code="edge_failed"))
                    return
                continue
            try:
                inputs = apply_edge(edge, self.stage.name, ctx.outputs or {})
            except EdgeError as e:
                self.post(P.Failed(job=ctx.job, error=_clip(str(e)), code="edge_failed"))
                return
            handoffs.append((edge.dst, WorkItem(job=ctx.job, pipeline=item.pipeline, src=self.stage.name,
                                                inputs=inputs, params=item.params, routes=item.routes)))
        self.post(P.Finished(job=ctx.job, elapsed_s=elapsed, usage=ctx.usage))
        for dst, out in handoffs:
            with self._lock:
                if self.is_dead(ctx.job):
                    return
                self.outbox[(ctx.job, dst)] = out
            self._deliver(dst, out)

    # ------------------------------------------------------------------ streaming edges

    def _queue_window(self, item: WorkItem, edge: EdgeConfig, index: int, values: dict[str, Any],
                      last: bool) -> str | None:
        """Map one window through its edge and queue it for `_offer_windows`; the error if the edge
        cannot map it."""
        if self.is_dead(item.job):
            return None
        try:
            # An empty last window only says "that was all": nothing to map.
            # After the first window, an output that only some segments carry (a vllm stage's
            # prompt_token_ids, in its first) may be absent from a window.
            inputs = apply_edge(edge, self.stage.name, values, partial=index > 0) if values else {}
        except EdgeError as e:
            return str(e)
        window = WorkItem(job=item.job, pipeline=item.pipeline, src=self.stage.name, inputs=inputs,
                          params=item.params, window=index, last=last, routes=item.routes)
        self.unsent.setdefault((item.job, edge.dst), deque()).append(window)
        return None

    def _offer_windows(self) -> None:
        """Offer each streamed job's next windows downstream, in order; never waits for room.

        A window that finds no room stays first in its job's line and is offered again on a later
        turn, while other jobs' windows go on: a downstream busy with one job's stream is never
        blocked from the windows it waits for by another job's.
        """
        for key in list(self.unsent):
            job, dst = key
            line = self.unsent[key]
            while line and not self.is_dead(job):
                try:
                    answer = self.window_sender.offer(self.address(line[0], dst), line[0])
                except Exception as e:      # a window that cannot be sent (not picklable): this job alone
                    line.clear()
                    self.post(P.Failed(job=job, error=_clip(f"streaming to stage {dst!r} failed: "
                                                           f"{type(e).__name__}: {e}"), code="edge_failed"))
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
                    self.post(P.Delivered(job=job, dst=dst))
            if not line or self.is_dead(job):
                del self.unsent[key]

    def _window_backlog(self) -> bool:
        """A downstream has no room for a streamed job's first window: take no new input."""
        return any(line and line[0].window == 0 for line in self.unsent.values())

    def _deliver(self, dst: str, item: WorkItem) -> None:
        """Hand one job's outputs to a downstream stage; blocks at its watermark.

        While it waits, the engine keeps stepping its other in-flight requests (`_step`):
        no new input is taken, so the stage as a whole still stops at the watermark.
        """
        self.flush()                        # what happened so far is known before we wait here
        try:
            ok = self.sender.send(lambda: self.address(item, dst), item, abandon=lambda: self.is_dead(item.job) or self.shutting_down.is_set(),
                                  on_wait=self._step, busy=self.engine.has_work)
        except Exception as e:              # an output that cannot be sent (not picklable): this job alone
            self.post(P.Failed(job=item.job, error=_clip(f"handing its outputs to stage {dst!r} failed: "
                                                        f"{type(e).__name__}: {e}"), code="edge_failed"))
            return
        if ok:
            self.triggers += 1
            self.post(P.Delivered(job=item.job, dst=dst))

    def _handle_resends(self) -> None:
        while True:
            try:
                msg = self.resends.get_nowait()
            except queue.Empty:
                return
            with self._lock:
                item = self.outbox.get((msg.job, msg.dst))
            if self.is_dead(msg.job):
                continue
            if item is None:
                self.post(P.ResendMissing(job=msg.job, dst=msg.dst))
            else:
                self._deliver(msg.dst, item)


BATCH_DELAY_S = 0.01
# A pipe write of up to PIPE_BUF (4096) bytes is atomic: the supervisor never finds half of one,
# even when this worker freezes mid-send. Batches stay under it.
_MAX_PACK = 4000


def _packs(messages: list[object]) -> list[bytes]:
    """The messages, pickled as few Batches (or single messages) as keep each pipe write atomic."""
    data = pickle.dumps(messages[0] if len(messages) == 1 else P.Batch(tuple(messages)),
                        protocol=pickle.HIGHEST_PROTOCOL)
    if len(messages) == 1 or len(data) <= _MAX_PACK:
        return [data]
    half = len(messages) // 2
    return _packs(messages[:half]) + _packs(messages[half:])


def _coalesce(messages: list[object]) -> list[object]:
    """Merge each job's consecutive Progress (keep the last) and consecutive Segments (join texts)."""
    out: list[object] = []
    last: dict[str, int] = {}           # job -> index in `out` of its latest message
    for msg in messages:
        job = getattr(msg, "job", None)
        at = last.get(job) if isinstance(job, str) else None
        prev = out[at] if at is not None else None
        if isinstance(msg, P.Progress) and isinstance(prev, P.Progress) and at is not None:
            out[at] = msg
            continue
        if isinstance(msg, P.Segment) and isinstance(prev, P.Segment) and at is not None:
            text = None if prev.text is None and msg.text is None else (prev.text or "") + (msg.text or "")
            out[at] = P.Segment(job=msg.job, index=prev.index, is_last=msg.is_last, text=text,
                                count=prev.count + msg.count, audio_s=prev.audio_s + msg.audio_s)
            continue
        if isinstance(job, str):
            last[job] = len(out)
        out.append(msg)
    return out


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


def _clip(text: str, limit: int = 2000) -> str:
    """Keep control messages small: one write into the pipe, read whole by the supervisor."""
    return text if len(text) <= limit else text[:limit] + " [...]"


def _own_rss() -> int | None:
    """This process's resident memory (one read of /proc/self/statm), None where there is none."""
    try:
        with open("/proc/self/statm", "rb") as f:
            return int(f.read().split()[1]) * _PAGE_SIZE
    except (OSError, ValueError, IndexError):
        return None


_PAGE_SIZE = os.sysconf("SC_PAGE_SIZE")


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


def _capture_output(log_pipe: Connection | None, log_format: str) -> str:
    """fds 1 and 2 -> the stage's log pipe, whose lines the supervisor stores in the stage's log file
    and forwards, unchanged, to its own stderr (supervisor/stage_logs.py). Returns the log format to
    use: the one the daemon's stderr calls for (`auto` looks at it here, before it is replaced).

    Without a pipe (a caller of its own): stdout joins stderr, one stream as before.
    """
    from omnid import logs
    fmt, journald = logs.resolve_format(log_format, sys.stderr)
    if log_pipe is None:
        os.dup2(2, 1)
        return fmt
    os.dup2(log_pipe.fileno(), 1)
    os.dup2(log_pipe.fileno(), 2)
    log_pipe.close()
    if journald:
        # Our lines reach journald through the supervisor unchanged: this pipe is the journal stream
        # for us and our engine's children (`logs.on_journald` then writes the `<N>` priority prefixes).
        st = os.fstat(2)
        os.environ["JOURNAL_STREAM"] = f"{st.st_dev}:{st.st_ino}"
    import io
    if isinstance(sys.stdout, io.TextIOWrapper):
        sys.stdout.reconfigure(line_buffering=True)   # a `print` reaches `omnictl logs -f` at once
    return fmt


def worker_main(spec: P.WorkerSpec, conn: Connection, log_pipe: Connection | None = None) -> None:
    """Process entry point (spawned). `log_pipe`: the write end of this stage's stdout/stderr pipe."""
    _die_with_parent(spec.parent_pid)
    label = P.replica_label(spec.stage, spec.replica)
    _set_process_name(f"omnid:{label}")
    log_format = _capture_output(log_pipe, spec.config.daemon.log_format)   # before anything is printed
    os.setpgrp()                                   # our own group: the supervisor signals the whole tree
    signal.signal(signal.SIGINT, signal.SIG_IGN)   # Ctrl-C is the supervisor's to handle
    _setup_environment(spec)
    from omnid import logs
    logs.configure(spec.config.daemon.log_level, log_format, process=f"stage:{label}",
                   stage=spec.stage)             # every record, the engine's too: structlog, `stage=NAME`
    if spec.replica:
        import structlog
        structlog.contextvars.bind_contextvars(replica=spec.replica)
    worker = StageWorker(spec, conn)
    threading.Thread(target=worker.control_loop, name="control", daemon=True).start()
    t0 = time.monotonic()
    try:
        from omnid.engines import load_engine
        worker.engine = load_engine(worker.stage)
        logs.adopt_library_loggers()               # the loggers the engine's libraries set up on import
        stage = worker.stage
        if stage.shm_pool_mb:
            worker.pool = ShmPool(stage.name, stage.shm_pool_mb << 20)
        # A stage on GPUs tells its senders which (by UUID): a CUDA tensor on one of them comes by
        # CUDA IPC, one copy on that GPU (omnid.cuda_ipc); any other is staged through the pool.
        listener = worker.listener = Listener(spec.socket_for(P.address(spec.stage, spec.replica)), worker.admit,
                                              worker.pool, device="cuda" if stage.devices else None,
                                              gpus=cuda_ipc.visible_gpus if stage.devices else None)
    except BaseException as e:
        tb = traceback.format_exc(limit=-3)
        worker.send(P.LoadFailed(error=_clip(f"{type(e).__name__}: {e}\n{tb}")))
        conn.close()
        os._exit(P.EXIT_LOAD_FAILED)
    info = dict(worker.engine.info())
    listener.start()
    worker.send(P.Ready(pid=os.getpid(), load_s=time.monotonic() - t0, info=info))
    threading.Thread(target=worker.heartbeat_loop, name="heartbeat", daemon=True).start()
    try:
        worker.run()
    except BaseException:
        traceback.print_exc()
        os._exit(1)
    os._exit(0)
