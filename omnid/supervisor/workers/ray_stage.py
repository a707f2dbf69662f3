"""The supervisor's side of a Ray-placed stage worker (`placement = "ray"`).

`RayStageHandle` is a `StageHandle` (same life cycle, READY, heartbeats, restart policy, listener
calls; the scheduler and `StageGroup` cannot tell them apart) whose worker is a Ray actor
(`omnid.worker.ray_actor.StageActor`) instead of a spawned process:

- spawn: the actor is created with the stage's Ray resource needs and `max_restarts = 0`;
- control: `send` queues messages that one thread hands to the actor, in order (`control`);
- the worker's messages: one thread long-polls `next_messages` and passes them to the event loop;
- death: that poll raising `RayActorError` is the worker's exit, handled exactly as a local
  worker's (its jobs fail or retry, it is restarted with backoff, or the stage is given up);
- kill (a hang, an ignored cancel, a restart): `ray.kill`.

The data plane, through a *bridge* on this machine: a data-plane listener at the replica's usual
address (`stage.N`), so upstream stages and the feeder send to it as to a local worker. Each item is
passed on as it came (its pickle and, for large values, the shared-memory slot's bytes as one
array: the supervisor never imports torch) to the actor's `admit`, whose answer (admitted,
dropped, full, closing) is the listener's: backpressure works as locally. The actor's own hand-offs,
windows and a last stage's files come back as return values of `next_outbound` (owned here), and
two threads deliver them with ordinary local senders (or write them into the job's folder).
So every item to or from a Ray-placed stage goes through this machine: one copy into Ray's object
store each way, plus the local shared-memory copy.

Threads (per incarnation of the actor): `ray-poll` (messages), `ray-control` (control messages),
`ray-out-send`, `ray-out-quick` (its outbound requests); the bridge's listener threads. Each hands
what it learns to the event loop with `call_soon_threadsafe`.
"""

from __future__ import annotations

import asyncio
import os
import queue
import signal
import threading
import time
from collections import OrderedDict
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import structlog

from omnid import protocol as P
from omnid.config import Config
from omnid.dataplane.listener import Listener
from omnid.dataplane.sender import Sender
from omnid.dataplane.shm import ShmPool
from omnid.dataplane.wire import OFFSET, POOL_REQUEST, RESERVE, SHM_ITEM, Closing, NeedsPlain, RawItem
from omnid.job_files import write_planned
from omnid.process_stats import ProcessSample
from omnid.stage_entry import ray_actor_class
from omnid.supervisor.live import Live
from omnid.supervisor.workers.documents import RayPlace, Where
from omnid.supervisor.workers.stage import StageHandle, error_summary
from omnid.supervisor.workers.stage_logs import log_file, stage_log_path, write_all
from omnid.vocabulary import WorkerState

log = structlog.get_logger("omnid.stage")

POLL_S = 0.5
# An actor Ray calls unavailable (its node unreachable for a moment, the actor restarting) is not dead:
# it is polled on for this long before it is given up as gone. Ray says ActorDiedError when it is.
UNAVAILABLE_GRACE_S = 30.0
_DEAD_KEPT = 4096
_connect_lock = threading.Lock()


def connected() -> bool:
    import ray
    return bool(ray.is_initialized())


async def connect_async(address: str) -> None:
    """Join the Ray cluster as a driver (once per daemon), without blocking the event loop (an
    unreachable cluster takes ray.init about 20 s to give up on).

    Ray installs C-level handlers for SIGTERM and SIGINT (a stack dump, then death by the signal):
    the daemon's own (drain, then exit 0) are put back, here in the event loop's (main) thread."""
    saved = {sig: signal.getsignal(sig) for sig in (signal.SIGTERM, signal.SIGINT, signal.SIGHUP)}
    try:
        await asyncio.to_thread(connect, address)
    finally:
        if threading.current_thread() is threading.main_thread():
            for sig, handler in saved.items():
                if handler is not None:
                    signal.signal(sig, handler)


