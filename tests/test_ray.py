"""Ray-placed stages (`placement = "ray"`) on a real local Ray cluster: a head and a second raylet
on this machine, started once for the whole test session (`ray_cluster`), and stopped at its end.

The second raylet has a custom resource (`node2`) and a label; the Ray-placed stages ask for it, so
their actors run there (checked: the actor's process is a child of that raylet). What is checked:

- a pipeline whose second stage runs on the second raylet succeeds, its node shows in `/v1/stages`
  and `omnictl stages`; large values (fp16 and bf16 tensors, a numpy array, bytes) cross both ways
  (local -> Ray -> local) bit-exact, with dtype and shape; arrays arrive read-only, tensors writable;
  once the jobs end, Ray's store holds none of their values (the stages still up);
- backpressure: a Ray-placed stage's watermark blocks its local upstream (its queue never goes
  past it, the upstream's blocked time grows, order is kept); streaming windows into and out of a
  Ray-placed stage are the same windows as between two local stages;
- cancel and timeout stop the job inside the Ray-placed worker, as for a local one; a job that
  ignores its cancel past `cancel_grace_s` gets its actor killed and replaced, and the job queued
  behind it there is not lost;
- the worker's stdout, stderr and log records reach `omnictl logs STAGE` and the daemon's stderr;
- a reload that changes a Ray-placed stage gives it a new actor; one that would move it is refused;
- `kill -9` of the actor mid-job fails the job naming the stage and the death, the stage comes back
  (a new actor), and the next job succeeds; with `retries`, the job is run again and succeeds;
  a hung actor (SIGSTOP: no heartbeats) is killed with `ray.kill` and replaced;
- after the jobs (and the daemon) end, no StageActor process is left, Ray's object store holds no
  object and the stage's resources are free again.

Skipped, saying why, only when `ray` cannot be imported (`make test` installs the `ray` extra).
Never `ray stop`: it would stop every Ray cluster of this user on the machine, other runs' too;
the fixture stops the processes of its own cluster (found by its temp dir) instead.
"""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import psutil
import pytest
from conftest import FIXTURES, RunningDaemon, py_stage, wait_for, wait_gone, wait_started
from raycluster import CLIENT_ENV, RayCluster, start_cluster

pytest.importorskip("ray", reason="the `ray` extra is not installed (pip install 'omnid[ray]')")
pytestmark = pytest.mark.ray

Start = Callable[..., RunningDaemon]
MB = 1 << 20


@pytest.fixture(scope="session")
def ray_cluster() -> Iterator[RayCluster]:
    """A Ray head (2 CPUs, 300 MB object store) and a second raylet (1 CPU, 200 MB, resource `node2`,
    label omnid-node=node2), on this machine, for the whole session; stopped at its end."""
    cluster = start_cluster()
    try:
        yield cluster
    finally:
        cluster.stop()


@pytest.fixture
def start_ray_daemon(start_daemon: Start, ray_cluster: RayCluster) -> Callable[..., RunningDaemon]:
    def start(stages: dict[str, Any], pipelines: dict[str, Any], daemon: dict[str, Any] | None = None,
              **kw: Any) -> RunningDaemon:
        return start_daemon(stages, pipelines, {"ray_address": ray_cluster.address, **(daemon or {})},
                            env={"PYTHONPATH": ray_cluster.env["PYTHONPATH"], "RAY_DISABLE_USAGE_STATS": "1",
                                 **CLIENT_ENV}, **kw)
    return start


def on_node2(**extra: Any) -> dict[str, Any]:
    return {"placement": "ray", "ray": {"num_cpus": 0, "resources": {"node2": 1}}, **extra}


def ray_stage(d: RunningDaemon, name: str) -> dict[str, Any]:
    snap = d.stages()[name]
    assert snap["placement"] == "ray", snap
    return snap


def wait_store_empty(cluster: RayCluster) -> None:
    """Ray's object store holds no object, on any node."""
    def store_empty() -> bool:
        return "Plasma memory usage 0 MiB, 0 objects" in cluster.cli("memory", "--stats-only")
    try:
        wait_for(store_empty, 20, "Ray's object store to hold no object", every=1.0)
    except AssertionError as e:
        raise AssertionError(f"{e}\n{cluster.cli('memory', '--stats-only')}") from None


def check_nothing_left(cluster: RayCluster) -> None:
    """No StageActor process, no object in Ray's store, node2's resources all free."""
    wait_for(lambda: not cluster.actors(), 15, "every StageActor process to be gone")
    wait_store_empty(cluster)
    wait_for(lambda: "0.0/4.0 node2" in cluster.cli("status"), 20, "node2's resources to be free", every=1.0)


