"""The daemon: start-up, the supervisor's main loop, and shutdown.

Runs in the supervisor process's main thread, in one asyncio event loop
(stage handles, scheduler and API all live on it). The recipe:

1. take the GPU lock files (fail at once, naming the holder, if taken);
2. open the socket (or take it from systemd) and serve the API, so
   `/v1/health` answers while models load and `/v1/ready` says which are not warm;
3. start every stage worker in parallel (one loader per device at a time);
   the first worker that dies while loading aborts the start, reported
   with its stage name and exit status, and no child is left behind;
4. READY=1 to systemd; then every second: heartbeat checks, watchdog ping;
5. on SIGTERM/SIGINT: fail what is still live, stop the workers (grace, then
   SIGKILL), release the locks, remove the socket.
"""

from __future__ import annotations

import asyncio
import grp
import os
import shutil
import signal
import socket
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import structlog
from aiohttp import web

from omnid import __version__, systemd
from omnid.config import Config
from omnid.locks import DeviceBusy, DeviceLocks
from omnid.metrics import Metrics
from omnid.store import JobStore, StateDirBusy
from omnid.supervisor.api import Api
from omnid.supervisor.scheduler import Scheduler
from omnid.supervisor.stage import StageHandle

log = structlog.get_logger("omnid.daemon")


class StartupError(Exception):
    """The daemon cannot start; the message says why."""


def open_listening_socket(path: Path, mode: int, group: str | None) -> tuple[socket.socket, bool]:
    """The API socket: systemd's (socket activation), or a new one at `path`.

    Returns the socket and whether we created the file (and so remove it at exit).
    """
    inherited = systemd.listen_fds()
    if inherited:
        return inherited[0], False
    path.parent.mkdir(parents=True, exist_ok=True)
    if os.path.lexists(path):
        if not path.is_socket():       # a typo in daemon.socket must not delete someone's file
            raise StartupError(f"{path} exists and is not a socket; remove it or set daemon.socket")
        probe = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        try:
            probe.connect(str(path))
        except OSError:
            path.unlink()              # stale: its daemon is gone
        else:
            raise StartupError(f"another omnid is already listening on {path}")
        finally:
            probe.close()
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    old = os.umask(0o177)              # no window where the socket is open to all
    try:
        sock.bind(str(path))
    finally:
        os.umask(old)
    if group:
        try:
            os.chown(path, -1, grp.getgrnam(group).gr_gid)
        except KeyError:
            raise StartupError(f"daemon.socket_group: no group {group!r}") from None
    os.chmod(path, mode)
    sock.listen(128)
    return sock, True


