"""SIGHUP (`systemctl reload`): read the config file again and apply what changed, without a restart.

Runs in the supervisor's event-loop thread, as one task at a time (reloads are serialised). It
awaits stage workers loading and stopping; nothing in it blocks the loop.

What a reload does:
- an invalid file is refused with the same report as `omnid --check`, and the old config keeps serving;
  so is a change to what only a restart can change (the socket, the state and lock dirs);
- unchanged stages keep their warm workers (same pids); they learn the new pipelines (`Reconfigure`);
- new stages are loaded before any pipeline sends them work; a stage whose definition changed
  gets new workers, one replica after the other, each once its running jobs have finished (up to
  `drain_timeout_s`); a stage that was removed finishes its jobs and then stops;
- a change of `replicas` (or `idle_unload_s`) alone touches no running worker: new replicas load
  and join, extra ones take no new job and stop once theirs are done; a sleeping stage stays
  asleep and wakes with its new definition;
- pipelines switch at once, for new jobs; a job in flight finishes on the definition it started
  with (a changed pipeline gets a new key, `name~N`, and the workers keep the old one for it).
"""

from __future__ import annotations

import asyncio
import dataclasses
import time
from collections.abc import Callable
from pathlib import Path

import structlog

from omnid import systemd
from omnid.config import Config, ConfigError, PipelineConfig, load
from omnid.locks import DeviceBusy, DeviceLocks
from omnid.supervisor.jobs.scheduler import Scheduler
from omnid.supervisor.live import Live
from omnid.supervisor.workers.stage import StageHandle
from omnid.supervisor.workers.stage_group import StageGroup
from omnid.vocabulary import WorkerState

log = structlog.get_logger("omnid.reload")

# Only a restart can change these (the socket is open, the state dir and lock files are held).
FIXED_DAEMON_KEYS = ("socket", "state_dir", "lock_dir", "socket_mode", "socket_group", "max_request_bytes",
                     "ray_address", "tracing")


