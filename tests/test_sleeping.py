"""Sleeping stages (`idle_unload_s`, `omnictl stage sleep|wake`): real daemons, real processes, real locks.

- a stage idle for `idle_unload_s` stops its workers (no process left) and lets go of its GPU lock
  files; `/v1/stages` says `sleeping`, readiness counts it as ready-to-wake;
- the next job wakes it (events `stage_waking`, then `stage_awake` with the time it took) and
  succeeds; so do several jobs that arrive together, and a job whose pipeline reaches the
  sleeping stage through an edge; the job's timeout covers the wait;
- by hand: `omnictl stage sleep` (refused while the stage has work) and `omnictl stage wake`.
"""

from __future__ import annotations

import functools
import signal
from collections.abc import Callable
from pathlib import Path

import psutil
import pytest
from conftest import RunningDaemon, py_stage, wait_for, wait_gone, wait_started
from conftest import omnictl as run_omnictl

from omnid.locks import DeviceBusy, DeviceLocks

Start = Callable[..., RunningDaemon]
omnictl = functools.partial(run_omnictl, timeout=60)



def pid_of(d: RunningDaemon, stage: str) -> int | None:
    pid: int | None = d.stages()[stage]["pid"]
    return pid


def test_an_idle_stage_sleeps_gives_its_gpu_back_and_wakes_for_the_next_job(start_daemon: Start) -> None:
    stages = {"z": py_stage("echo", idle_unload_s=1, devices=[0]), "other": py_stage("echo")}
    d = start_daemon(stages, {"p": {"stages": ["z"]}, "q": {"stages": ["other"]}})
    first = pid_of(d, "z")
    assert first is not None
    with pytest.raises(DeviceBusy):
        DeviceLocks(d.lock_dir).acquire([0])
    snap = d.wait_stage_state("z", ("sleeping",), timeout=15)
    assert snap["pid"] is None and snap["idle_unload_s"] == 1 and snap["slept_at"]
    assert wait_gone([first]) == [], "the sleeping stage's worker is still alive"
    assert not [c for c in psutil.Process(d.proc.pid).children(recursive=True) if "omnid:z" in " ".join(c.cmdline())]
    with DeviceLocks(d.lock_dir) as other_program:      # the GPU is free for others now
        other_program.acquire([0])
    ok, body = d.client.ready()
    assert ok and body["stages"]["z"] == "sleeping", body
    assert 'omnid_stage_sleeping{stage="z"} 1.0' in d.client.metrics()
    assert d.stages()["other"]["state"] == "ready", "a stage without idle_unload_s never sleeps"

    job = d.submit("p", {"text": "wake up"})
    doc = d.wait(job, timeout=60)
    assert doc["state"] == "succeeded", doc
    assert d.client.output(job, "text")[0].decode() == "echo:wake up"
    events = d.events(job)
    kinds = [e["type"] for e in events]
    assert "stage_waking" in kinds and "stage_awake" in kinds, kinds
    assert kinds.index("stage_waking") < kinds.index("stage_awake") < kinds.index("stage_started")
    awake = next(e for e in events if e["type"] == "stage_awake")
    assert awake["stage"] == "z" and awake["wake_s"] > 0
    second = pid_of(d, "z")
    assert second not in (None, first)
    with pytest.raises(DeviceBusy):                     # held again while awake
        DeviceLocks(d.lock_dir).acquire([0])
    assert d.stages()["z"]["wake_s"] == awake["wake_s"]
    d.wait_stage_state("z", ("sleeping",), timeout=15)  # and asleep again once idle


def test_jobs_that_come_together_all_wake_it_once_and_succeed(start_daemon: Start) -> None:
    stages = {"front": py_stage("echo"), "z": py_stage("echo", idle_unload_s=1, replicas=2)}
    pipelines = {"p": {"stages": ["z"]}, "chain": {"stages": ["front", "z"]}}
    d = start_daemon(stages, pipelines)
    d.wait_stage_state("z", ("sleeping",), timeout=15)
    jobs = [d.submit("p", {"text": f"j{k}"}) for k in range(5)] + [d.submit("chain", {"text": "via an edge"})]
    docs = [d.wait(j, timeout=60) for j in jobs]
    assert [doc["state"] for doc in docs] == ["succeeded"] * 6, [doc["error"] for doc in docs]
    assert d.client.output(jobs[-1], "text")[0].decode() == "echo:echo:via an edge"
    assert d.log().count('"event": "waking stage"') == 1
    assert all(r["pid"] for r in d.stages()["z"]["replicas"]), "both replicas woke"


