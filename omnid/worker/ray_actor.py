"""A stage worker placed on a Ray node: the same `StageWorker`, run inside a Ray actor.

The supervisor (`omnid.supervisor.workers.ray_stage.RayStageHandle`) creates one `StageActor` per
Ray-placed replica, with `max_restarts = 0`: a dead actor is a dead worker, and omnid's own
supervisor restarts it, as it restarts a local one. Only the worker's two channels differ from a
local worker's, and only here:

- control: `QueueChannel` (a `ControlChannel`). The supervisor calls `control(messages)` (Cancel,
  Forget, Resend, Shutdown ...) and long-polls `next_messages(timeout)` for the worker's events
  (Ready, Heartbeat, Started, Finished ...): the pipe's two directions, as Ray calls.
- data in: `admit(payload, buf, size)`, called by the supervisor's bridge (a data-plane listener at
  this replica's usual address on the supervisor's machine): the item's pickle, its large values
  (tensors, arrays, large bytes) laid out in one uint8 array, and the answer is the local
  listener's (admitted, dropped, full, or closing). It blocks at the input queue's watermark,
  so the sender upstream waits, as it does for a local worker.
- data out: `RaySender` (a `DataTransport`). A hand-off, an offered window, or a last stage's
  outputs (encoded into files here) become requests on an `Outbox` lane, which the supervisor
  long-polls (`next_outbound`) and answers (`answer`) once it has delivered them on its
  machine. So the values are *return values*, owned by the supervisor (they outlive this actor),
  and a hand-off waits for the downstream's room exactly as a local one does.

Tensors travel as arrays: each large value is its raw bytes in the one uint8 array, with dtype and
shape in the pickle (`omnid.dataplane.shm`'s codec; bfloat16 too). Arrays arrive zero-copy and read-only
where Ray gives it (same node); a tensor is copied once into memory of its own (torch cannot mark a
tensor read-only, and the received buffer must never be shared-writable).

Its start-up is a local worker's (`omnid.worker.bootstrap.Start`), with this actor's hooks
(`RayStart`): output over the channel, Ray's GPUs, `Ready` once `admit` is served, an `EXITING`
after a planned stop.

Threads in the actor: Ray's (calls, up to `MAX_CONCURRENCY` at once, and `admit` calls up to
`DATA_CONCURRENCY` in a group of their own), the worker's main thread
(engine load, then the busy loop), its control and heartbeat threads. The actor's process ends with
`os._exit` like a local worker's, so Ray reports it dead at once.
"""

from __future__ import annotations

import io
import itertools
import os
import pickle
import queue
import socket
import threading
import time
from collections import deque
from collections.abc import Callable, Mapping
from typing import Any

import ray

from omnid import protocol as P
from omnid.dataplane import shm
from omnid.dataplane.wire import BUSY_POLL_S, OFFER_TIMEOUT_S, POLL_S, Closing, RawItem, WorkItem
from omnid.protocol import ADMITTED, CLOSING, DROPPED, EXITING, FULL, PLAIN, LogLines, Usage
from omnid.worker.bootstrap import Start
from omnid.worker.main import StageWorker

MAX_CONCURRENCY = 16     # calls at once in the default group: control, the long polls, answers
DATA_CONCURRENCY = 64    # `admit` calls at once (each may wait at the watermark): their own group, so
                         # senders waiting for room never starve the control calls and heartbeats
SINK_TIMEOUT_S = 120.0
MAX_LOG_LINE = 16 << 10


def _report_usage(channel: QueueChannel, interval: float) -> None:
    from omnid.process_stats import ProcessSampler
    sampler = ProcessSampler()
    while True:
        sample = sampler.sample(os.getpid())
        channel.send(Usage(sample.rss_bytes, sample.cpu_percent))
        time.sleep(max(interval, 1.0))


def _capture_output(channel: QueueChannel) -> None:
    """fds 1 and 2 -> a pipe whose lines go to the supervisor as `LogLines` (a local worker's go
    through a pipe to the supervisor; this one's through its control channel)."""
    read_fd, write_fd = os.pipe()
    os.dup2(write_fd, 1)
    os.dup2(write_fd, 2)
    os.close(write_fd)
    import io
    import sys
    for stream in (sys.stdout, sys.stderr):
        if isinstance(stream, io.TextIOWrapper):
            stream.reconfigure(line_buffering=True)

    def pump() -> None:
        partial = b""
        while True:
            try:
                data = os.read(read_fd, 1 << 16)
            except OSError:
                return
            if not data:
                return
            buf = partial + data
            cut = buf.rfind(b"\n")
            if cut < 0:
                whole, partial = b"", buf
            else:
                whole, partial = buf[:cut], buf[cut + 1:]
            if len(partial) >= MAX_LOG_LINE:
                whole, partial = (whole + b"\n" if whole else b"") + partial, b""
            if whole:
                channel.send(LogLines(tuple(whole.split(b"\n"))))

    threading.Thread(target=pump, name="log-pump", daemon=True).start()


