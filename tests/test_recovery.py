"""Recovery paths found in review: each one a real fault on real processes.

- a GPU stage whose restart crashes while loading comes back (no deadlock on its device lock);
- a restarted worker that cannot load its engine (exit status EXIT_LOAD_FAILED) gets exactly one
  more try: the stage is failed when that fails too, and ready again when it loads;
- kills the supervisor orders for ignored cancels do not count toward `max_restarts`;
- when an upstream and its downstream die together, a job that sat in the downstream's
  queue is recomputed upstream instead of waiting for its timeout.
"""

from __future__ import annotations

import os
import re
import signal
import time
from pathlib import Path

import pytest
from conftest import RunningDaemon, py_stage, sleeper, wait_for, wait_started

from omnictl.client import ApiError
from omnid.protocol import EXIT_LOAD_FAILED

FLAKY_LOADER = '''
import os, time
if os.path.exists(os.environ["CRASH_MARKER"]):
    os._exit(9)                      # dies while loading, like a CUDA init crash

def work(inputs, params, ctx):
    time.sleep(float(params.get("seconds", 0.05)))
    return {"text": str(inputs.get("text", "")) + "|flaky"}
'''


def test_restart_that_crashes_while_loading_comes_back(start_daemon, tmp_path: Path) -> None:
    marker = tmp_path / "crash"
    (tmp_path / "flaky.py").write_text(FLAKY_LOADER)
    stage = {"engine": "python", "function": "flaky:work", "python_path": [str(tmp_path)], "devices": [0],
             "env": {"CRASH_MARKER": str(marker)}}
    d: RunningDaemon = start_daemon({"flaky": stage, "peer": {**stage, "devices": [0]}},
                                    {"p": {"stages": ["flaky"]}, "q": {"stages": ["peer"]}},
                                    {"restart_backoff_s": 0.3, "max_restarts": 10})
    first_pid = d.stage_pid("flaky")
    marker.touch()                              # the next load of this stage crashes
    os.kill(first_pid, signal.SIGKILL)
    wait_for(lambda: d.stages()["flaky"]["restarts"] >= 2, 20, "a reload that crashed, and another try")
    marker.unlink()                             # the fault clears
    snap = d.wait_stage_state("flaky", ("ready",), timeout=30)
    assert snap["pid"] != first_pid
    assert "exited with status 9" in snap["last_error"]
    assert d.wait(d.submit("p", {"text": "back"}))["state"] == "succeeded"
    # the stage that shares GPU 0 was never blocked by it
    assert d.wait(d.submit("q", {"text": "peer"}))["state"] == "succeeded"


# Its import raises while the marker file exists (the worker then exits with EXIT_LOAD_FAILED),
# and notes each failed load; a marker that says "once" is removed by the load that fails.
LOAD_FAILER = '''
import os
MARKER = os.environ["LOAD_FAIL_MARKER"]
if os.path.exists(MARKER):
    with open(os.environ["LOAD_FAIL_LOG"], "a") as f:
        f.write(f"{os.getpid()}\\n")
    with open(MARKER) as f:
        once = f.read() == "once"
    if once:
        os.unlink(MARKER)
    raise RuntimeError("the engine cannot load now")

def work(inputs, params, ctx):
    return {"text": "loaded", "pid": os.getpid()}
'''


@pytest.mark.parametrize("second_load", ["fails too", "succeeds"])
def test_restart_that_cannot_load_gets_one_more_try(second_load: str, start_daemon, tmp_path: Path) -> None:
    marker, failed_loads = tmp_path / "fail-to-load", tmp_path / "failed-loads"
    (tmp_path / "load_failer.py").write_text(LOAD_FAILER)
    stage = {"engine": "python", "function": "load_failer:work", "python_path": [str(tmp_path)],
             "env": {"LOAD_FAIL_MARKER": str(marker), "LOAD_FAIL_LOG": str(failed_loads)}}
    # max_restarts is far away: only the load-failure rule can fail the stage here.
    d: RunningDaemon = start_daemon({"lf": stage}, {"p": {"stages": ["lf"]}},
                                    {"restart_backoff_s": 0.1, "max_restarts": 10})
    first_pid = d.stage_pid("lf")
    marker.write_text("once" if second_load == "succeeds" else "always")
    os.kill(first_pid, signal.SIGKILL)

    def spawned() -> int:
        return len(re.findall(r'stage worker spawned.*(?:stage=|"stage": ")lf\b', d.log()))

    if second_load == "fails too":
        snap = d.wait_stage_state("lf", ("failed",), timeout=20)
        # one restart after the kill (its load fails), then exactly one more try (fails too)
        assert snap["restarts"] == 2, snap
        assert snap["pid"] is None
        err = snap["last_error"]
        assert f"could not load its engine (exit status {EXIT_LOAD_FAILED})" in err, err
        assert "RuntimeError: the engine cannot load now" in err, err
        assert "not restarting: loading fails" in err, err
        time.sleep(0.6)                    # past any backoff: no third try comes
        assert d.stages()["lf"]["restarts"] == 2
        assert len(failed_loads.read_text().split()) == 2
        assert spawned() == 3, d.log()     # the first worker and the two that could not load
        with pytest.raises(ApiError) as e:
            d.submit("p")
        assert e.value.status == 503 and e.value.code == "stage_failed", e.value
    else:
        snap = wait_for(lambda: (s := d.stages()["lf"])["state"] == "ready" and s["restarts"] == 2 and s,
                        20, "the second try to load")
        assert snap["pid"] not in (None, first_pid)
        assert len(failed_loads.read_text().split()) == 1
        assert f"could not load its engine (exit status {EXIT_LOAD_FAILED})" in snap["last_error"]
        doc = d.wait(d.submit("p"), timeout=30)
        assert doc["state"] == "succeeded", doc
        assert d.client.output(doc["id"], "text")[0] == b"loaded"
        assert spawned() == 3, d.log()


