"""Real faults: a stage worker killed with SIGKILL mid-job, a stage that keeps
crashing, a worker that hangs (SIGSTOP), and the supervisor itself killed.

Every fault is done to real processes; the tests then wait (with deadlines)
for the daemon to notice and recover, and check that no job was lost or left
behind, and that no process outlived its supervisor.
"""

from __future__ import annotations

import os
import signal
import threading
import time
from collections.abc import Callable

import inject
import psutil
import pytest
from conftest import RunningDaemon, close_in, py_stage, sleeper, wait_for, wait_gone, wait_started, watch_descriptors

from omnictl.client import ApiError

# ------------------------------------------------------------------ a worker killed mid-job


def test_sigkill_worker_mid_job_fails_that_job_only(start_daemon: Callable[..., RunningDaemon]) -> None:
    # `up` is quick; `victim` is slow with a queue of 1, so at the kill there is a job
    # running in victim, one in victim's input queue, one held by `up` (blocked on
    # victim's watermark) and more waiting in front of `up`.
    d = start_daemon({"up": sleeper(0.05), "victim": sleeper(0.4, queue_capacity=1)},
                     {"p": {"stages": ["up", "victim"]}})
    jobs = [d.submit("p", {"text": f"j{k}"}) for k in range(5)]
    wait_started(d, jobs[0], "victim")
    wait_for(lambda: d.stages()["victim"]["queue_depth"] == 1, 10, "a job in victim's input queue")
    wait_for(lambda: d.client.job(jobs[2])["stages"]["up"]["state"] == "succeeded", 10,
             "up to finish job 2 (and block delivering it)")
    assert d.client.job(jobs[0])["stages"]["victim"]["state"] == "running"
    old_pid = d.stage_pid("victim")
    up_pid = d.stage_pid("up")

    os.kill(old_pid, signal.SIGKILL)

    killed = d.wait(jobs[0], timeout=30)
    assert killed["state"] == "failed", killed
    msg = killed["error"]["message"]
    assert "victim" in msg and "SIGKILL" in msg, msg
    assert killed["error"]["stage"] == "victim"

    rest = [d.wait(j, timeout=60) for j in jobs[1:]]
    assert [r["state"] for r in rest] == ["succeeded"] * 4, [(r["state"], r["error"]) for r in rest]
    for k, job in enumerate(jobs[1:], start=1):
        assert d.client.output(job, "text")[0].decode() == f"j{k}|up|victim"

    snap = d.wait_stage_state("victim", ("ready", "busy"))
    assert snap["pid"] and snap["pid"] != old_pid
    assert snap["restarts"] == 1
    assert "SIGKILL" in snap["last_error"]
    assert d.stage_pid("up") == up_pid                       # only the killed stage restarted
    assert d.wait(d.submit("p", {"text": "after"}))["state"] == "succeeded"


def test_sigkill_source_worker_keeps_queued_jobs(start_daemon: Callable[..., RunningDaemon]) -> None:
    # Jobs waiting in (and in front of) a pipeline's first stage survive its death.
    d = start_daemon({"first": sleeper(0.4, queue_capacity=1)}, {"p": {"stages": ["first"]}})
    jobs = [d.submit("p", {"text": f"j{k}"}) for k in range(4)]
    wait_started(d, jobs[0], "first")
    wait_for(lambda: d.stages()["first"]["queue_depth"] == 1, 10, "a job in first's input queue")
    os.kill(d.stage_pid("first"), signal.SIGKILL)
    assert d.wait(jobs[0], timeout=30)["state"] == "failed"
    rest = [d.wait(j, timeout=60) for j in jobs[1:]]
    assert [r["state"] for r in rest] == ["succeeded"] * 3, [(r["state"], r["error"]) for r in rest]