class QueueChannel:
    """The worker's control channel inside the actor: messages in (`put`, from `control`) and out
    (`take`, for `next_messages`)."""

    def __init__(self) -> None:
        self._in: queue.Queue[object] = queue.Queue()
        self._out: list[object] = []
        self._cond = threading.Condition()
        self.taken = threading.Event()          # the supervisor has taken what was sent

    def send(self, obj: Any) -> None:
        with self._cond:
            self._out.append(obj)
            self.taken.clear()
            self._cond.notify_all()

    def send_bytes(self, buf: bytes) -> None:
        self.send(pickle.loads(buf))

    def recv(self) -> Any:
        return self._in.get()

    def close(self) -> None:
        pass

    def put(self, msg: object) -> None:
        self._in.put(msg)

    def take(self, timeout: float) -> list[object]:
        with self._cond:
            self._cond.wait_for(lambda: bool(self._out), timeout)
            out, self._out = self._out, []
            self.taken.set()
            return out


class Outbox:
    """Requests of the worker that the supervisor carries out on its machine, on two lanes: `send`
    (hand-offs, which may wait at a downstream's watermark) and `quick` (offered windows, a last
    stage's files), so that an offer made while a hand-off waits is not stuck behind it."""

    def __init__(self) -> None:
        self._cond = threading.Condition()
        self._lanes: dict[str, deque[tuple[int, tuple[Any, ...]]]] = {"send": deque(), "quick": deque()}
        self._results: dict[int, Any] = {}
        self._waiting: set[int] = set()
        self._seq = itertools.count(1)

    def submit(self, lane: str, request: tuple[Any, ...]) -> int:
        with self._cond:
            seq = next(self._seq)
            self._waiting.add(seq)
            self._lanes[lane].append((seq, request))
            self._cond.notify_all()
            return seq

    def result(self, seq: int, timeout: float) -> tuple[bool, Any]:
        """(True, the answer) once the supervisor answered, else (False, None) after `timeout`."""
        with self._cond:
            self._cond.wait_for(lambda: seq in self._results, timeout)
            if seq in self._results:
                self._waiting.discard(seq)
                return True, self._results.pop(seq)
            return False, None

    def forget(self, seq: int) -> None:
        """The worker gave up waiting (the job ended): a late answer is dropped."""
        with self._cond:
            self._waiting.discard(seq)
            self._results.pop(seq, None)

    def take(self, lane: str, timeout: float) -> list[tuple[int, tuple[Any, ...]]]:
        with self._cond:
            line = self._lanes[lane]
            self._cond.wait_for(lambda: bool(line), timeout)
            out = list(line)
            line.clear()
            return out

    def answer(self, seq: int, value: Any) -> None:
        with self._cond:
            if seq in self._waiting:
                self._results[seq] = value
                self._cond.notify_all()


def to_raw(item: WorkItem, min_bytes: int) -> RawItem:
    """An item in its wire form: large values (from `min_bytes`) as one uint8 array, beside the pickle."""
    encoded = shm.encode(item, min_bytes)
    if not encoded.large:
        return RawItem(payload=encoded.payload, job=item.job)
    return RawItem(payload=encoded.payload, buf=shm.pack(encoded), size=encoded.size, job=item.job)


