"""The fork server's start: what a CPU stage worker finds imported already.

A stage worker used to be spawned bare, and spent most of its start importing its engine's libraries
(vLLM, transformers and torch: ~12 CPU-s and 600 MB of pages, measured on 2 cores). omnid instead
starts a fork server per engine (supervisor/workers/fork_servers.py, the first time a CPU worker of
that engine starts), which imports this module: it sets the environment every CPU worker has
(offline, quiet libraries, no GPU, the engine's `worker_env`) and imports the modules that the
engine named in `OMNID_PRELOAD` declares as its `preload` (engines/capabilities.py). Each CPU worker is then a fork of the server: its imports are done and
their pages shared, and its own set-up (bootstrap.setup_environment) follows as before.

Only CPU stages without an `env` of their own come from here (supervisor/workers/worker_process.py):
a GPU stage must see its own devices before CUDA is looked at, and a stage's `env` may set what a
library reads as it is imported. A module that fails to import here is left to the worker, which
imports it again and reports what it raises, as it would have without a server. The server freezes
what it imported out of the cyclic garbage collector before it forks, so that no worker's collection
touches (and copies) those shared pages.
"""

from __future__ import annotations

import importlib
import os

from omnid import logs
from omnid.engines.capabilities import CAPABILITIES
from omnid.prctl import die_with_parent, set_process_name
from omnid.worker import bootstrap

ENV = "OMNID_PRELOAD"       # the engines whose modules to import, comma-separated
LOG_ENV = "OMNID_PRELOAD_LOG"   # the daemon's log is JSON lines: "json", "json+journald" (else empty)


def _preload() -> None:
    # The server ends with the daemon at once (killed, as its workers are then), not through its
    # EOF and the exit handlers of all it imported.
    die_with_parent(os.getppid())
    names = os.environ.pop(ENV, "")
    set_process_name(f"omnid-fs-{names}")          # omnid-fs-vllm, omnid-fs-diffus(ers), omnid-fs-python
    os.environ["CUDA_VISIBLE_DEVICES"] = ""         # the server serves CPU stages only
    log = os.environ.pop(LOG_ENV, "")
    engines = [CAPABILITIES[e] for e in names.split(",") if e in CAPABILITIES]
    for k, v in bootstrap.QUIET_ENV + tuple(kv for caps in engines for kv in caps.worker_env):
        os.environ.setdefault(k, v)
    if log.startswith("json"):      # what the imports print (vLLM's "Triton is installed, but..."), as records
        logs.wrap_foreign(True, log.endswith("journald"))
    with logs.printed_as_records(f"fork-server:{names}"):
        for name in dict.fromkeys(m for caps in engines for m in caps.preload):
            try:
                importlib.import_module(name)
            except Exception:       # noqa: BLE001 (the worker imports it again and reports what it raises)
                pass
    # What it imported, out of the cyclic collector's sight before any fork: a worker's own collections
    # (its freeze before its first job, and every one after) then walk none of it, and its pages stay
    # shared. Without this, a worker forked from the vLLM server copied 134 MB of them on its first
    # full collection (measured: its private memory 2 MB before that collection, 136 MB after).
    bootstrap.freeze_heap()


_preload()