def test_sigkill_upstream_blocked_on_watermark_loses_nothing(start_daemon: Callable[..., RunningDaemon]) -> None:
    # `up` dies while it holds a finished job it could not yet hand to the full `down`:
    # that job's outputs die with it, so it must run again in the new `up`, and run once in `down`.
    d = start_daemon({"up": sleeper(0.05), "down": sleeper(0.4, queue_capacity=1)},
                     {"p": {"stages": ["up", "down"]}})
    jobs = [d.submit("p", {"text": f"j{k}"}) for k in range(5)]
    wait_started(d, jobs[0], "down")
    wait_for(lambda: d.client.job(jobs[2])["stages"]["up"]["state"] == "succeeded", 10,
             "up to finish job 2 (and block delivering it)")
    old_pid = d.stage_pid("up")
    os.kill(old_pid, signal.SIGKILL)

    docs = [d.wait(j, timeout=60) for j in jobs]
    assert [doc["state"] for doc in docs] == ["succeeded"] * 5, [(doc["state"], doc["error"]) for doc in docs]
    for k, job in enumerate(jobs):
        assert d.client.output(job, "text")[0].decode() == f"j{k}|up|down"
        started = [ev["stage"] for ev in d.events(job) if ev["type"] == "stage_started"]
        assert started.count("down") == 1, (k, started)
    snap = d.wait_stage_state("up", ("ready", "busy"))
    assert snap["pid"] != old_pid and snap["restarts"] == 1
    assert d.stages()["down"]["restarts"] == 0


# ------------------------------------------------------------------ a stage that keeps crashing


@pytest.mark.skipif(not inject.supported(), reason="needs x86-64 Linux, to close a descriptor inside a process (ptrace)")
def test_a_worker_whose_exit_watch_was_taken_is_neither_dead_nor_forgotten(
        start_daemon: Callable[..., RunningDaemon]) -> None:
    # Every descriptor by which the supervisor watches the worker is taken from under its event
    # loop (the file gone, the number kept): no wake will come. The worker is not taken for dead,
    # and when it really dies, the supervisor still sees it and restarts it.
    d = start_daemon({"s": sleeper(0.05)}, {"p": {"stages": ["s"]}})
    pid = d.stage_pid("s")
    fds = watch_descriptors(d.proc.pid, pid)
    assert fds, "found no descriptor that watches the worker"
    close_in(d.proc.pid, fds, keep_numbers=True)
    assert [d.wait(d.submit("p", {"text": f"j{k}"}))["state"] for k in range(5)] == ["succeeded"] * 5
    snap = d.stages()["s"]
    assert snap["pid"] == pid and snap["restarts"] == 0, snap
    os.kill(pid, signal.SIGKILL)
    snap = wait_for(lambda: (s := d.stages()["s"])["pid"] not in (None, pid) and s["state"] == "ready" and s,
                    30, "the dead worker to be seen and restarted")
    assert snap["restarts"] == 1, snap
    assert d.wait(d.submit("p", {"text": "after"}))["state"] == "succeeded"


def test_crash_looping_stage_fails_for_good(start_daemon: Callable[..., RunningDaemon]) -> None:
    d = start_daemon({"crashy": py_stage("crash"), "fine": py_stage("echo")},
                     {"bad": {"stages": ["crashy"]}, "good": {"stages": ["fine"]}},
                     {"max_restarts": 2})
    # Each job kills the worker that takes it: 3 crashes > max_restarts = 2.
    jobs = [d.submit("bad") for _ in range(3)]
    docs = [d.wait(j, timeout=60) for j in jobs]
    assert all(doc["state"] == "failed" for doc in docs), docs
    assert "crashy" in docs[0]["error"]["message"] and "status 7" in docs[0]["error"]["message"], docs[0]["error"]

    snap = d.wait_stage_state("crashy", ("failed",), timeout=30)
    assert snap["pid"] is None
    assert "not restarting" in snap["last_error"], snap["last_error"]

    with pytest.raises(ApiError) as err:
        d.submit("bad")
    assert err.value.status == 503 and err.value.code == "stage_failed", err.value
    assert "crashy" in err.value.message

    ok, body = d.client.ready()
    assert not ok and body["not_ready"] == ["crashy"]
    assert d.client.health()["status"] == "ok"
    # Other pipelines keep working.
    doc = d.wait(d.submit("good", {"text": "x"}))
    assert doc["state"] == "succeeded"
    assert d.stages()["crashy"]["state"] == "failed"          # sticky


