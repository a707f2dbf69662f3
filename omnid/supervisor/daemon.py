"""The daemon: start-up, the supervisor's main loop, and shutdown.

Runs in the supervisor process's main thread, in one asyncio event loop
(stage handles, scheduler and API all live on it). The recipe:

1. take the GPU lock files (fail at once, naming the holder, if taken) and the
   state dir; build the parts in dependency order (stage handles, metrics,
   scheduler, API);
2. open the socket (or take it from systemd) and serve the API, so
   `/v1/health` answers while models load and `/v1/ready` says which are not warm;
   the TCP listener too (`daemon.listen`, or systemd's TCP sockets), behind API keys;
3. start every stage worker in parallel (one loader per device at a time);
   the first worker that dies while loading aborts the start, reported
   with its stage name and exit status, and no child is left behind;
4. READY=1 to systemd; then every second: heartbeat checks, watchdog ping;
5. on SIGTERM/SIGINT: drain (no new jobs; queued ones kept for the next start;
   running ones get `drain_timeout_s` to finish), stop the workers (grace, then
   SIGKILL), release the locks, remove the socket. Jobs the store still has as
   queued or running are taken back by the next start (`Scheduler.restore`).
"""

from __future__ import annotations

import asyncio
import gc
import grp
import os
import resource
import shutil
import signal
import socket
import sqlite3
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import structlog
from aiohttp import web

from omnid import __version__, logs, paths, systemd
from omnid import protocol as P
from omnid.config import Config, is_loopback
from omnid.keys import KeyFileError, KeyStore, key_path
from omnid.locks import DeviceBusy, DeviceLeases, DeviceLocks
from omnid.retention import Retention
from omnid.store import JobStore, StateDirBusy
from omnid.supervisor import resources
from omnid.supervisor.http import trace_context
from omnid.supervisor.http.access import Access
from omnid.supervisor.http.api.app import Api, DaemonInfo, error
from omnid.supervisor.http.openai.realtime.session import RealtimeApi
from omnid.supervisor.http.openai.routes import OpenAiApi
from omnid.supervisor.jobs.scheduler import Scheduler
from omnid.supervisor.live import Live
from omnid.supervisor.metrics import Metrics
from omnid.supervisor.reload import Reloader
from omnid.supervisor.workers.stage import StageHandle
from omnid.supervisor.workers.stage_group import StageGroup
from omnid.supervisor.workers.stage_logs import DaemonLogHandler, install_daemon_log, remove_daemon_log
from omnid.tracing import Tracing
from omnid.vocabulary import DaemonState, ErrorCode, WorkerState

log = structlog.get_logger("omnid.daemon")


class StartupError(Exception):
    """The daemon cannot start; the message says why."""


# Pending connections the kernel queues for us (a burst of clients connecting at once gets no EAGAIN).
# Linux caps it at net.core.somaxconn (4096 since 5.4). Passed to aiohttp too: its SockSite listens again.
LISTEN_BACKLOG = 4096


def open_listening_socket(path: Path, mode: int, group: str | None,
                          inherited: socket.socket | None = None) -> tuple[socket.socket, bool]:
    """The API socket: systemd's (socket activation, `inherited`), or a new one at `path`.

    Returns the socket and whether we created the file (and so remove it at exit).
    """
    if inherited is not None:
        return inherited, False
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
    sock.listen(LISTEN_BACKLOG)
    return sock, True