class RaySender:
    """A `DataTransport` through the supervisor: each hand-off or offer is an `Outbox` request."""

    def __init__(self, outbox: Outbox, min_bytes: int) -> None:
        self.outbox = outbox
        self.min_bytes = min_bytes
        self.blocked_s = 0.0

    def send(self, to: str | Callable[[], str], item: WorkItem, abandon: Callable[[], bool],
             on_wait: Callable[[], None] | None = None, busy: Callable[[], bool] | None = None) -> bool:
        start = time.monotonic()
        raw = to_raw(item, self.min_bytes)
        try:
            while True:
                dst = to() if callable(to) else to
                seq = self.outbox.submit("send", ("send", dst, raw))
                while True:
                    done, answer = self.outbox.result(seq, BUSY_POLL_S if busy is not None and busy() else POLL_S)
                    if done:
                        break
                    if abandon():
                        self.outbox.forget(seq)     # the supervisor gives up on it too (the job is dead)
                        return False
                    if on_wait is not None:
                        on_wait()
                if answer == PLAIN:
                    raw = RawItem(payload=pickle.dumps(item, protocol=5), job=item.job)
                    continue
                if isinstance(answer, str):     # the supervisor could not send it: like an unpicklable output
                    raise RuntimeError(answer)
                return bool(answer)
        finally:
            self.blocked_s += time.monotonic() - start

    def offer(self, dst: str, item: WorkItem) -> bool | None:
        raw = to_raw(item, self.min_bytes)
        for _ in range(2):
            seq = self.outbox.submit("quick", ("offer", dst, raw))
            done, answer = self.outbox.result(seq, OFFER_TIMEOUT_S + 5.0)
            if not done:
                self.outbox.forget(seq)
                return None
            if answer == PLAIN:
                raw = RawItem(payload=pickle.dumps(item, protocol=5), job=item.job)
                continue
            if isinstance(answer, str):
                raise RuntimeError(answer)
            return answer if answer is None else bool(answer)
        return None

    def prune(self) -> None:
        pass


class _BufUnpickler(pickle.Unpickler):
    """Rebuilds an item whose large values sit in `buf` (`shm`'s persistent ids, offsets from 0)."""

    def __init__(self, payload: bytes, buf: Any, device: str | None) -> None:
        super().__init__(io.BytesIO(payload))
        self.buf = buf
        self.device = device

    def persistent_load(self, pid: Any) -> Any:
        if not isinstance(pid, shm.Large):
            raise pickle.UnpicklingError(f"unknown persistent id {pid!r}")
        import numpy
        raw = self.buf[pid.offset:pid.offset + pid.nbytes]
        if pid.kind == "bytes":
            return bytes(raw)
        if pid.kind == "array":
            # zero-copy where Ray gave it (read-only: the store's memory is never written through)
            return raw.view(numpy.dtype(pid.dtype)).reshape(pid.shape)
        import torch
        own = numpy.array(raw, copy=True)       # a tensor of its own: writable, private to this stage
        tensor = torch.from_numpy(own).view(getattr(torch, pid.dtype)).reshape(pid.shape)
        if pid.device != "cpu" and self.device is not None and torch.cuda.is_available():
            return tensor.to(self.device)
        return tensor


def from_raw(payload: bytes, buf: Any, device: str | None = None) -> WorkItem:
    item = pickle.loads(payload) if buf is None else _BufUnpickler(payload, buf, device).load()
    if not isinstance(item, WorkItem):
        raise ValueError(f"data item is a {type(item).__name__}, not a WorkItem")
    return item


class StageActor:
    """One Ray-placed stage worker (see the module docstring). Created by the supervisor with
    `remote_class()`, `.options(max_restarts=0, ...)`."""

    def __init__(self, spec: P.WorkerSpec) -> None:
        self.spec = spec
        self.channel = QueueChannel()
        self.outbox = Outbox()
        self.worker: StageWorker | None = None      # once its engine is loaded
        self.ready = threading.Event()
        threading.Thread(target=self._main, name="stage-main", daemon=True).start()

    # ------------------------------------------------------------------ the worker

    def location(self) -> dict[str, Any]:
        ctx = ray.get_runtime_context()
        try:
            ip = ray.util.get_node_ip_address()
        except Exception:
            ip = None
        return {"pid": os.getpid(), "node_id": ctx.get_node_id(), "node_ip": ip, "host": socket.gethostname(),
                "actor_id": ctx.get_actor_id(), "gpus": [str(g) for g in _gpu_ids()]}

    def _main(self) -> None:
        RayStart(self).run()

    def _write_sink(self, job: str, outputs: Mapping[str, Any], prefix: str) -> list[P.Output]:
        """A last stage's outputs: encoded into files here, written by the supervisor into the job's
        folder (on its machine); the `Output` events come back."""
        from omnid.worker.outputs import plan_outputs
        seq = self.outbox.submit("quick", ("sink", job, plan_outputs(outputs, prefix)))
        done, answer = self.outbox.result(seq, SINK_TIMEOUT_S)
        if not done:
            self.outbox.forget(seq)
            raise TimeoutError(f"the supervisor did not write the outputs within {SINK_TIMEOUT_S:g} s")
        if isinstance(answer, str):
            raise RuntimeError(answer)
        return list(answer)

    # ------------------------------------------------------------------ called by the supervisor

    def control(self, messages: list[object]) -> None:
        for msg in messages:
            self.channel.put(msg)

    def next_messages(self, timeout: float) -> list[object]:
        return self.channel.take(timeout)

    def next_outbound(self, lane: str, timeout: float) -> list[tuple[int, tuple[Any, ...]]]:
        return self.outbox.take(lane, timeout)

    def answer(self, seq: int, value: Any) -> None:
        self.outbox.answer(seq, value)

    @ray.method(concurrency_group="data")
    def admit(self, payload: bytes, buf: Any, size: int) -> str:
        """One data item from the bridge; blocks at the input queue's watermark (a window: never)."""
        worker = self.worker
        if worker is None or not self.ready.is_set():
            return CLOSING
        device = "cuda" if worker.stage.devices or _has_gpu() else None
        try:
            item = from_raw(payload, buf, device)
            answer = worker.admit(item)
        except Closing:
            return CLOSING
        return FULL if answer is None else ADMITTED if answer else DROPPED

    def ping(self) -> dict[str, Any]:
        return self.location()