def test_second_stage_on_the_second_raylet_and_large_values_both_ways(start_ray_daemon: Start,
                                                                       ray_cluster: RayCluster) -> None:
    shm = {"engine": "python", "python_path": [str(FIXTURES)]}
    stages = {"front": py_stage("echo"), "back": py_stage("sleep", **on_node2()),
              "produce": {**shm, "function": "shmstages:produce"},
              "relay": {**shm, "function": "raystages:relay", **on_node2()},
              "check": {**shm, "function": "shmstages:check"}}
    d = start_ray_daemon(stages, {"p": {"stages": ["front", "back"]},
                                  "big": {"stages": ["produce", "relay", "check"]}})
    back = ray_stage(d, "back")
    assert back["state"] == "ready" and back["node"] and back["ray"]["node_id"] and back["pid"], back
    node2 = ray_cluster.raylet("node2")
    assert psutil.Process(back["pid"]).ppid() == node2.pid, "the actor does not run on the second raylet"
    job = d.submit("p", {"text": "hi"}, {"back": {"seconds": 0.2}})
    doc = d.wait(job, 60)
    assert doc["state"] == "succeeded", doc["error"]
    assert d.client.output(job, "text")[0] == b"echo:hi|back"
    assert int(d.client.output(job, "pid")[0]) == back["pid"]
    out = subprocess.run([sys.executable, "-m", "omnictl", "--socket", str(d.socket), "stages"],
                         capture_output=True, text=True, timeout=30).stdout
    assert f"ray:{back['node']}/{back['ray']['node_id'][:8]}" in out and "NODE" in out, out
    # RSS and CPU, sampled by the actor on its node
    wait_for(lambda: (d.stages()["back"]["rss_bytes"] or 0) > 10 << 20, 10, "the actor's RSS in /v1/stages")
    # Large values: local -> Ray-placed -> local, exact, each way through the object store.
    writable = "f16,bf16"       # tensors: copies of their own; the array "arr": zero-copy, read-only
    job = d.submit("big", {}, {"produce": {"f16_mb": 8, "bf16_mb": 2, "arr_mb": 4, "blob_mb": 2, "seed": 5},
                               "relay": {"expect_writable": writable}})
    doc = d.wait(job, 120)
    assert doc["state"] == "succeeded", f"{doc['error']}\n{d.diagnose(job)}"
    rep = json.loads(d.client.output(job, "report")[0])
    for name in ("f16", "bf16", "arr", "blob"):
        assert rep["got"][name]["digest"] == rep["sent"][name]["digest"], name
    assert rep["got"]["bf16"]["dtype"] == "bfloat16" and rep["got"]["f16"]["shape"] == [8 * MB // 2 // 512, 512]
    wait_for(lambda: all(d.stages()[s]["tracked_jobs"] == 0 for s in ("back", "relay")), 10,
             "the Ray-placed workers to forget the jobs")
    wait_store_empty(ray_cluster)          # the jobs' values are gone from the store, the stages still up
    d.stop()
    check_nothing_left(ray_cluster)


def _metric(text: str, name: str, stage: str) -> float:
    m = re.search(rf'^{name}(?:_total)?\{{replica="0",stage="{stage}"\}} (\S+)$', text, re.M)
    assert m, f"no {name} for stage {stage} in /metrics"
    return float(m.group(1))


def test_backpressure_and_windows_through_ray_placed_stages(start_ray_daemon: Start) -> None:
    slow = 0.4
    stages = {"fast": py_stage("sleep", defaults={"seconds": 0.1}),
              "slow": py_stage("sleep", defaults={"seconds": slow}, queue_capacity=1, **on_node2()),
              "src": py_stage("stream_source"), "join": py_stage("stream_join"),
              "rsrc": py_stage("stream_source", **on_node2()), "rjoin": py_stage("stream_join", **on_node2())}
    window = {"window": 3, "map": {"text": "text"}}
    d = start_ray_daemon(stages, {
        "fs": {"stages": ["fast", "slow"]},
        "w_local": {"stages": ["src", "join"], "edges": [{"from": "src", "to": "join", **window}]},
        "w_to_ray": {"stages": ["src", "rjoin"], "edges": [{"from": "src", "to": "rjoin", **window}]},
        "w_from_ray": {"stages": ["rsrc", "join"], "edges": [{"from": "rsrc", "to": "join", **window}]}})
    # Backpressure: a Ray-placed stage's watermark blocks its local upstream, as a local one's does.
    n = 5
    jobs = [d.submit("fs", {"text": f"j{k}"}) for k in range(n)]
    depths: list[int] = []
    blocked = 0.0
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline:
        snap = d.stages()["slow"]
        depths.append(snap["queue_depth"])
        blocked = max(blocked, _metric(d.client.metrics(), "omnid_stage_blocked_seconds", "fast"))
        if all(d.client.job(j)["state"] == "succeeded" for j in jobs[-1:]):
            break
        time.sleep(0.03)
    docs = [d.wait(j, 30) for j in jobs]
    assert [doc["state"] for doc in docs] == ["succeeded"] * n, [doc["error"] for doc in docs]
    assert max(depths) == 1, f"the Ray-placed stage's queue went past its watermark: {depths}"
    assert blocked > slow / 2, f"the upstream was never blocked by the Ray-placed stage: {blocked}"
    ends = [doc["stages"]["slow"]["finished_at"] for doc in docs]
    assert ends == sorted(ends)
    for k, job in enumerate(jobs):
        assert d.client.output(job, "text")[0].decode() == f"j{k}|fast|slow"
    # Windows (window = 3) into and out of a Ray-placed stage: the same windows as between local ones.
    logs = {}
    for p in ("w_local", "w_to_ray", "w_from_ray"):
        first = "rsrc" if p == "w_from_ray" else "src"
        job = d.submit(p, {"text": "x"}, {first: {"n": 10, "delay": 0.02}})
        doc = d.wait(job, 60)
        assert doc["state"] == "succeeded", f"{p}: {doc['error']}"
        logs[p] = d.client.output(job, "log")[0].decode()
    assert logs["w_local"] == "s0;s1;s2;|s3;s4;s5;|s6;s7;s8;|s9;", logs
    assert logs["w_to_ray"] == logs["w_local"] and logs["w_from_ray"] == logs["w_local"], logs


def test_cancel_and_timeout_stop_the_ray_placed_worker(start_ray_daemon: Start, tmp_path: Path) -> None:
    d = start_ray_daemon({"t": py_stage("ticker", **on_node2()),
                          "st": py_stage("stubborn", defaults={"seconds": 60}, **on_node2())},
                         {"p": {"stages": ["t"]}, "s": {"stages": ["st"]}}, {"cancel_grace_s": 1})
    pid = ray_stage(d, "t")["pid"]
    for how, timeout_s in (("cancel", None), ("timeout", 1.0)):
        ticks, stopped = tmp_path / f"{how}.ticks", tmp_path / f"{how}.stopped"
        params = {"t": {"seconds": 30, "ticks": str(ticks), "stopped": str(stopped)}}
        job = d.submit("p", {"text": how}, params, timeout_s=timeout_s)
        wait_started(d, job, "t")
        wait_for(ticks.exists, 10, "the ticker to tick")
        t0 = time.monotonic()
        if how == "cancel":
            d.client.cancel(job)
        doc = d.wait(job, 30)
        assert doc["state"] == ("cancelled" if how == "cancel" else "timed_out"), doc
        if how == "timeout":
            assert doc["error"]["stage"] == "t", doc["error"]
        # It stopped inside the engine, in the actor's process (not by a restart).
        wait_for(stopped.exists, 5, f"the ticker to see its {how}")
        assert stopped.read_text() == f"cancelled {pid}\n"
        assert time.monotonic() - t0 < 5
    snap = d.stages()["t"]
    assert snap["pid"] == pid and snap["restarts"] == 0, "cancel and timeout must not restart the worker"
    wait_for(lambda: d.stages()["t"]["tracked_jobs"] == 0, 10, "the worker to forget both jobs")
    # A job that ignores its cancel past cancel_grace_s: its actor is killed and replaced, and the job
    # queued behind it in that actor is not lost.
    old = ray_stage(d, "st")["pid"]
    job = d.submit("s")
    wait_started(d, job, "st")
    behind = d.submit("s", params={"st": {"seconds": 0.1}})
    assert d.client.cancel(job)["state"] == "cancelled"
    snap = wait_for(lambda: (x := d.stages()["st"])["restarts"] == 1 and x["state"] in ("ready", "busy") and x,
                    30, "the stubborn actor to be killed and warm again")
    assert snap["pid"] not in (None, old) and "cancel" in (snap["last_error"] or ""), snap
    doc = d.wait(behind, 30)
    assert doc["state"] == "succeeded" and d.client.output(behind, "text")[0] == b"done anyway", doc


def test_a_ray_placed_workers_output_reaches_omnictl_logs(start_ray_daemon: Start, tmp_path: Path) -> None:
    (tmp_path / "talkstage.py").write_text(
        "import logging, sys\n"
        "def run(inputs, params, ctx):\n"
        "    print('stdout says', inputs['text'])\n"
        "    print('stderr says', inputs['text'], file=sys.stderr)\n"
        "    logging.getLogger('x').warning('logger x says %s', inputs['text'])\n"
        "    return {'text': inputs['text']}\n")
    d = start_ray_daemon({"s": {"engine": "python", "function": "talkstage:run", "python_path": [str(tmp_path)],
                                **on_node2()}}, {"p": {"stages": ["s"]}})
    job = d.submit("p", {"text": "marker-23"})
    assert d.wait(job, 30)["state"] == "succeeded"

    def logged() -> list[str]:
        lines = list(d.client.logs("s"))
        return lines if any("logger x says marker-23" in line for line in lines) else []
    lines = [line.split(" ", 1)[1] for line in wait_for(logged, 10, "the Ray-placed worker's lines in `omnictl logs s`")]
    assert "stdout says marker-23" in lines and "stderr says marker-23" in lines, lines
    record = json.loads(next(line for line in lines if "logger x says marker-23" in line))
    assert record["level"] == "warning" and record["stage"] == "s"
    assert "\nstdout says marker-23\n" in d.log()       # forwarded to the daemon's stderr too


def test_a_reload_restarts_a_ray_placed_stage_and_refuses_to_move_it(start_ray_daemon: Start,
                                                                    ray_cluster: RayCluster) -> None:
    from conftest import daemon_config
    pipelines = {"p": {"stages": ["s"]}}
    daemon = {"ray_address": ray_cluster.address}
    d = start_ray_daemon({"s": py_stage("echo", defaults={"tag": "one"}, **on_node2())}, pipelines)
    first = ray_stage(d, "s")["pid"]

    def sighup(expect: str) -> None:
        before = d.log().count(expect)
        d.proc.send_signal(signal.SIGHUP)
        wait_for(lambda: d.log().count(expect) > before, 60, f"{expect!r} in the daemon's log")

    # its definition changed: a new actor, which serves the new definition
    daemon_config(d.dir, {"s": py_stage("echo", defaults={"tag": "two"}, **on_node2())}, pipelines, daemon)
    sighup("reloaded")
    snap = d.wait_stage_state("s", ("ready",))
    assert snap["pid"] not in (None, first) and snap["placement"] == "ray", snap
    job = d.submit("p", {"text": "x"})
    assert d.wait(job, 30)["state"] == "succeeded" and d.client.output(job, "text")[0] == b"two:x"
    # moving a running replica between this machine and Ray takes a restart
    daemon_config(d.dir, {"s": py_stage("echo", defaults={"tag": "two"})}, pipelines, daemon)
    sighup("reload refused: a replica's placement changed")
    assert d.stages()["s"]["pid"] == snap["pid"] and d.stages()["s"]["placement"] == "ray"


def test_kill_9_of_the_actor_mid_job(start_ray_daemon: Start, ray_cluster: RayCluster) -> None:
    d = start_ray_daemon({"front": py_stage("echo"), "back": py_stage("sleep", **on_node2())},
                         {"p": {"stages": ["front", "back"]}, "r": {"stages": ["front", "back"], "retries": 1}},
                         {"heartbeat_timeout_s": 3})
    first = ray_stage(d, "back")["pid"]
    job = d.submit("p", {"text": "a"}, {"back": {"seconds": 5}})
    wait_started(d, job, "back")
    os.kill(first, signal.SIGKILL)
    doc = d.wait(job, 30)
    assert doc["state"] == "failed" and doc["error"]["code"] == "worker_died", doc
    assert doc["error"]["stage"] == "back" and f"pid {first}" in doc["error"]["message"], doc["error"]
    snap = d.wait_stage_state("back", ("ready",), timeout=60)
    assert snap["pid"] not in (None, first) and snap["restarts"] == 1, snap
    assert "died" in (snap["last_error"] or ""), snap
    assert wait_gone([first]) == []
    # With retries, a kill mid-job runs it again on the new actor.
    second = snap["pid"]
    job = d.submit("r", {"text": "b"}, {"back": {"seconds": 2}})
    wait_started(d, job, "back")
    os.kill(second, signal.SIGKILL)
    doc = d.wait(job, 60)
    assert doc["state"] == "succeeded", doc["error"]
    assert d.client.output(job, "text")[0] == b"echo:b|back"
    third = d.wait_stage_state("back", ("ready",))
    assert third["restarts"] == 2
    # A hung actor (SIGSTOP: no heartbeat) is killed (ray.kill) and replaced, as a hung local worker.
    os.kill(third["pid"], signal.SIGSTOP)
    wait_for(lambda: d.stages()["back"]["restarts"] == 3, 60, "the hung actor to be killed and restarted")
    snap = d.wait_stage_state("back", ("ready",), timeout=60)
    assert "was killed (ray.kill): hung: no heartbeat for 3 s" in snap["last_error"], snap["last_error"]
    assert wait_gone([third["pid"]], timeout=15) == []
    job = d.submit("p", {"text": "c"}, {"back": {"seconds": 0.1}})
    assert d.wait(job, 30)["state"] == "succeeded"
    d.stop()
    check_nothing_left(ray_cluster)
