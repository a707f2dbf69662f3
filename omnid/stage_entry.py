"""A stage worker's entry points: what the supervisor starts a stage's process with.

The supervisor (supervisor/workers/) knows the worker's code only by these two, and imports
nothing of omnid/worker/ itself. Each imports the worker when it is called:
- `stage_main`, in the worker's own process: `multiprocessing` hands it over by its name (spawned,
  or forked from an engine's fork server), so the supervisor's process never loads the worker;
- `ray_actor_class`, in the supervisor, for a Ray-placed stage: Ray needs the actor's class in the
  driver, which ships it to the node that runs it.
"""

from __future__ import annotations

from multiprocessing.connection import Connection
from typing import Any

from omnid.protocol import WorkerSpec


def stage_main(spec: WorkerSpec, conn: Connection, log_pipe: Connection | None = None) -> None:
    """A local worker's process: `omnid.worker.bootstrap.worker_main`."""
    from omnid.worker.bootstrap import worker_main

    worker_main(spec, conn, log_pipe)


def ray_actor_class() -> Any:
    """`omnid.worker.ray_actor.StageActor` as a Ray actor class (imports ray)."""
    from omnid.worker.ray_actor import remote_class

    return remote_class()
