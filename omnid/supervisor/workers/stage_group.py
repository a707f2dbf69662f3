"""One configured stage and its replicas: several workers of the same engine, one job to one replica.

Runs in the supervisor's event-loop thread, like the `StageHandle`s (stage.py) it holds, one per
replica (`replicas = N` in the stage's config; each with its own process, READY, heartbeats,
device set and restarts). A replica that crashes or is given up leaves the others serving: the
stage is `degraded`, and down (`failed`) only when every replica is.

Which replica serves a job is the scheduler's choice (`pick`): the warm replica with the least
work assigned to it (jobs in its queue, running in it, or on their way to it from upstream).
The job keeps that replica for the stage: every window, hand-off and resend goes to it.

A stage with `idle_unload_s` sleeps when it has had no work for that long: its workers stop and
its GPU lock files are let go (`sleep`); the next job wakes it (`wake`), and only one sleep or wake
runs at a time. Its sleep is a `SleepState` (awake -> dozing -> asleep -> waking -> awake); a wake
asked for (`wake_soon`) is a task, until it is over. A reload that changes only `replicas` starts
or stops replicas (`resize_to`) without touching the others.

The stage and its replicas read the workers' config in force (`Live.worker`, live.py); what a
reload lets go keeps the config it had (`keep`).
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable, Iterator, Sequence

import structlog

from omnid.config import Config, StageConfig
from omnid.locks import DeviceBusy, DeviceLeases
from omnid.lora import describe as lora_view
from omnid.supervisor.live import Follower, Live
from omnid.supervisor.workers.documents import ReplicaDoc, ShmUse, StageDoc, shared
from omnid.supervisor.workers.stage import StageHandle, StageListener
from omnid.vocabulary import SleepState, WorkerState

log = structlog.get_logger("omnid.stage")

# (the config a reload made it under before that config is in force; None: the one in force, stage, replica)
MakeReplica = Callable[[Config | None, str, int], StageHandle]


class StageGroup(Follower):
    """A stage's replicas, their common state, and its sleep. Its `config` is the workers' config
    in force (`Live.worker`), unless it holds its own (`Follower`): `config`, for a stage a reload
    adds, until the switch; the one it had, for a stage a reload removed."""

    def __init__(self, live: Live, name: str, make_replica: MakeReplica,
                 leases: DeviceLeases | None = None, config: Config | None = None) -> None:
        super().__init__(live, config)
        self.name = name
        self._make_replica = make_replica
        self._leases = leases
        self.replicas: list[StageHandle] = [make_replica(config, name, i) for i in range(self.stage.replicas)]
        self.active = self.stage.replicas       # replicas from this index on are being retired (a reload)
        self._turn = 0                          # where the next tie between replicas starts
        self._listener: StageListener | None = None
        self.sleep_state = SleepState.AWAKE     # dozing: a job that comes now wakes it again; asleep: workers stopped
        self.idle_since = time.monotonic()
        self.slept_at: float | None = None
        self.woke_at: float | None = None
        self.wake_s: float | None = None        # how long the last wake took (load included)
        self._wake_task: asyncio.Task[bool] | None = None     # a wake asked for (`wake_soon`), until it is over
        self._transition = asyncio.Lock()       # one sleep or wake at a time
        self.sleep_error: str | None = None     # why the last wake failed

    @property
    def stage(self) -> StageConfig:
        return self.config.stages[self.name]

    @property
    def sleeping(self) -> bool:
        """Its workers are stopped until a job wakes it."""
        return self.sleep_state is SleepState.ASLEEP

    @property
    def dozing(self) -> bool:
        """Going to sleep (its workers stopping): a job that comes now wakes it again."""
        return self.sleep_state is SleepState.DOZING

    def __iter__(self) -> Iterator[StageHandle]:
        return iter(self.replicas)

    def attach(self, listener: StageListener) -> None:
        self._listener = listener
        for h in self.replicas:
            h.attach(listener)

    def replica(self, index: int) -> StageHandle | None:
        return self.replicas[index] if 0 <= index < len(self.replicas) else None

    # ------------------------------------------------------------------ the stage as a whole

    @property
    def state(self) -> WorkerState:
        """ready/busy when every replica serves, degraded when some do, failed when none can;
        otherwise what the replicas are doing (loading, restarting ...); sleeping while asleep."""
        if self.sleeping:               # asleep; `starting` once a wake is asked for
            return WorkerState.SLEEPING if self._wake_task is None else WorkerState.STARTING
        serving = self.replicas[:self.active] or self.replicas
        states = [h.state for h in serving]
        if all(s.warm for s in states):
            return WorkerState.BUSY if WorkerState.BUSY in states else WorkerState.READY
        if any(s.warm for s in states):
            return WorkerState.DEGRADED
        if all(s is WorkerState.FAILED for s in states):
            return WorkerState.FAILED
        return next(s for s in states if s is not WorkerState.FAILED)

    @property
    def resting(self) -> bool:
        """Asleep, falling asleep, or being woken: a job for it must (still) wake it."""
        return self.sleeping or self.dozing or self._wake_task is not None

    @property
    def takes_jobs(self) -> bool:
        """Readiness: it serves now (or degraded), sleeps, or is being woken: a job for it is taken."""
        return self.state.serving or self._wake_task is not None

    @property
    def last_error(self) -> str | None:
        if self.sleep_error:
            return self.sleep_error
        if len(self.replicas) == 1:
            return self.replicas[0].last_error
        errors = [f"{h.label}: {h.last_error}" for h in self.replicas if h.last_error]
        return "; ".join(errors) if errors else None

    def down(self) -> list[StageHandle]:
        """The replicas that do not serve now (while the stage is awake)."""
        if self.sleeping:
            return []
        return [h for h in self.replicas[:self.active] if not h.state.warm]

    @property
    def running(self) -> tuple[str, ...]:
        return tuple(j for h in self.replicas for j in h.running)

    @property
    def restarts(self) -> int:
        return sum(h.restarts for h in self.replicas)

    @property
    def jobs_done(self) -> int:
        return sum(h.jobs_done for h in self.replicas)

    # ------------------------------------------------------------------ routing

    def pick(self, assigned: Sequence[int]) -> int:
        """The replica for a new job: a serving one with the least work (`assigned[i]`: jobs given to
        replica i and not done there yet); on a tie, the next one in turn. One that is down (restarting,
        loading) only when none serves; one given up for good never, unless all are."""
        n = min(self.active, len(self.replicas))
        candidates = [i for i in range(n) if self.replicas[i].state is not WorkerState.FAILED]
        if not candidates:
            return 0
        chosen = min(candidates, key=lambda i: (not self.replicas[i].state.warm and not self.sleeping,
                                                assigned[i] if i < len(assigned) else 0,
                                                self.replicas[i].stats.depth, (i - self._turn) % n))
        self._turn = chosen + 1             # ties go round: every replica stays in use (and warm)
        return chosen

    # ------------------------------------------------------------------ life cycle

    async def start(self) -> None:
        await asyncio.gather(*(h.start() for h in self.replicas))

    def send(self, msg: object) -> None:
        """A control message for every replica (Cancel, Forget: each drops what it has of the job)."""
        for h in self.replicas:
            h.send(msg)

    def check_heartbeat(self) -> None:
        for h in self.replicas:
            h.check_heartbeat()

    def keep(self, first: int = 0) -> None:
        """A reload lets the stage go (or its replicas from `first` on): what it lets go keeps the
        config it runs with until it stops. Called before the new config is in force."""
        if first == 0:
            super().keep()
        for h in self.replicas[first:]:
            h.keep()

    def follow(self) -> None:
        """A stage a reload added: from the switch on, it and its replicas follow the config in force."""
        super().follow()
        for h in self.replicas:
            h.follow()

    def reconfigure(self) -> None:
        """A reload put a new workers' config in force: the stage follows it, and so do the replicas
        it keeps (their live workers learn it); those it lets go kept theirs (`keep`)."""
        super().follow()
        for h in self.replicas[:self.stage.replicas]:
            h.reconfigure()

    async def restart(self, reason: str, idle_timeout: float) -> None:
        """Replace every replica's worker, one after the other (the others keep serving)."""
        if self.sleeping:
            await self.wake()
            return
        for h in list(self.replicas[:self.active]):
            await h.restart(reason, idle_timeout)

    async def stop(self, grace: float) -> None:
        if self._wake_task is not None:
            self._wake_task.cancel()
        await asyncio.gather(*(h.stop(grace) for h in self.replicas))

    # ------------------------------------------------------------------ a reload

    def resize_to(self) -> tuple[list[StageHandle], list[StageHandle]]:
        """A reload changed `replicas` (its config is in force): (new handles to start, handles to
        retire once idle). The replicas both configs have keep running (`restart` those whose worker
        changed)."""
        want = self.stage.replicas
        fresh: list[StageHandle] = []
        while len(self.replicas) < want:
            h = self._make_replica(None, self.name, len(self.replicas))
            if self._listener is not None:
                h.attach(self._listener)
            self.replicas.append(h)
            fresh.append(h)
        self.active = want
        return fresh, self.replicas[want:]

    def drop_retired(self, handle: StageHandle) -> None:
        """A retired replica stopped: forget it (only the last ones are ever retired)."""
        if handle in self.replicas and self.replicas.index(handle) >= self.active:
            self.replicas.remove(handle)

    # ------------------------------------------------------------------ sleep and wake

    def touch(self) -> None:
        """The stage has work now: its idle time starts again."""
        self.idle_since = time.monotonic()

    def idle_for(self) -> float:
        return time.monotonic() - self.idle_since

    async def sleep(self, grace: float) -> bool:
        """Stop every worker and let go of the GPUs only this stage uses. False if it was already
        asleep (or is being woken). The caller checked that the stage has no work."""
        async with self._transition:
            if self.sleeping or self._wake_task is not None:
                return False
            log.info("stage going to sleep", stage=self.name, idle_s=round(self.idle_for(), 1))
            await asyncio.gather(*(h.stop(grace) for h in self.replicas))
            for h in self.replicas:
                h.state = WorkerState.SLEEPING
            self.sleep_state = SleepState.ASLEEP
            self.slept_at = time.time()
            freed = self._leases.drop(self.name) if self._leases is not None else ()
            log.info("stage asleep", stage=self.name, gpus_released=list(freed))
            return True

    def doze(self) -> None:
        """It is going to sleep (the scheduler's `put_to_sleep`, before `sleep`): from now on a job
        for it wakes it again."""
        self.sleep_state = SleepState.DOZING

    def dozed(self) -> None:
        """The sleep `doze` announced is over: asleep, or still awake (a job came first, or it failed)."""
        if self.sleep_state is SleepState.DOZING:
            self.sleep_state = SleepState.AWAKE

    def wake_soon(self) -> asyncio.Task[bool]:
        """Start waking the stage (once: later callers get the same task)."""
        if self._wake_task is None:
            self._wake_task = asyncio.get_running_loop().create_task(self.wake(), name=f"wake-{self.name}")
        return self._wake_task

    async def wake(self) -> bool:
        """Load the workers again (after a sleep that may still be under way). True once they are
        ready (a degraded stage counts); False if none could load (`sleep_error` says why)."""
        t0 = time.monotonic()
        try:
            async with self._transition:
                if not self.sleeping:
                    return True
                log.info("waking stage", stage=self.name)
                self.sleep_error = None
                if not await self._lease_devices():
                    return False
                self.sleep_state = SleepState.WAKING
                await asyncio.gather(*(h.wake() for h in self.replicas[:self.active]))
                self.woke_at = time.time()
                self.wake_s = round(time.monotonic() - t0, 3)
                self.touch()
                ok = any(h.state.warm for h in self.replicas)
                log.info("stage awake" if ok else "stage could not wake", stage=self.name, wake_s=self.wake_s)
                return ok
        finally:
            self._wake_task = None
            if self.sleep_state is SleepState.WAKING:
                self.sleep_state = SleepState.AWAKE

    async def _lease_devices(self) -> bool:
        """Lock this stage's GPUs again; while another program holds one, wait (the jobs' timeouts
        bound the wait: a wake is cancelled when no job waits for it any more)."""
        if self._leases is None or not self.stage.devices:
            return True
        said = False
        while True:
            try:
                self._leases.hold(self.name, self.stage.devices)
                return True
            except DeviceBusy as e:
                if not said:
                    log.warning("waking stage: waiting for its GPU", stage=self.name, error=str(e))
                    said = True
                for h in self.replicas:
                    h.state = WorkerState.WAITING_FOR_DEVICE
                self.sleep_error = str(e)
            except OSError as e:
                self.sleep_error = f"cannot lock the stage's GPUs: {e.strerror or e}"
                return False
            await asyncio.sleep(1.0)

    # ------------------------------------------------------------------ inspection

    def snapshot(self) -> StageDoc:
        """`GET /v1/stages`: the stage as a whole (sums over its replicas) and each replica."""
        replicas: list[ReplicaDoc] = [{**h.snapshot(), "replica": i, "retiring": i >= self.active}
                                      for i, h in enumerate(self.replicas)]
        first = replicas[0]
        shm: ShmUse = {"capacity_bytes": sum(r["shm"]["capacity_bytes"] for r in replicas),
                       "used_bytes": sum(r["shm"]["used_bytes"] for r in replicas),
                       "slots": sum(r["shm"]["slots"] for r in replicas)}
        rss = [r["rss_bytes"] for r in replicas if r["rss_bytes"] is not None]
        gpu = [r["gpu_memory_bytes"] for r in replicas if r["gpu_memory_bytes"] is not None]
        cpu = [r["cpu_percent"] for r in replicas if r["cpu_percent"] is not None]
        placements = {r["placement"] for r in replicas}
        return {
            **shared(first),
            "state": self.state,
            "devices": list(self.stage.devices),
            "replica_count": self.stage.replicas,
            "queue_depth": sum(r["queue_depth"] for r in replicas),
            "queue_capacity": self.stage.queue_capacity * self.active,
            "max_inflight": self.stage.max_inflight * self.active,
            "running": list(self.running), "jobs_done": self.jobs_done, "restarts": self.restarts,
            "rss_restarts": sum(r["rss_restarts"] for r in replicas),
            "rss_bytes": sum(rss) if rss else None, "gpu_memory_bytes": sum(gpu) if gpu else None,
            "cpu_percent": round(sum(cpu), 1) if cpu else None,
            "tracked_jobs": sum(r["tracked_jobs"] for r in replicas),
            "last_error": self.last_error, "shm": shm,
            "last_restart": max((r["last_restart"] for r in replicas if r["last_restart"]),
                                key=lambda restart: restart["at"], default=None),
            "placement": placements.pop() if len(placements) == 1 else "mixed",
            "node": first["node"] if len(replicas) == 1 else None,
            "down": [h.label for h in self.down()],
            "idle_unload_s": self.stage.idle_unload_s,
            "idle_s": round(self.idle_for(), 1) if not self.sleeping else None,
            "slept_at": self.slept_at if self.sleeping else None,
            "wake_s": self.wake_s,
            "lora": lora_view(self.stage),      # its LoRA adapters in force (supervisor/http/api/adapters.py)
            "replicas": replicas,
        }