class RayStart(Start):
    """The start-up of the worker in a `StageActor`: its output and events over the actor's channel,
    its data through the supervisor's bridge (`admit`, `RaySender`), on the GPUs Ray gave it."""

    def __init__(self, actor: StageActor) -> None:
        super().__init__(actor.spec, actor.channel)
        self.actor = actor

    def own_process(self) -> str:
        _capture_output(self.actor.channel)
        return "json"

    def environment(self, spec: P.WorkerSpec) -> P.WorkerSpec:
        gpus = os.environ.get("CUDA_VISIBLE_DEVICES")     # Ray's choice (ray.num_gpus), not `devices`
        super().environment(spec)
        if gpus is None:
            os.environ.pop("CUDA_VISIBLE_DEVICES", None)
        else:
            os.environ["CUDA_VISIBLE_DEVICES"] = gpus
        spec = self.actor.spec = with_gpus(spec, len(_gpu_ids()))
        return spec

    def make_worker(self, spec: P.WorkerSpec) -> StageWorker:
        outbox, min_bytes = self.actor.outbox, spec.config.daemon.shm_min_bytes
        return StageWorker(spec, self.actor.channel, transport=lambda: RaySender(outbox, min_bytes),
                           write_sink=self.actor._write_sink, live_sink=False)

    def load_failed(self) -> None:
        self.actor.channel.taken.wait(5.0)        # the supervisor reads why before it sees the death

    def ready(self, worker: StageWorker, info: dict[str, Any]) -> None:
        self.actor.worker = worker
        info["ray"] = self.actor.location()
        self.actor.ready.set()

    def serving(self) -> None:
        threading.Thread(target=_report_usage, args=(self.actor.channel, self.spec.config.daemon.heartbeat_interval_s),
                         name="usage", daemon=True).start()

    def stopped(self, worker: StageWorker) -> None:
        # A planned stop: the supervisor ends the actor (`ray.kill`: a death Ray knows was meant);
        # if it does not within moments, the process exits by itself.
        worker.flush()
        worker.send(EXITING)
        time.sleep(5.0)


def with_gpus(spec: P.WorkerSpec, n: int) -> P.WorkerSpec:
    """The spec as this actor's worker sees it: the GPUs Ray gave it (`ray.num_gpus`; visible to
    it as 0 .. n-1) are its stage's `devices`, so that its engine runs on them as a local worker
    runs on its `devices`."""
    if n <= 0:
        return spec
    from dataclasses import replace
    stage = replace(spec.config.stages[spec.stage].for_replica(spec.replica), devices=tuple(range(n)),
                    replica_devices=())
    config = replace(spec.config, stages={**spec.config.stages, spec.stage: stage})
    return replace(spec, config=config)


def _gpu_ids() -> list[Any]:
    try:
        return list(ray.get_gpu_ids())
    except Exception:
        return []


def remote_class() -> Any:
    """`StageActor` as a Ray actor class, with its concurrency groups."""
    return ray.remote(max_concurrency=MAX_CONCURRENCY, concurrency_groups={"data": DATA_CONCURRENCY})(StageActor)


def _has_gpu() -> bool:
    return bool(_gpu_ids())
