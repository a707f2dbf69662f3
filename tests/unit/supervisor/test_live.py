"""The config in force (`omnid.supervisor.live`), in-process: one holder every part reads, and what a
reload lets go keeps its own; a stage's sleep as a `SleepState`; the daemon's life as a `DaemonState`."""

from __future__ import annotations

import asyncio
from pathlib import Path
from typing import Any

from omnid.config import Config, parse
from omnid.supervisor.http.api.app import DaemonInfo
from omnid.supervisor.live import Follower, Live
from omnid.supervisor.workers.stage_group import StageGroup
from omnid.vocabulary import DaemonState, SleepState, WorkerState

FIXTURES = Path(__file__).resolve().parents[2] / "fixtures"


def make_config(tmp: Path, stages: dict[str, int], **daemon: Any) -> Config:
    """Stages by name -> replicas; one pipeline through all of them."""
    stage = {"engine": "python", "function": "teststages:echo", "python_path": [str(FIXTURES)]}
    return parse({"daemon": {"socket": str(tmp / "s.sock"), "state_dir": str(tmp / "state"),
                             "lock_dir": str(tmp / "lock"), **daemon},
                  "stages": {s: dict(stage, replicas=n) for s, n in stages.items()},
                  "pipelines": {"p": {"stages": list(stages)}}}, base=tmp)


class FakeReplica(Follower):
    """What a stage group needs of a replica here: its config (a `Follower`), a state, `reconfigure`."""

    def __init__(self, live: Live, name: str, replica: int, config: Config | None) -> None:
        super().__init__(live, config)
        self.name, self.replica = name, replica
        self.state = WorkerState.READY
        self.running: tuple[str, ...] = ()
        self.told: list[Config] = []          # the configs its worker was told of (`Reconfigure`)

    def reconfigure(self) -> None:
        self.follow()
        self.told.append(self.config)

    async def stop(self, grace: float) -> None:
        self.state = WorkerState.STOPPED

    async def wake(self) -> None:
        self.state = WorkerState.READY


def group_of(live: Live, name: str, config: Config | None = None) -> StageGroup:
    return StageGroup(live, name, lambda c, n, i: FakeReplica(live, n, i, c), config=config)  # type: ignore[arg-type,return-value]


def test_the_holder_is_shared_and_a_config_is_wrapped_once(tmp_path: Path) -> None:
    config = make_config(tmp_path, {"a": 1})
    live = Live(config)
    assert live.config is config and live.worker is config
    assert live.keys == {"p": "p"} and live.worker is config
    group = group_of(live, "a")
    new = make_config(tmp_path, {"a": 1}, heartbeat_timeout_s=7)
    live.put_to_workers(new)                # one assignment: the group and its replicas read it
    assert group.config is new and group.replicas[0].config is new
    live.switch(new, {"p": "p~2"})
    assert live.config is new and live.keys == {"p": "p~2"}


def test_what_a_reload_lets_go_keeps_its_config_and_the_rest_follows(tmp_path: Path) -> None:
    old = make_config(tmp_path, {"a": 3, "gone": 1})
    new = make_config(tmp_path, {"a": 2, "added": 1})
    live = Live(old)
    a, gone = group_of(live, "a"), group_of(live, "gone")
    added = group_of(live, "added", config=new)     # made before the new config is in force
    assert added.config is new and added.replicas[0].config is new and live.worker is old
    # the reloader's order: keep what is let go, put the new config in force, then reconfigure
    gone.keep()
    a.keep(first=new.stages["a"].replicas)
    live.put_to_workers(new)
    added.follow()
    a.reconfigure()
    assert gone.config is old and gone.stage == old.stages["gone"] and gone.replicas[0].config is old
    assert a.config is new and [h.config for h in a.replicas] == [new, new, old]
    assert [h.told for h in a.replicas] == [[new], [new], []]       # the retiring one is not told
    assert added.replicas[0].told == []
    newer = make_config(tmp_path, {"a": 2, "added": 1}, heartbeat_timeout_s=9)
    live.put_to_workers(newer)
    assert added.config is newer and added.replicas[0].config is newer and a.replicas[0].config is newer
    assert gone.config is old and a.replicas[2].config is old


def test_a_stage_sleep_is_one_state(tmp_path: Path) -> None:
    async def test() -> None:
        group = group_of(Live(make_config(tmp_path, {"a": 1})), "a")
        assert group.sleep_state is SleepState.AWAKE and not group.resting
        group.doze()
        assert group.dozing and not group.sleeping and group.resting
        assert await group.sleep(0)
        group.dozed()
        assert group.sleep_state is SleepState.ASLEEP and group.sleeping and not group.dozing
        assert group.state is WorkerState.SLEEPING
        task = group.wake_soon()
        assert group.state is WorkerState.STARTING      # a wake asked for
        assert await task
        assert group.sleep_state is SleepState.AWAKE and group.state is WorkerState.READY and not group.resting
        group.doze()
        task = group.wake_soon()                        # a job came while it fell asleep: it stays awake
        assert not await group.sleep(0)
        group.dozed()
        assert await task and group.sleep_state is SleepState.AWAKE
    asyncio.run(test())


def test_the_daemon_life_reads_as_before() -> None:
    info = DaemonInfo(1, 0.0, "x")
    seen = []
    for state in DaemonState:
        info.state = state
        seen.append((info.starting, info.draining, info.stopping))
    assert seen == [(True, False, False), (False, False, False), (False, True, False), (False, True, True)]