def connect(address: str) -> None:
    """Join the Ray cluster as a driver (once per daemon); blocks."""
    import ray
    with _connect_lock:
        if ray.is_initialized():
            return
        t0 = time.monotonic()
        ray.init(address=address, namespace="omnid", log_to_driver=True, configure_logging=False)
        log.info("connected to Ray", address=address, seconds=round(time.monotonic() - t0, 2),
                 nodes=sum(1 for n in ray.nodes() if n.get("Alive")))


def disconnect() -> None:
    import ray
    with _connect_lock:
        if ray.is_initialized():
            ray.shutdown()


class _Bridge(Listener):
    """The Ray-placed replica's data-plane address on this machine: items are passed on unopened."""

    def _item(self, conn: Any, frame: bytearray, reserved: set[int]) -> Any:
        kind = bytes(frame[:1])
        if kind in (POOL_REQUEST, RESERVE):
            return super()._item(conn, frame, reserved)
        if kind == SHM_ITEM:
            import numpy
            (base,) = OFFSET.unpack(frame[1:1 + OFFSET.size])
            pool = self.pool
            if pool is None or base not in reserved:
                raise ValueError(f"a shared-memory item in a slot ({base}) this connection did not reserve")
            reserved.discard(base)
            size = pool.slot_size(base)
            buf = numpy.frombuffer(pool.mm, dtype=numpy.uint8, count=size, offset=base)
            return RawItem(payload=bytes(frame[1 + OFFSET.size:]), buf=buf, size=size,
                           release=lambda: pool.release(base))
        return RawItem(payload=bytes(frame))


