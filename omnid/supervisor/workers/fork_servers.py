"""The daemon's fork servers: one per engine, each with that engine's libraries imported.

A CPU stage's worker is forked from its engine's server instead of spawned bare (`preload_workers`,
worker_process.context_for): the server imported torch, transformers and vLLM (or diffusers) once,
so a worker's start and every restart skip ~12 CPU-s of imports (vLLM, on 2 cores). One server per
engine, not one for all: a fork carries every page its server holds, so a diffusers worker forked
from a server that had also imported vLLM would count vLLM's pages in its RSS (`max_rss_mb`).

multiprocessing's own fork server is one per process; these are its `ForkServer` class, one
instance each, and a `Popen` that asks its own instance (`_launch` is CPython's, with `self.server`
for the module's global). A server's child is the server's to reap: its exit status comes through its
sentinel (procwatch.exit_of). The server's start is `omnid.worker.preload`, which ties it to this
process (it dies with it, and its workers with it).
"""

from __future__ import annotations

import io
import os
from multiprocessing import forkserver, popen_forkserver, process, reduction, spawn, util
from multiprocessing.context import set_spawning_popen
from typing import Any

from omnid import logs

PRELOAD_ENV = "OMNID_PRELOAD"       # (omnid.worker.preload reads it as the server starts)
PRELOAD_LOG_ENV = "OMNID_PRELOAD_LOG"   # "json" / "json+journald": the daemon's log is JSON lines


class EngineForkServer(forkserver.ForkServer):
    """multiprocessing's fork server, preloading one engine's modules (omnid.worker.preload)."""

    def __init__(self, engine: str) -> None:
        super().__init__()
        self.engine = engine
        self.set_forkserver_preload(["omnid.worker.preload"])

    def start(self) -> int:
        """Start it if it does not run (or died); its pid, the parent of the workers it forks."""
        wrap, journald = logs.wrapping_foreign()
        told = {PRELOAD_ENV: self.engine,   # the server's environment is ours as it starts
                PRELOAD_LOG_ENV: ("json+journald" if journald else "json") if wrap else ""}
        before = {k: os.environ.get(k) for k in told}
        os.environ.update(told)
        try:
            self.ensure_running()
        finally:
            for k, v in before.items():
                if v is None:
                    os.environ.pop(k, None)
                else:
                    os.environ[k] = v
        return int(self._forkserver_pid)     # type: ignore[attr-defined]


class _Popen(popen_forkserver.Popen):
    def __init__(self, process_obj: Any, server: EngineForkServer) -> None:
        self.server = server
        super().__init__(process_obj)

    def _launch(self, process_obj: Any) -> None:     # CPython 3.11's, with self.server
        prep_data = spawn.get_preparation_data(process_obj._name)
        buf = io.BytesIO()
        set_spawning_popen(self)
        try:
            reduction.dump(prep_data, buf)
            reduction.dump(process_obj, buf)
        finally:
            set_spawning_popen(None)
        self.sentinel, w = self.server.connect_to_new_process(self._fds)    # type: ignore[attr-defined]
        _parent_w = os.dup(w)
        self.finalizer = util.Finalize(self, util.close_fds, (_parent_w, self.sentinel))   # type: ignore[attr-defined]
        with open(w, "wb", closefd=True) as f:
            f.write(buf.getbuffer())
        self.pid = forkserver.read_signed(self.sentinel)


_SERVERS: dict[str, EngineForkServer] = {}


def server_for(engine: str) -> EngineForkServer:
    """The engine's server (`start` it before each use: it may have died)."""
    if engine not in _SERVERS:
        _SERVERS[engine] = EngineForkServer(engine)
    return _SERVERS[engine]


class ServerProcess(process.BaseProcess):
    """A process forked by the fork server of the engine it is made with (`engine=`)."""

    _start_method = "forkserver"        # (procwatch.exit_of: its status comes by its sentinel)

    def __init__(self, *args: Any, engine: str, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.engine = engine

    @staticmethod
    def _Popen(process_obj: Any) -> Any:
        return _Popen(process_obj, server_for(process_obj.engine))