class Daemon:
    """The supervisor. `run()` is its five steps (see the module docstring), numbered there: 1 is
    `_take_locks` and `_build`, 2 `_serve`, 3 `_start_stages` (then `READY=1`), 4 `_main_loop` and
    `_drain` (SIGTERM drains), 5 `_shutdown`."""

    def __init__(self, config: Config) -> None:
        self.live = Live(config)        # the config in force, which every part reads (a reload changes it)
        self.info = DaemonInfo(pid=os.getpid(), started=time.time(), version=__version__)
        self.device_locks = DeviceLocks(config.daemon.lock_dir, owner=f"omnid {config.source or ''}".strip())
        self.leases = DeviceLeases(self.device_locks)     # which stage needs which locked GPU (sleep frees them)
        self.data_dir = Path(tempfile.mkdtemp(prefix="omnid-data-"))
        self.stages: dict[str, StageGroup] = {}
        self.store: JobStore | None = None
        self.scheduler: Scheduler | None = None
        self._runner: web.AppRunner | None = None
        self._metrics_runner: web.AppRunner | None = None
        self._socket_path: Path | None = None      # the socket file we created (and remove at exit)
        self._stop = asyncio.Event()
        self._stop_now = asyncio.Event()          # a second SIGTERM/SIGINT: do not wait for a drain
        self.reloader: Reloader | None = None
        self._serving = False
        self._reload_wanted = False
        self._tasks: set[asyncio.Task[None]] = set()
        self._load_locks: dict[int, asyncio.Lock] = {}
        self._log_file: DaemonLogHandler | None = None  # our records into <state_dir>/logs/omnid.log too
        self._uses_ray = False                      # some stage is placed on Ray: disconnect at exit
        self.tracing: Tracing | None = None         # `[daemon] tracing`: this process's exporter (omnid.tracing)
        self.keys: KeyStore | None = None           # the TCP listener's API keys (<state_dir>/api_keys.json)
        self._tcp_sites: dict[tuple[str, int], web.TCPSite] = {}   # daemon.listen's, open now
        self._inherited_tcp: set[tuple[str, int]] = set()           # systemd's TCP sockets' addresses
        cfg = config.daemon
        self.disk = resources.DiskWatch(cfg.state_dir, cfg.min_free_mb, cfg.min_free_inodes, cfg.ballast_mb,
                                        store_error=lambda: self.store.write_error if self.store else None)
        self.guard: resources.ConnectionGuard | None = None     # 503 past the open-files limit's room

    def request_stop(self) -> None:
        if self._stop.is_set():
            self._stop_now.set()
        self._stop.set()

    def request_reload(self) -> None:
        """SIGHUP: reload the config file (once serving; a SIGHUP during start-up waits for it)."""
        self._reload_wanted = True
        if self._serving and not self._stop.is_set():
            self._reload_wanted = False
            task = asyncio.get_running_loop().create_task(self._reload())
            self._tasks.add(task)
            task.add_done_callback(self._tasks.discard)

    async def _reload(self) -> None:
        if self.reloader is not None:
            await self.reloader.reload()
            await self._listen_as_configured()      # a reload may change daemon.listen

    async def _reload_asked(self) -> str:
        """POST /v1/reload: what SIGHUP does, answered with what happened."""
        if self.reloader is None or self._stop.is_set():
            return "reload refused: the daemon is starting or stopping"
        status = await self.reloader.reload()
        await self._listen_as_configured()
        return status

    @property
    def config(self) -> Config:
        """The config in force (a reload replaces it)."""
        return self.live.config

    async def run(self) -> int:
        """Run until SIGTERM/SIGINT. Returns the exit status."""
        loop = asyncio.get_running_loop()
        for sig in (signal.SIGTERM, signal.SIGINT):
            loop.add_signal_handler(sig, self.request_stop)
        loop.add_signal_handler(signal.SIGHUP, self.request_reload)
        try:
            self._raise_nofile()
            store = self._take_locks()                              # 1
            cfg = self.config.daemon
            self._log_file = install_daemon_log(cfg.state_dir, cfg.log_file_max_bytes, cfg.log_file_keep)
            api = self._build(store)
            await self._serve(api)                                  # 2
            if not await self._start_stages():                      # 3
                return 0
            if self.scheduler is not None:
                self.scheduler.arm_restored()
            if self.guard is not None:          # the workers' pipes and sockets are open now: what is left
                self.guard.limit = resources.ConnectionGuard.for_this_process(self.guard.connections).limit
                log.info("client connections", limit=self.guard.limit)
            systemd.notify(f"READY=1\nSTATUS=serving {len(self.config.pipelines)} pipelines")
            log.info("ready", startup_s=round(time.time() - self.info.started, 3))
            _freeze_heap()
            self._serving = True
            self.info.state = DaemonState.SERVING
            if self._reload_wanted:
                self.request_reload()
            await self._main_loop()                                 # 4
            await self._drain()
            return 0
        except StartupError as e:
            log.error("cannot start", error=str(e))
            if not logs.json_log():         # (a JSON log stays JSON lines: the record says it)
                print(f"omnid: {e}", flush=True, file=sys.stderr)
            return 1
        finally:
            await self._shutdown()                                  # 5

    # ------------------------------------------------------------------ 1. locks and state

    def _take_locks(self) -> JobStore:
        """The GPU lock files, then the state dir (its lock, its database)."""
        cfg = self.config.daemon
        try:
            self.device_locks.acquire(self.config.devices)
        except DeviceBusy as e:
            raise StartupError(f"{e}; another omnid or GPU job holds it") from None
        except OSError as e:
            raise StartupError(f"cannot create lock files in {cfg.lock_dir}: {e.strerror}") from None
        try:
            # A write that finds the disk full gives back the ballast (and is tried again): a start on a
            # full disk opens the database, and rm and retention can free space.
            self.store = JobStore(cfg.state_dir, on_full=self.disk.release_ballast)
        except StateDirBusy as e:
            raise StartupError(str(e)) from None
        except OSError as e:
            raise StartupError(f"cannot open the state dir {cfg.state_dir}: {e.strerror or e}") from None
        except sqlite3.Error as e:
            raise StartupError(f"cannot open the job database in {cfg.state_dir}: {e}") from None
        self.store.write_behind(asyncio.get_running_loop())
        self.disk.ensure_ballast()
        state = self.disk.tick()
        if state.full:
            log.warning("starting short of disk space: status, results and rm work, submits are refused (507) "
                        "until there is room", reason=state.reason)
        return self.store

    def _raise_nofile(self) -> None:
        """The soft open-files limit up to the hard one: every client connection is a descriptor."""
        before, now = resources.raise_nofile()
        log.info("open files limit", soft=now, was=before, hard=resource.getrlimit(resource.RLIMIT_NOFILE)[1])

    def _build(self, store: JobStore) -> Api:
        """The parts, each built after what it uses: stage handles, metrics, scheduler, API."""
        self._load_locks = {d: asyncio.Lock() for d in self.config.devices}   # one loader per device at a time

        # `config`: the one a reload makes it under, before that one is in force; None: the one in force.
        def make_replica(config: Config | None, name: str, replica: int) -> StageHandle:
            if (config if config is not None else self.live.worker).stages[name].placement_of(replica) == "ray":
                from omnid.supervisor.workers.ray_stage import RayStageHandle  # imports ray when first used
                self._uses_ray = True
                return RayStageHandle(self.live, name, self.data_dir, store.jobs_dir, self._load_locks, replica,
                                      config)
            return StageHandle(self.live, name, self.data_dir, store.jobs_dir, self._load_locks, replica, config)

        def make_stage(config: Config | None, name: str) -> StageGroup:
            devices = (config if config is not None else self.live.worker).stages[name].devices
            self.leases.hold(name, devices)     # locked already (`_take_locks`, reload)
            return StageGroup(self.live, name, make_replica, self.leases, config)

        self.stages = {name: make_stage(None, name) for name in self.config.stages}
        metrics = Metrics(self.stages)
        if self.config.daemon.tracing is not None:     # OpenTelemetry is imported only then (omnid.tracing)
            self.tracing = Tracing(self.config.daemon.tracing, self.config.daemon.tracing.service_name)
        self.scheduler = Scheduler(self.live, store, self.stages,
                                   lambda address: P.socket_path(self.data_dir, address), metrics, self.tracing)
        self.scheduler.restore(store.unfinished())     # what the last daemon accepted and did not finish
        sched = self.scheduler
        self._retention = Retention(self.config.daemon, store,
                                    lambda: set(sched.live_jobs) | {job for _, job in sched.stopping})
        metrics.watch_streams(self.scheduler.gate.snapshots)
        metrics.watch_gc()
        api = Api(self.live, store, self.scheduler, self.stages, metrics, self.info)
        OpenAiApi(api).mount(api.app)       # /v1/models, /v1/chat/completions, ... on the same socket
        RealtimeApi(api).mount(api.app)     # /v1/realtime: OpenAI's Realtime API, a WebSocket session
        try:
            self.keys = KeyStore(key_path(self.config.daemon.state_dir))
        except KeyFileError as e:
            raise StartupError(str(e)) from None
        Access(api, self.keys).mount(api.app)   # the TCP listener's door: API keys (innermost middleware)
        if self.tracing is not None:
            trace_context.mount(api.app)        # callers' traceparent joined; answers name the job's trace
        self._watch_resources(api, metrics)
        self.reloader = Reloader(self.live, self.stages, self.scheduler, make_stage, self.device_locks,
                                 self._load_locks)
        api.reload = self._reload_asked         # POST /v1/reload (an admin action)
        return api

    def _watch_resources(self, api: Api, metrics: Metrics) -> None:
        """The disk (ready, 507 on submit) and the connections (503 past the limit) for the API."""
        api.disk = self.disk

        def connections() -> list[Any] | None:
            server = self._runner.server if self._runner is not None else None
            return server.connections if server is not None else None

        self.guard = resources.ConnectionGuard.for_this_process(connections)
        guard = self.guard

        def refuse(n: int) -> web.StreamResponse:
            return error(503, ErrorCode.TOO_MANY_CONNECTIONS, f"the daemon has {n} client connections open, "
                         f"more than the {guard.limit} its open-files limit leaves room for; try again later",
                         open=n, limit=guard.limit)

        api.app.middlewares.insert(0, guard.middleware(refuse))     # first: before any work for the request
        metrics.watch(self.disk, self.guard)

    # ------------------------------------------------------------------ 2. the socket

    async def _serve(self, api: Api) -> None:
        cfg = self.config.daemon
        inherited = systemd.listen_fds()
        unix = next((s for s in inherited if s.family == socket.AF_UNIX), None)
        try:
            sock, created = open_listening_socket(cfg.socket, cfg.socket_mode, cfg.socket_group, unix)
        except OSError as e:
            raise StartupError(f"cannot listen on {cfg.socket}: {e.strerror or e}") from None
        self._socket_path = cfg.socket if created else None
        # keepalive_timeout: aiohttp (3.14) arms it when a connection is made, so a client that sends
        # nothing, or half a request, is dropped after it too (its buffer is bounded by max_field_size).
        self._runner = web.AppRunner(api.app, access_log=None, handle_signals=False,
                                     keepalive_timeout=cfg.client_idle_timeout_s)
        await self._runner.setup()
        await web.SockSite(self._runner, sock, backlog=LISTEN_BACKLOG).start()
        where = str(cfg.socket) if created else f"{sock.getsockname() or 'an unnamed socket'} (from systemd)"
        log.info("listening", socket=where, stages=len(self.stages), pid=self.info.pid)
        await self._serve_tcp([s for s in inherited if s.family in (socket.AF_INET, socket.AF_INET6)])
        if cfg.metrics_listen is not None:        # /metrics only, for a Prometheus that scrapes over TCP
            host, port = cfg.metrics_listen
            metrics_app = web.Application()
            metrics_app.router.add_get("/metrics", api.daemon.get_metrics)
            self._metrics_runner = web.AppRunner(metrics_app, access_log=None, handle_signals=False)
            await self._metrics_runner.setup()
            try:
                await web.TCPSite(self._metrics_runner, host, port).start()
            except OSError as e:
                raise StartupError(f"cannot listen on {host}:{port} (daemon.metrics_listen): {e.strerror or e}") \
                    from None
            log.info("serving /metrics over TCP", address=f"{host}:{port}")

    async def _serve_tcp(self, inherited: list[socket.socket]) -> None:
        """The TCP listener: the sockets systemd passed, and `daemon.listen`'s addresses; the same
        application as the socket, behind its door (access.py: API keys). An inherited socket
        beyond loopback is refused without keys, as `omnid --check` refuses such a `listen`."""
        assert self._runner is not None and self.keys is not None
        taken: set[tuple[str, int]] = set()
        for sock in inherited:
            host, port = sock.getsockname()[:2]
            if not is_loopback(host) and not self.keys.all():
                raise StartupError(f"systemd passed a TCP socket on {_address(host, port)}, which is not a loopback "
                                   f"address, and there are no API keys ({self.keys.path} has none): add one first "
                                   "(omnictl key add NAME)")
            await web.SockSite(self._runner, sock, backlog=LISTEN_BACKLOG).start()
            taken.add((host, port))
            log.info("listening", tcp=_address(host, port), via="systemd")
        self._inherited_tcp = taken
        failed = await self._listen_as_configured()
        if failed:
            raise StartupError(failed[0])

    async def _listen_as_configured(self) -> list[str]:
        """Open `daemon.listen`'s addresses not open yet, close those no longer listed (their open
        connections finish what they are doing); returns what could not be opened."""
        assert self._runner is not None and self.keys is not None
        wanted = [hp for hp in self.config.daemon.listen if hp not in self._inherited_tcp]
        for hp in [hp for hp in self._tcp_sites if hp not in wanted]:
            await self._tcp_sites.pop(hp).stop()
            log.info("no longer listening", tcp=_address(*hp))
        failed = []
        for host, port in wanted:
            if (host, port) in self._tcp_sites:
                continue
            site = web.TCPSite(self._runner, host, port, backlog=LISTEN_BACKLOG, reuse_address=True)
            try:
                await site.start()
            except OSError as e:
                failed.append(f"cannot listen on {_address(host, port)} (daemon.listen): {e.strerror or e}")
                log.error("cannot listen", tcp=_address(host, port), error=str(e.strerror or e))
                continue
            self._tcp_sites[(host, port)] = site
            log.info("listening", tcp=_address(host, port), keys=len(self.keys.all()))
        return failed

    # ------------------------------------------------------------------ 3. the stage workers

    async def _start_stages(self) -> bool:
        """Start every worker; abort at the first one that dies while loading.

        Returns False when a stop was asked for meanwhile.
        """
        tasks = {asyncio.create_task(h.start(), name=f"start-{h.name}"): h for h in self.stages.values()}
        stop = asyncio.create_task(self._stop.wait())
        pending: set[asyncio.Task[Any]] = set(tasks) | {stop}
        try:
            while pending != {stop}:
                done, pending = await asyncio.wait(pending, return_when=asyncio.FIRST_COMPLETED)
                if stop in done:
                    return False
                for t in done:
                    t.result()
                    for h in tasks[t]:
                        if h.state is WorkerState.FAILED:
                            raise StartupError(f"stage {h.label!r} failed to start: {h.last_error}")
            return not self._stop.is_set()
        finally:
            for t in pending:
                t.cancel()

    # ------------------------------------------------------------------ 4. serving

    async def _main_loop(self) -> None:
        """Every second: heartbeat checks; the systemd watchdog ping when it is on."""
        watchdog = systemd.watchdog_interval()
        last_ping = 0.0
        while not self._stop.is_set():
            try:
                await asyncio.wait_for(self._stop.wait(), timeout=min(1.0, watchdog or 1.0))
            except asyncio.TimeoutError:
                pass
            for h in list(self.stages.values()):
                h.check_heartbeat()
            if self.scheduler is not None and self.info.state is DaemonState.SERVING:
                self.scheduler.tend_sleep()         # idle stages with idle_unload_s go to sleep
            self._retention.maybe_run()             # finished jobs past keep_jobs / keep_jobs_days
            self._tend_disk()
            if watchdog and time.monotonic() - last_ping >= watchdog:
                systemd.notify("WATCHDOG=1")
                last_ping = time.monotonic()

    def _tend_disk(self) -> None:
        """Once a tick: writes the store could not make are tried again; the ballast is put back
        when there is room; the disk's state (ready, 507) follows."""
        if self.store is not None and self.store.pending:
            self.store.flush()
        cfg = self.config.daemon               # (a reload may have moved the floors)
        self.disk.configure(cfg.min_free_mb, cfg.min_free_inodes, cfg.ballast_mb)
        self.disk.tick()

    # ------------------------------------------------------------------ 5. drain and shutdown

    async def _drain(self) -> None:
        """SIGTERM: take no new job (503 `draining`), set the queued ones aside for the next start,
        and give the running ones up to `drain_timeout_s` to finish (a second signal cuts it short).
        Whatever still runs then is run again, or failed, by the next start (`Scheduler.restore`)."""
        if self.scheduler is None:
            return
        self.info.state = DaemonState.DRAINING
        kept = self.scheduler.drain()
        grace = self.config.daemon.drain_timeout_s
        deadline = time.monotonic() + grace
        log.info("draining", running=self.scheduler.running(), kept_for_next_start=kept, grace_s=grace)
        while (running := self.scheduler.running()) and time.monotonic() < deadline and not self._stop_now.is_set():
            left = deadline - time.monotonic()
            systemd.notify(f"STOPPING=1\nSTATUS=draining: {running} job(s) running ({left:.0f} s left), "
                           f"{kept} queued kept for the next start")
            try:
                await asyncio.wait_for(self._stop_now.wait(), timeout=min(1.0, left))
            except asyncio.TimeoutError:
                pass
        running = self.scheduler.running()
        log.info("drained", unfinished=running, kept_for_next_start=kept)
        systemd.notify(f"STOPPING=1\nSTATUS=stopping the stage workers ({running} unfinished job(s) "
                       f"and {kept} queued kept for the next start)")

    async def _shutdown(self) -> None:
        """Keep what is live for the next start, close the API, stop the workers, release the locks,
        remove the socket."""
        self.info.state = DaemonState.STOPPING
        systemd.notify("STOPPING=1")
        if self.scheduler is not None:
            self.scheduler.shutdown()
        if self._runner is not None:
            await self._runner.cleanup()
        if self._metrics_runner is not None:
            await self._metrics_runner.cleanup()
        if self.reloader is not None:
            await self.reloader.stop()
        await asyncio.gather(*(h.stop(self.config.daemon.stop_grace_s) for h in list(self.stages.values())))
        if self._uses_ray:
            from omnid.supervisor.workers import ray_stage
            for group in self.stages.values():
                for handle in group:
                    if isinstance(handle, ray_stage.RayStageHandle):
                        handle.close_bridge()
            ray_stage.disconnect()
        self.device_locks.release()
        shutil.rmtree(self.data_dir, ignore_errors=True)
        if self._socket_path is not None:
            try:
                self._socket_path.unlink()
            except FileNotFoundError:
                pass
        if self.store is not None:
            self.store.close()
        if self.tracing is not None:
            self.tracing.shutdown()             # what is queued goes out (bounded by the export timeout)
        log.info("stopped")
        remove_daemon_log(self._log_file)
        self._log_file = None


def _address(host: str, port: int) -> str:
    return f"[{host}]:{port}" if ":" in host else f"{host}:{port}"


def _freeze_heap() -> None:
    """What the start made (the config, the API's routes and schemas, the stage handles, every module)
    lives as long as the daemon: out of the cyclic collector's sight from here on, so that a full
    collection while streams are live walks only what serving made. Measured at 128 streamed chats:
    the event loop stood 61 ms in one full collection, every stream's next token with it (vLLM's API
    server freezes its start the same way, `freeze_gc_heap`)."""
    gc.collect()
    gc.freeze()


def run(config: Config) -> int:
    """Library entry: run a daemon for `config` in this process until stopped."""
    os.umask(paths.UMASK)              # private by default (omnid.paths); the stage workers inherit it
    return asyncio.run(Daemon(config).run())