class RayStageHandle(StageHandle):
    """One Ray-placed stage worker (a Ray actor) and its life cycle; see the module docstring."""

    def __init__(self, live: Live, name: str, data_dir: Path, jobs_dir: Path,
                 device_locks: dict[int, asyncio.Lock], replica: int = 0, config: Config | None = None) -> None:
        super().__init__(live, name, data_dir, jobs_dir, device_locks, replica, config)
        self._actor: Any = None
        self._incarnation = 0
        self._location: dict[str, Any] = {}
        self._usage = ProcessSample()
        self._dead_jobs: OrderedDict[str, None] = OrderedDict()    # cancelled or forgotten: stop delivering
        self._control: queue.Queue[object] | None = None
        self._bridge: _Bridge | None = None
        self._loop: asyncio.AbstractEventLoop | None = None

    def _socket_for(self, address: str) -> Path:
        return P.socket_path(self.data_dir, address)

    @property
    def pid(self) -> int | None:
        return self._location.get("pid") if self._actor is not None and self._became_ready else None

    @property
    def alive(self) -> bool:
        return self._actor is not None

    def where(self) -> Where:
        node = self._location.get("node_ip") if self._actor is not None else None
        where = self._location if self._actor is not None and self._location else None
        ray: RayPlace | None = None if where is None else {
            "node_id": where.get("node_id"), "node_ip": where.get("node_ip"), "node_name": where.get("node_name"),
            "host": where.get("host"), "actor_id": where.get("actor_id"), "gpus": where.get("gpus")}
        return {"placement": "ray", "node": node, "ray": ray}

    def _sample(self) -> ProcessSample:
        """RSS and CPU as the actor samples them on its node (the last report)."""
        return self._usage if self._actor is not None and self._became_ready else ProcessSample()

    def usage(self) -> int | None:
        return self._sample().rss_bytes

    # ------------------------------------------------------------------ spawn

    async def start(self) -> None:
        """Join the Ray cluster first (the first time); a cluster that cannot be joined is a worker
        that could not start: the daemon's start fails naming why, a restart is tried again later."""
        address = self.config.daemon.ray_address or "auto"
        if not connected():
            try:
                await connect_async(address)
            except Exception as e:
                self.state = WorkerState.LOADING
                self._attempt_over.clear()
                self._became_ready = False
                self._load_error = None
                self._worker_gone(None, None, f"cannot join the Ray cluster at {address}: {type(e).__name__}: "
                                              f"{error_summary(str(e), 300)}")
                return
        await super().start()

    def _spawn(self) -> None:
        self._loop = asyncio.get_running_loop()
        self._open_bridge()
        spec = P.WorkerSpec(stage=self.name, config=self.config, data_dir=self.data_dir,
                            jobs_dir=Path("/nonexistent/omnid-ray-worker"), parent_pid=os.getpid(),
                            replica=self.replica)
        options = dict(self.stage.ray.actor_options(), max_restarts=0, max_task_retries=0, name=None,
                       lifetime=None)
        env = {k: v for k, v in os.environ.items() if k == "PYTHONPATH"}
        if env:
            options["runtime_env"] = {"env_vars": env}
        self.state = WorkerState.LOADING
        self._attempt_over.clear()
        self._became_ready = False
        self._load_error = None
        self._location = {}
        actor = ray_actor_class().options(**options).remote(spec)
        self._actor = actor
        self._incarnation += 1
        inc = self._incarnation
        self._control = control = queue.Queue[object]()
        self.started_at = time.time()
        self.ready_at = None
        self.last_heartbeat = time.monotonic()
        for target, name in ((self._poll, "ray-poll"), (self._send_control, "ray-control")):
            threading.Thread(target=target, args=(actor, inc, control), name=f"{name}-{self.label}",
                             daemon=True).start()
        for lane in ("send", "quick"):          # each with a sender of its own (a Sender is single-threaded)
            sender = Sender(self._socket_for, self.config.daemon.shm_min_bytes)
            threading.Thread(target=self._outbound, args=(actor, inc, lane, sender),
                             name=f"ray-out-{lane}-{self.label}", daemon=True).start()
        log.info("stage actor created", stage=self.label, placement="ray", options=_printable(options),
                 restarts=self.restarts)

    def _open_bridge(self) -> None:
        if self._bridge is not None:
            return
        pool = ShmPool(f"{self.label}-bridge", self.stage.shm_pool_mb << 20) if self.stage.shm_pool_mb else None
        self._bridge = _Bridge(P.socket_path(self.data_dir, P.address(self.name, self.replica)), self._admit, pool)
        self._bridge.start()

    def _current(self, inc: int) -> bool:
        return inc == self._incarnation and self._actor is not None

    # ------------------------------------------------------------------ threads

    def _poll(self, actor: Any, inc: int, control: queue.Queue[object]) -> None:
        """The worker's messages, to the event loop; its death, once."""
        import ray
        unavailable_since: float | None = None
        while self._current(inc):
            try:
                messages = ray.get(actor.next_messages.remote(POLL_S))
            except Exception as e:          # ActorDiedError, RayActorError ...: the worker is gone
                now = time.monotonic()
                if _transient(e) and (unavailable_since is None or now - unavailable_since < UNAVAILABLE_GRACE_S):
                    if unavailable_since is None:
                        unavailable_since = now
                        log.warning("Ray says the stage's actor is unavailable for now; polling on",
                                    stage=self.label, error=str(e)[:300])
                    time.sleep(POLL_S)
                    continue
                self._call(self._actor_gone, inc, e)
                return
            unavailable_since = None
            if messages:
                for msg in messages:
                    if isinstance(msg, P.Ready):
                        _resolve_node(msg.info.get("ray"))
                self._call(self._on_messages, inc, messages)

    def _send_control(self, actor: Any, inc: int, control: queue.Queue[object]) -> None:
        """Control messages to the actor, in order, a batch per call."""
        import ray
        while self._current(inc):
            try:
                first = control.get(timeout=POLL_S)
            except queue.Empty:
                continue
            batch = [first]
            while True:
                try:
                    batch.append(control.get_nowait())
                except queue.Empty:
                    break
            while self._current(inc):
                try:
                    ray.get(actor.control.remote(batch))
                    break
                except Exception as e:
                    if not _transient(e):
                        return              # dead: `_poll` reports it
                    time.sleep(POLL_S)      # unavailable for now: the same batch again, in order

    def _outbound(self, actor: Any, inc: int, lane: str, sender: Sender) -> None:
        """Carry out the actor's hand-offs, offers and file writes on this machine; answer each."""
        import ray
        try:
            while self._current(inc):
                try:
                    requests = ray.get(actor.next_outbound.remote(lane, POLL_S))
                except Exception:
                    return
                sender.prune()              # a dead receiver's pool is unmapped, as a local worker does
                for seq, request in requests:
                    try:
                        answer = self._carry_out(inc, sender, request)
                    except Exception as e:
                        answer = f"{type(e).__name__}: {e}"
                    del request
                    try:
                        actor.answer.remote(seq, answer)
                    except Exception:
                        return
        finally:
            sender.close()

    def _carry_out(self, inc: int, sender: Sender, request: tuple[Any, ...]) -> Any:
        kind = request[0]
        if kind == "sink":
            _, job, planned = request
            return write_planned(job, self.jobs_dir / job, planned)
        _, dst, raw = request
        try:
            if kind == "offer":
                return sender.offer_raw(dst, raw)
            return sender.send_raw(dst, raw, abandon=lambda: raw.job in self._dead_jobs
                                   or not self._current(inc) or self._stopping)
        except NeedsPlain:
            return P.PLAIN

    def _admit(self, raw: RawItem) -> bool | None:
        """The bridge: one item for the worker (a listener thread); blocks while the worker's queue is full."""
        import ray

        actor = self._actor
        try:
            if actor is None or not self._became_ready or self._stopping:
                raise Closing()             # no worker now: the sender waits for the next one
            buf: Any = raw.buf
            if buf is not None:
                buf = ray.put(buf)          # one copy into the object store, owned here; the slot is free
        finally:
            if raw.release is not None:
                raw.release()
                raw.release = None
        try:
            answer = ray.get(actor.admit.remote(raw.payload, buf, raw.size))
        except Exception as e:
            if type(e).__name__ in ("RayActorError", "ActorDiedError", "ActorUnavailableError"):
                raise Closing() from e      # it died: the sender tries the next incarnation
            raise
        if answer == P.CLOSING:
            raise Closing()
        return True if answer == P.ADMITTED else False if answer == P.DROPPED else None

    def _call(self, fn: Any, *args: Any) -> None:
        loop = self._loop
        if loop is not None and not loop.is_closed():
            try:
                loop.call_soon_threadsafe(fn, *args)
            except RuntimeError:            # the loop closed meanwhile (shutdown)
                pass

    # ------------------------------------------------------------------ in the event loop

    def _on_messages(self, inc: int, messages: list[object]) -> None:
        if inc != self._incarnation:
            return                          # a late word of an incarnation that is gone
        for msg in messages:
            if msg == P.EXITING:            # its worker stopped as asked: end the actor
                self._end_actor()
                continue
            if isinstance(msg, P.LogLines):
                self._log_lines(msg.lines)
                continue
            if isinstance(msg, P.Usage):
                self._usage = ProcessSample(rss_bytes=msg.rss_bytes, cpu_percent=msg.cpu_percent)
                continue
            if isinstance(msg, P.Ready):
                self._location = dict(msg.info.get("ray") or {})
                self._location.setdefault("pid", msg.pid)
            self._on_message(msg)

    def _log_lines(self, lines: tuple[bytes, ...]) -> None:
        """The worker's output: into the stage's log file (`omnictl logs`), and to our stderr."""
        daemon = self.config.daemon
        log_file(stage_log_path(daemon.state_dir, self.name, self.replica), daemon.log_file_max_bytes,
                 daemon.log_file_keep).write(lines)
        try:
            write_all(2, b"".join(line + b"\n" for line in lines))
        except OSError:
            pass

    def _actor_gone(self, inc: int, error: BaseException) -> None:
        if inc != self._incarnation or self._actor is None:
            return
        pid = self._location.get("pid")
        where = self._location.get("node_ip") or "its node"
        self._actor = None
        self._control = None
        code = P.EXIT_LOAD_FAILED if self._load_error and not self._became_ready else None
        detail = _actor_error(error)
        what = "was killed (ray.kill)" if "ray.kill" in detail else f"died: {detail}"
        self._worker_gone(pid, code, f"Ray actor (pid {pid} on {where}) {what}")

    # ------------------------------------------------------------------ control

    def send(self, msg: object) -> bool:
        if isinstance(msg, (P.Cancel, P.Forget)):
            self._dead_jobs[msg.job] = None
            while len(self._dead_jobs) > _DEAD_KEPT:
                self._dead_jobs.popitem(last=False)
        control = self._control
        if control is None or self._actor is None:
            return False
        control.put(msg)
        return True

    def kill(self, reason: str, counts: bool = True) -> None:
        import ray
        actor = self._actor
        if actor is not None:
            self._policy.note_kill(counts)
            log.warning("killing stage actor", stage=self.label, pid=self._location.get("pid"), reason=reason)
            self._load_error = reason
            try:
                ray.kill(actor, no_restart=True)
            except Exception as e:
                log.warning("ray.kill failed", stage=self.label, error=str(e))

    async def stop(self, grace: float) -> None:
        """Shutdown (or sleep): ask the worker to stop, wait `grace`, then `ray.kill` the actor."""
        import ray
        self._stopping = True
        if self._restart_task is not None:
            self._restart_task.cancel()
        actor = self._actor
        if actor is None:
            self.state = WorkerState.STOPPED
            return
        self.send(P.Shutdown())
        if not self.state.warm:
            grace = 0.0
        deadline = time.monotonic() + grace
        while self._actor is actor and time.monotonic() < deadline:
            await asyncio.sleep(0.05)
        if self._actor is actor:
            try:
                ray.kill(actor, no_restart=True)
            except Exception:
                pass
            limit = time.monotonic() + 10.0
            while self._actor is actor and time.monotonic() < limit:
                await asyncio.sleep(0.02)
        if self._actor is actor:            # never heard of its death: forget it anyway
            self._actor = None
            self._incarnation += 1
        self.state = WorkerState.STOPPED

    def _end_actor(self) -> None:
        import ray
        if self._actor is not None:
            try:
                ray.kill(self._actor, no_restart=True)
            except Exception as e:
                log.warning("ray.kill failed", stage=self.label, error=str(e))

    def close_bridge(self) -> None:
        bridge, self._bridge = self._bridge, None
        if bridge is not None:
            bridge.close()


def _resolve_node(where: Any) -> None:
    """The actor's node as the cluster names it (its address and name), from its node id."""
    import ray
    if not isinstance(where, dict) or not where.get("node_id"):
        return
    try:
        for node in ray.nodes():
            if node.get("NodeID") == where["node_id"]:
                where["node_ip"] = node.get("NodeManagerAddress") or where.get("node_ip")
                where["node_name"] = node.get("NodeName")
                return
    except Exception:
        pass


def _actor_error(error: BaseException) -> str:
    """The gist of Ray's long actor-death message."""
    text = str(error)
    for marker in ("Worker exit detail:", "The actor died because", "The actor is dead because"):
        if marker in text:
            text = text[text.index(marker):].removeprefix("Worker exit detail:").strip()
            break
    text = text.split(" Some common causes include", 1)[0]
    return error_summary(text, 300) or type(error).__name__


def _printable(options: Mapping[str, Any]) -> dict[str, Any]:
    return {k: v for k, v in options.items() if k not in ("runtime_env",) and v is not None}


def _transient(error: BaseException) -> bool:
    """A Ray error that says "not now", not "dead": its actor may answer again."""
    return type(error).__name__ in ("ActorUnavailableError", "GetTimeoutError")