def test_crash_loop_limit_allows_exactly_max_restarts(start_daemon: Callable[..., RunningDaemon]) -> None:
    # max_restarts = 2: two crashes are restarted, the third within the window fails the stage.
    d = start_daemon({"k": py_stage("echo")}, {"p": {"stages": ["k"]}},
                     {"max_restarts": 2, "restart_backoff_s": 0.1})
    for n in (1, 2):
        pid = d.stage_pid("k")
        os.kill(pid, signal.SIGKILL)
        # (the snapshot itself whether it failed or came back: the assert below says which)
        snap = wait_for(lambda: s if (s := d.stages()["k"])["state"] == "failed" or
                        s["state"] == "ready" and s["pid"] not in (None, pid) else None, 10, f"restart {n} of stage k")
        assert snap["state"] == "ready" and snap["restarts"] == n, f"after {n} crashes (max_restarts 2): {snap}"
    os.kill(d.stage_pid("k"), signal.SIGKILL)
    snap = d.wait_stage_state("k", ("failed",), timeout=20)
    assert snap["restarts"] == 2 and snap["pid"] is None, snap
    assert "crashed 3 times" in snap["last_error"] and "not restarting" in snap["last_error"], snap["last_error"]
    time.sleep(0.5)                       # longer than any backoff: no restart comes after all
    snap = d.stages()["k"]
    assert snap["state"] == "failed" and snap["restarts"] == 2, snap
    with pytest.raises(ApiError) as err:
        d.submit("p", {"text": "x"})
    assert err.value.status == 503 and err.value.code == "stage_failed", err.value


# ------------------------------------------------------------------ a hung worker


def test_hung_worker_is_killed_and_restarted(start_daemon: Callable[..., RunningDaemon]) -> None:
    d = start_daemon({"h": py_stage("hang")}, {"p": {"stages": ["h"]}}, {"heartbeat_timeout_s": 1.5})
    old_pid = d.stage_pid("h")

    # Watch /v1/ready while it happens: it must say 503, naming the stage, during the restart.
    not_ready: list[list[str]] = []
    stop = threading.Event()

    def watch() -> None:
        while not stop.is_set():
            try:
                ok, body = d.client.ready()
                if not ok:
                    not_ready.append(body["not_ready"])
            except Exception:
                pass
            time.sleep(0.01)

    watcher = threading.Thread(target=watch, daemon=True)
    watcher.start()
    try:
        t0 = time.monotonic()
        job = d.submit("p")
        doc = d.wait(job, timeout=30)
        took = time.monotonic() - t0
        assert doc["state"] == "failed", doc
        msg = doc["error"]["message"]
        assert "'h'" in msg and "no heartbeat for 1.5 s" in msg, msg
        assert 1.4 <= took < 10, f"the hang was noticed after {took:.2f} s (timeout 1.5 s)"
        snap = wait_for(lambda: (s := d.stages()["h"])["restarts"] == 1 and s["state"] == "ready" and s,
                        30, "the hung worker to be replaced")
    finally:
        stop.set()
        watcher.join(5)
    assert snap["pid"] != old_pid
    assert "heartbeat" in snap["last_error"], snap["last_error"]
    assert wait_gone([old_pid], 5) == []
    # The restart (backoff, then a fresh load) lasts a few hundred ms; polled every 10 ms.
    assert not_ready, "/v1/ready never said 503 while the stage restarted"
    assert all(names == ["h"] for names in not_ready), not_ready
    ok, _ = d.client.ready()
    assert ok


# ------------------------------------------------------------------ the supervisor killed


def test_sigkill_supervisor_leaves_no_worker(start_daemon: Callable[..., RunningDaemon]) -> None:
    d = start_daemon({"a": sleeper(5), "b": py_stage("echo")}, {"ab": {"stages": ["a", "b"]}})
    job = d.submit("ab", {"text": "x"})
    wait_started(d, job, "a")                         # a busy worker too
    workers = d.worker_pids()
    assert {d.stage_pid("a"), d.stage_pid("b")} <= set(workers)
    assert d.kill9() == -signal.SIGKILL
    survivors = wait_gone(workers, timeout=5)
    assert survivors == [], [psutil.Process(p).cmdline() for p in survivors]