def test_cancel_grace_kills_do_not_count_as_crashes(start_daemon) -> None:
    d: RunningDaemon = start_daemon({"stubborn": py_stage("stubborn", defaults={"seconds": 30})},
                                    {"p": {"stages": ["stubborn"]}},
                                    {"cancel_grace_s": 0.3, "max_restarts": 1, "restart_backoff_s": 0.1})
    for i in range(3):
        job = d.submit("p", {"text": str(i)})
        wait_started(d, job, "stubborn")
        assert d.client.cancel(job)["state"] == "cancelled"
        wait_for(lambda: d.stages()["stubborn"]["restarts"] == i + 1, 20, f"restart {i + 1}")
        d.wait_stage_state("stubborn", ("ready",), timeout=30)
    snap = d.stages()["stubborn"]
    assert snap["state"] == "ready", snap            # three kills of ours, max_restarts = 1: still serving
    assert "did not stop within" in snap["last_error"]


def test_upstream_and_downstream_die_together(start_daemon) -> None:
    d: RunningDaemon = start_daemon({"u": sleeper(0.05), "d": sleeper(0.5, queue_capacity=2)},
                                    {"p": {"stages": ["u", "d"]}}, {"restart_backoff_s": 0.1})
    jobs = [d.submit("p", {"text": f"j{k}"}) for k in range(3)]
    wait_started(d, jobs[0], "d")
    # jobs 1 and 2 sit in d's queue, already handed over by u (idle now)
    wait_for(lambda: all(d.client.job(j)["stages"]["d"]["state"] == "queued" for j in jobs[1:]), 10,
             "jobs 1 and 2 queued in d")
    u_pid, d_pid = d.stage_pid("u"), d.stage_pid("d")
    os.kill(u_pid, signal.SIGKILL)
    os.kill(d_pid, signal.SIGKILL)
    assert d.wait(jobs[0], timeout=30)["state"] == "failed"          # it was running in d
    rest = [d.wait(j, timeout=60) for j in jobs[1:]]
    assert [r["state"] for r in rest] == ["succeeded", "succeeded"], [(r["state"], r["error"]) for r in rest]
    assert [d.client.output(j, "text")[0].decode() for j in jobs[1:]] == ["j1|u|d", "j2|u|d"]


def test_pipeline_retries_a_job_whose_worker_died(start_daemon) -> None:
    d: RunningDaemon = start_daemon({"up": py_stage("echo"), "victim": py_stage("sleep", defaults={"seconds": 0.5})},
                                    {"p": {"stages": ["up", "victim"], "retries": 1}}, {"restart_backoff_s": 0.1})
    job = d.submit("p", {"text": "again"})
    wait_started(d, job, "victim")
    first_pid = d.stage_pid("victim")
    os.kill(first_pid, signal.SIGKILL)
    doc = d.wait(job, timeout=60)
    assert doc["state"] == "succeeded", doc
    assert d.client.output(job, "text")[0].decode() == "echo:again|victim"
    retry = [e for e in d.events(job) if e["type"] == "error"]
    assert len(retry) == 1 and "retrying (attempt 2)" in retry[0]["message"] and "SIGKILL" in retry[0]["message"]
    assert d.stage_pid("victim") != first_pid
    # a second death of the same job is not retried again: retries = 1
    job2 = d.submit("p", {"text": "twice"})
    wait_started(d, job2, "victim")
    pid = d.stage_pid("victim")
    os.kill(pid, signal.SIGKILL)
    wait_for(lambda: d.stages()["victim"]["pid"] not in (None, pid) and job2 in d.stages()["victim"]["running"],
             30, "the retry to run in a new worker")
    os.kill(d.stage_pid("victim"), signal.SIGKILL)
    doc2 = d.wait(job2, timeout=60)
    assert doc2["state"] == "failed" and doc2["error"]["code"] == "worker_died"