class Reloader:
    """Applies a reload to the parts; the config in force is `live`'s (a reload changes it there)."""

    def __init__(self, live: Live, stages: dict[str, StageGroup], scheduler: Scheduler,
                 make_handle: Callable[[Config | None, str], StageGroup], device_locks: DeviceLocks,
                 load_locks: dict[int, asyncio.Lock]) -> None:
        self.live = live
        self.stages = stages                    # the daemon's own dict, changed in place
        self.scheduler = scheduler
        self._make_handle = make_handle         # (the config it is made under, before that is in force; name)
        self._device_locks = device_locks
        self._load_locks = load_locks
        self.definitions: dict[str, PipelineConfig] = dict(live.config.pipelines)  # key -> definition
        self._lock = asyncio.Lock()
        self._removals: set[asyncio.Task[None]] = set()
        self._retiring: dict[str, StageGroup] = {}      # removed stages still finishing their jobs
        self._retiring_replicas: set[StageHandle] = set()   # replicas a smaller `replicas` let go
        self.reloads = 0

    @property
    def config(self) -> Config:
        """The public config in force: pipelines by name."""
        return self.live.config

    @property
    def keys(self) -> dict[str, str]:
        """Each pipeline's key (the workers' name for its definition): name -> key."""
        return self.live.keys

    def worker_config(self, config: Config) -> Config:
        """What workers get: `config` with every pipeline definition jobs may still name, by key."""
        return dataclasses.replace(config, pipelines=dict(self.definitions))

    async def reload(self) -> str:
        """Read the file again and apply it; the sentence says what happened (also for STATUS=)."""
        async with self._lock:
            systemd.notify(f"RELOADING=1\nMONOTONIC_USEC={time.monotonic_ns() // 1000}\n"
                           f"STATUS=reloading {self.config.source}")
            try:
                status = await self._reload()
            except Exception as e:              # a bug must not take the daemon down: it keeps serving
                log.exception("reload failed")
                status = f"reload failed: {type(e).__name__}: {e}; still serving the previous config"
            systemd.notify(f"READY=1\nSTATUS={status}")
            return status

    async def _reload(self) -> str:
        path = self.config.source
        if path is None:
            return "reload refused: the daemon was not started from a config file"
        try:
            new = load(Path(path))
        except ConfigError as e:
            log.error("reload refused: the config is invalid", file=str(path), problems=[str(p) for p in e.problems])
            return f"reload refused: {len(e.problems)} problem(s) in {path} (see omnid --check); still serving"
        refused = self._refused(new)
        if refused is not None:
            return refused
        old = self.config
        added = [n for n in new.stages if n not in old.stages]
        removed = [n for n in old.stages if n not in new.stages]
        changed = [n for n in new.stages if n in old.stages and new.stages[n] != old.stages[n]]
        try:
            self._device_locks.acquire(d for d in new.devices if d not in self._device_locks.held)
        except DeviceBusy as e:
            log.error("reload refused: a GPU is busy", error=str(e))
            return f"reload refused: {e}; still serving"
        for d in new.devices:
            self._load_locks.setdefault(d, asyncio.Lock())
        keys = self._keys_for(new)
        worker_config = self.worker_config(new)
        # 1. New stages load before any pipeline can send them work.
        broken = await self._load_added(worker_config, added)
        if broken is not None:
            return broken
        # 2. The new workers' config in force: removed stages, and replicas a smaller `replicas`
        #    lets go, keep theirs; every other worker learns the new pipelines; changed stages get
        #    new workers (or replicas more or fewer).
        for name in removed:
            self.stages[name].keep()
        for name in new.stages:
            if name not in added:
                self.stages[name].keep(first=new.stages[name].replicas)
        self.live.put_to_workers(worker_config)
        for name in new.stages:
            if name in added:
                self.stages[name].follow()
            else:
                self.stages[name].reconfigure()
        results = await asyncio.gather(*(self._apply(self.stages[n], old, new) for n in changed))
        restarted = [n for n, replaced in zip(changed, results) if replaced]
        resized = [n for n in changed if new.stages[n].replicas != old.stages[n].replicas]
        # 3. The switch: new jobs run on the new pipelines, each definition carrying its key.
        self.live.switch(dataclasses.replace(new, pipelines={name: dataclasses.replace(p, key=keys[name])
                                                             for name, p in new.pipelines.items()}), keys)
        # 4. Removed stages finish what they have, then stop.
        self._retire_removed(removed)
        self.reloads += 1
        failed = [n for n in changed if self.stages[n].state is WorkerState.FAILED]
        summary = (f"reloaded {path}: {len(added)} stage(s) added, {len(restarted)} restarted, "
                   f"{len(resized)} resized, {len(removed)} removed; {len(new.pipelines)} pipelines")
        if failed:
            summary += f"; stage(s) {', '.join(failed)} failed to load their new definition"
        log.info("reloaded", added=added, restarted=restarted, resized=resized, removed=removed, failed=failed,
                 pipelines=sorted(new.pipelines))
        return summary

    def _retire_removed(self, removed: list[str]) -> None:
        """Removed stages finish what they have, then stop (in tasks of their own)."""
        for name in removed:
            self._retiring[name] = self.stages[name]
            task = asyncio.get_running_loop().create_task(self._retire(name, self.stages[name]))
            self._removals.add(task)
            task.add_done_callback(self._removals.discard)

    async def _load_added(self, worker_config: Config, added: list[str]) -> str | None:
        """Start the new stages' workers; if one cannot load, stop them all and say why (a refusal)."""
        fresh = {n: self._make_handle(worker_config, n) for n in added}
        for name, handle in fresh.items():
            handle.attach(self.scheduler)
            self.stages[name] = handle
        await asyncio.gather(*(h.start() for h in fresh.values()))
        broken = [n for n, h in fresh.items() if any(r.state is WorkerState.FAILED for r in h)]
        if not broken:
            return None
        await asyncio.gather(*(h.stop(0) for h in fresh.values()))
        for n in fresh:
            del self.stages[n]
        errors = "; ".join(f"{n}: {fresh[n].last_error}" for n in broken)
        log.error("reload refused: new stages could not load", errors=errors)
        return f"reload refused: new stage(s) could not load ({errors}); still serving"

    def _refused(self, new: Config) -> str | None:
        """Why a reload to `new` is refused (the daemon keeps serving as it is), or None."""
        old = self.config
        fixed = [k for k in FIXED_DAEMON_KEYS if getattr(new.daemon, k) != getattr(self.config.daemon, k)]
        if fixed:
            log.error("reload refused: only a restart can change these", keys=[f"daemon.{k}" for k in fixed])
            return f"reload refused: daemon.{', daemon.'.join(fixed)} change only with a restart; still serving"
        moved = sorted(n for n in new.stages if n in old.stages and any(
            old.stages[n].placement_of(i) != new.stages[n].placement_of(i)
            for i in range(min(old.stages[n].replicas, new.stages[n].replicas))))
        if moved:
            log.error("reload refused: a replica's placement changed", stages=moved)
            return (f"reload refused: stage(s) {', '.join(moved)} would move between this machine and Ray; only a "
                    "restart moves a running replica (new replicas may go anywhere); still serving")
        back = sorted(n for n in new.stages if n in self._retiring)
        if back:
            return (f"reload refused: stage(s) {', '.join(back)} removed by the last reload still finish their "
                    "jobs; reload again once they have stopped; still serving")
        if self._retiring_replicas:
            names = ", ".join(sorted(h.label for h in self._retiring_replicas))
            return (f"reload refused: replica(s) {names} let go by the last reload still finish their jobs; "
                    "reload again once they have stopped; still serving")
        return None

    def _keys_for(self, new: Config) -> dict[str, str]:
        """Each pipeline's key: the same while its definition is the same, a new one when it changed."""
        keys: dict[str, str] = {}
        for name, definition in new.pipelines.items():
            key = self.keys.get(name)
            if key is None or self.definitions.get(key) != definition:
                key, n = name, 1
                while key in self.definitions and self.definitions[key] != definition:
                    n += 1
                    key = f"{name}~{n}"
                self.definitions[key] = definition
            keys[name] = key
        return keys

    async def _apply(self, group: StageGroup, old: Config, new: Config) -> bool:
        """A stage whose definition changed (its new one in force): replicas added or let go, and new
        workers for the replicas whose own definition changed (one after the other). True if any was
        replaced."""
        before, after = old.stages[group.name], new.stages[group.name]
        fresh, extra = group.resize_to()
        if group.sleeping:
            for h in fresh:                 # they load when the stage wakes
                h.state = WorkerState.SLEEPING
            for h in extra:
                group.drop_retired(h)
            return False
        for h in extra:
            self._retiring_replicas.add(h)
            task = asyncio.get_running_loop().create_task(self._retire_replica(group, h))
            self._removals.add(task)
            task.add_done_callback(self._removals.discard)
        await asyncio.gather(*(h.start() for h in fresh))
        changed = [h for h in group.replicas[:group.active]
                   if h not in fresh and not before.same_worker(after, h.replica)]
        for h in changed:
            await h.restart("its definition changed in a config reload", new.daemon.drain_timeout_s)
        return bool(changed)

    async def _retire_replica(self, group: StageGroup, handle: StageHandle) -> None:
        """A replica a smaller `replicas` let go: it takes no new job; it stops once its jobs are done."""
        try:
            while handle.running or self.scheduler.dispatch.assigned(group.name)[handle.replica] > 0:
                await asyncio.sleep(0.2)
            await handle.stop(self.config.daemon.stop_grace_s)
            group.drop_retired(handle)
            log.info("replica removed", stage=handle.label)
        finally:
            self._retiring_replicas.discard(handle)

    async def _retire(self, name: str, handle: StageGroup) -> None:
        """A stage removed by a reload: stop its worker once no live job needs it."""
        try:
            while any(name in job.record.stages for job in self.scheduler.live_jobs.values()):
                await asyncio.sleep(0.2)
            await handle.stop(self.config.daemon.stop_grace_s)
            if self.stages.get(name) is handle:
                del self.stages[name]
            log.info("stage removed", stage=name)
        finally:
            self._retiring.pop(name, None)

    async def stop(self) -> None:
        for task in list(self._removals):
            task.cancel()