class Daemon:
    def __init__(self, config: Config) -> None:
        self.config = config
        self.pid = os.getpid()
        self.started = time.time()
        self.version = __version__
        self.stopping = False
        self.stages: dict[str, StageHandle] = {}
        self.store: JobStore = None  # type: ignore[assignment]
        self.scheduler: Scheduler = None  # type: ignore[assignment]
        self.metrics: Metrics = None  # type: ignore[assignment]
        self._stop = asyncio.Event()

    def accepted_params(self, stage: str) -> frozenset[str] | None:
        return self.config.stages[stage].accepted_params

    def request_stop(self) -> None:
        self._stop.set()

    async def run(self) -> int:
        """Run until SIGTERM/SIGINT. Returns the exit status."""
        cfg = self.config.daemon
        loop = asyncio.get_running_loop()
        for sig in (signal.SIGTERM, signal.SIGINT):
            loop.add_signal_handler(sig, self.request_stop)
        locks = DeviceLocks(cfg.lock_dir, owner=f"omnid {self.config.source or ''}".strip())
        data_dir = Path(tempfile.mkdtemp(prefix="omnid-data-"))
        runner: web.AppRunner | None = None
        sock_path: Path | None = None
        try:
            try:
                locks.acquire(self.config.devices)
            except DeviceBusy as e:
                raise StartupError(f"{e}; another omnid or GPU job holds it") from None
            except OSError as e:
                raise StartupError(f"cannot create lock files in {cfg.lock_dir}: {e.strerror}") from None
            try:
                self.store = JobStore(cfg.state_dir)
            except StateDirBusy as e:
                raise StartupError(str(e)) from None
            except OSError as e:
                raise StartupError(f"cannot open the state dir {cfg.state_dir}: {e.strerror or e}") from None
            recovered = self.store.recover()
            if recovered:
                log.warning("jobs interrupted by the last shutdown marked failed", count=len(recovered))
            device_locks = {d: asyncio.Lock() for d in self.config.devices}
            for name, stage in self.config.stages.items():
                self.stages[name] = StageHandle(self.config, stage, data_dir, self.store.jobs_dir, device_locks,
                                                self._on_message, self._on_exit)
            self.scheduler = Scheduler(self.config, self.store, self.stages,
                                       lambda stage: data_dir / f"{stage}.sock")
            self.metrics = Metrics(self.stages)
            self.scheduler.metrics = self.metrics
            try:
                sock, created = open_listening_socket(cfg.socket, cfg.socket_mode, cfg.socket_group)
            except OSError as e:
                raise StartupError(f"cannot listen on {cfg.socket}: {e.strerror or e}") from None
            sock_path = cfg.socket if created else None
            runner = web.AppRunner(Api(self).app, access_log=None, handle_signals=False)
            await runner.setup()
            await web.SockSite(runner, sock).start()
            where = str(cfg.socket) if created else f"{sock.getsockname() or 'an unnamed socket'} (from systemd)"
            log.info("listening", socket=where, stages=len(self.stages), pid=self.pid)
            await self._start_stages()
            if self._stop.is_set():
                return 0
            systemd.notify(f"READY=1\nSTATUS=serving {len(self.config.pipelines)} pipelines")
            log.info("ready", startup_s=round(time.time() - self.started, 3))
            await self._main_loop()
            return 0
        except StartupError as e:
            log.error("cannot start", error=str(e))
            print(f"omnid: {e}", flush=True, file=sys.stderr)
            return 1
        finally:
            self.stopping = True
            systemd.notify("STOPPING=1")
            if self.scheduler is not None:
                self.scheduler.shutdown()
            if runner is not None:
                await runner.cleanup()
            await asyncio.gather(*(h.stop(cfg.stop_grace_s) for h in self.stages.values()))
            locks.release()
            shutil.rmtree(data_dir, ignore_errors=True)
            if sock_path is not None:
                try:
                    sock_path.unlink()
                except FileNotFoundError:
                    pass
            if self.store is not None:
                self.store.close()
            log.info("stopped")

    async def _start_stages(self) -> None:
        """Start every worker; abort at the first one that dies while loading."""
        tasks = {asyncio.create_task(h.start(), name=f"start-{h.name}"): h for h in self.stages.values()}
        stop = asyncio.create_task(self._stop.wait())
        pending = set(tasks) | {stop}
        try:
            while len(pending) > 1 or stop not in pending:
                done, pending = await asyncio.wait(pending, return_when=asyncio.FIRST_COMPLETED)
                if stop in done:
                    return
                for t in done:
                    h = tasks[t]
                    t.result()
                    if h.state == "failed":
                        raise StartupError(f"stage {h.name!r} failed to start: {h.last_error}")
                if pending == {stop}:
                    return
        finally:
            for t in pending:
                t.cancel()

    async def _main_loop(self) -> None:
        watchdog = systemd.watchdog_interval()
        last_ping = 0.0
        while not self._stop.is_set():
            try:
                await asyncio.wait_for(self._stop.wait(), timeout=min(1.0, watchdog or 1.0))
            except asyncio.TimeoutError:
                pass
            for h in self.stages.values():
                h.check_heartbeat()
            if watchdog and time.monotonic() - last_ping >= watchdog:
                systemd.notify("WATCHDOG=1")
                last_ping = time.monotonic()

    def _on_message(self, handle: StageHandle, msg: Any) -> None:
        if self.scheduler is not None:
            self.scheduler.on_message(handle, msg)

    def _on_exit(self, handle: StageHandle, reason: str) -> None:
        if self.scheduler is not None:
            self.scheduler.on_exit(handle, reason)


def run(config: Config) -> int:
    """Library entry: run a daemon for `config` in this process until stopped."""
    return asyncio.run(Daemon(config).run())