def test_the_jobs_timeout_covers_the_wait_for_a_slow_wake(start_daemon: Start, tmp_path: Path) -> None:
    (tmp_path / "slowload.py").write_text(
        "import time\n"
        "time.sleep(2.0)            # a model that takes its time to load\n"
        "def run(inputs, params, ctx):\n"
        "    return {'text': 'loaded'}\n")
    stage = {"engine": "python", "function": "slowload:run", "python_path": [str(tmp_path)]}
    d = start_daemon({"z": stage}, {"p": {"stages": ["z"]}})
    answer = omnictl(d, "stage", "sleep", "z")
    assert answer.returncode == 0 and "going to sleep" in answer.stdout, answer
    d.wait_stage_state("z", ("sleeping",), timeout=15)
    hurried = d.submit("p", {}, timeout_s=0.5)
    doc = d.wait(hurried, timeout=30)
    assert doc["state"] == "timed_out", doc
    patient = d.wait(d.submit("p", {}, timeout_s=60), timeout=60)
    assert patient["state"] == "succeeded", patient


def test_sleep_and_wake_by_hand(start_daemon: Start) -> None:
    d = start_daemon({"z": py_stage("sleep", defaults={"seconds": 3})}, {"p": {"stages": ["z"]}})
    job = d.submit("p", {"text": "busy"})
    wait_started(d, job, "z")
    refused = omnictl(d, "stage", "sleep", "z")
    assert refused.returncode == 4 and "has jobs in progress" in refused.stderr, refused
    d.client.cancel(job)
    wait_for(lambda: not d.stages()["z"]["running"], 15, "the cancelled job to stop")
    asleep = omnictl(d, "stage", "sleep", "z")
    assert asleep.returncode == 0, asleep
    d.wait_stage_state("z", ("sleeping",), timeout=15)
    health = omnictl(d, "health")
    assert health.returncode == 0 and "sleeping" in health.stdout, health.stdout
    woke = omnictl(d, "stage", "wake", "z")
    assert woke.returncode == 0 and "z: ready" in woke.stdout, woke
    assert d.stages()["z"]["state"] == "ready" and d.stages()["z"]["pid"]
    again = omnictl(d, "stage", "wake", "z")
    assert again.returncode == 0 and "awake already" in again.stdout
    unknown = omnictl(d, "stage", "sleep", "nope")
    assert unknown.returncode != 0 and "no stage 'nope'" in unknown.stderr


def test_a_reload_while_asleep_keeps_it_asleep_and_it_wakes_with_the_new_definition(start_daemon: Start) -> None:
    d = start_daemon({"z": py_stage("echo")}, {"p": {"stages": ["z"]}})
    assert omnictl(d, "stage", "sleep", "z").returncode == 0
    d.wait_stage_state("z", ("sleeping",), timeout=15)
    config = d.config_path.read_text().replace('[stages."z"]\n', '[stages."z"]\n"replicas" = 2\n')
    d.config_path.write_text(config)
    d.proc.send_signal(signal.SIGHUP)
    wait_for(lambda: len(d.stages()["z"]["replicas"]) == 2, 30, "the reload to add a replica")
    snap = d.stages()["z"]
    assert snap["state"] == "sleeping" and [r["pid"] for r in snap["replicas"]] == [None, None]
    docs = [d.submit("p", {"text": str(k)}) for k in range(2)]
    assert all(d.wait(j, timeout=60)["state"] == "succeeded" for j in docs)
    snap = d.stages()["z"]
    assert snap["state"] in ("ready", "busy") and all(r["pid"] for r in snap["replicas"])
