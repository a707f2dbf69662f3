"""The config in force: held once, read by every part of the supervisor, changed once by a reload.

The daemon makes one `Live` and hands it to the parts it builds (the API, the scheduler, the
reloader, each stage and each of its replicas); their `.config` reads it. A reload (reload.py)
changes it, in two steps, each done once for everyone: the workers' config (`worker`) before the
stages whose definition changed get new workers, and the public one (`config`, with the pipelines'
`keys`) at the switch, when new jobs start to use the new pipelines.

A stage or replica a reload lets go keeps the config it ran with until it stops (`Follower.keep`);
one a reload made, before its config is in force, holds that one (`Follower(config=...)`).

Standard library and `omnid.config` only; runs in the event-loop thread, like its readers.
"""

from __future__ import annotations

from omnid.config import Config


class Live:
    """The config in force (one per daemon)."""

    def __init__(self, config: Config) -> None:
        self.config = config        # the public one: pipelines by name (new jobs, the API)
        self.worker = config        # what workers run with: also every pipeline definition live jobs may still name
        self.keys: dict[str, str] = {name: name for name in config.pipelines}   # pipeline name -> its key

    def put_to_workers(self, config: Config) -> None:
        """A reload's first step: the workers' config in force (`worker`), before the stages whose
        definition changed get new workers; the public one stays until the `switch`."""
        self.worker = config

    def switch(self, config: Config, keys: dict[str, str]) -> None:
        """A reload's switch: new jobs use `config`'s pipelines, under the workers' `keys`."""
        self.config = config
        self.keys = keys


class Follower:
    """A part whose `config` is the workers' config in force (`Live.worker`), unless it holds its
    own: one made by a reload before the switch, or let go by a reload (`keep`)."""

    def __init__(self, live: Live, config: Config | None = None) -> None:
        self.live = live
        self._own = config

    @property
    def config(self) -> Config:
        return self._own if self._own is not None else self.live.worker

    def keep(self) -> None:
        """A reload lets this go: it keeps the config it runs with until it stops."""
        self._own = self.config

    def follow(self) -> None:
        """From now on, the config in force."""
        self._own = None
