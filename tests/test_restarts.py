"""Nothing accepted is lost to a stop: real daemons, real SIGTERMs and kill -9s, restarted on the
same state dir.

- kill -9 of the daemon with jobs running and queued: on the next start the queued ones run, in
  order; the running one runs again if its pipeline allows a retry, else fails saying why;
  finished jobs' outputs are the same bytes.
- SIGTERM drains: no new job (503 `draining`, with Retry-After), the running job finishes, the
  queued ones are kept (not failed) and run after the next start; STOPPING=1 and STATUS= lines
  for systemd; exit 0; the socket is removed.
"""

from __future__ import annotations

import os
import signal
import socket
import time
from collections.abc import Callable

from conftest import RunningDaemon, py_stage, short_tmpdir, wait_for, wait_gone, wait_started

from omnictl.client import ApiError

Start = Callable[..., RunningDaemon]
TERMINAL = {"succeeded", "failed", "cancelled", "timed_out"}


def states(d: RunningDaemon, jobs: list[str]) -> list[str]:
    return [d.client.job(j)["state"] for j in jobs]


def test_kill_9_of_the_daemon_loses_no_accepted_job(start_daemon: Start) -> None:
    d = short_tmpdir()
    stages = {"work": py_stage("sleep", defaults={"seconds": 0.3}), "once": py_stage("echo")}
    pipelines = {"p": {"stages": ["work"], "retries": 1}, "done": {"stages": ["once"]}}
    first = start_daemon(stages, pipelines, dir=d)
    finished = first.wait(first.submit("done", {"text": "keep my bytes"}))
    assert finished["state"] == "succeeded"
    before = {o["name"]: first.client.output(finished["id"], o["name"])[0] for o in finished["outputs"]}
    jobs = [first.submit("p", {"text": f"j{k}"}) for k in range(11)]
    wait_started(first, jobs[0], "work")
    assert states(first, jobs)[1:] == ["queued"] * 10
    workers = first.worker_pids()
    first.kill9()
    assert wait_gone(workers) == []

    second = start_daemon(stages, pipelines, dir=d)
    ends = [second.wait(j, timeout=60) for j in jobs]
    assert [e["state"] for e in ends] == ["succeeded"] * 11, [(e["state"], e["error"]) for e in ends]
    for k, end in enumerate(ends):
        assert second.client.output(end["id"], "text")[0].decode() == f"j{k}|work"
    # The queued ones ran in their order; the running one ran again (retries = 1), saying so.
    started = [e["stages"]["work"]["started_at"] for e in ends[1:]]
    assert started == sorted(started)
    rerun = [e for e in second.events(jobs[0]) if e["type"] == "error"]
    assert rerun and "daemon was interrupted" in rerun[0]["message"], rerun
    # Nothing a client was told is contradicted: states never went back, finished outputs are the same bytes.
    assert [e["state"] for e in second.events(jobs[0]) if e["type"] == "state"] == ["queued", "running", "succeeded"]
    assert {o["name"]: second.client.output(finished["id"], o["name"])[0] for o in finished["outputs"]} == before


def test_a_running_job_without_retries_fails_saying_the_daemon_was_interrupted(start_daemon: Start) -> None:
    d = short_tmpdir()
    stages = {"slow": py_stage("sleep", defaults={"seconds": 30})}
    first = start_daemon(stages, {"p": {"stages": ["slow"]}}, dir=d)
    job = first.submit("p", {"text": "x"})
    wait_started(first, job, "slow")
    first.kill9()
    second = start_daemon(stages, {"p": {"stages": ["slow"]}}, dir=d)
    doc = second.client.job(job)
    assert doc["state"] == "failed" and doc["error"]["code"] == "daemon_restarted", doc
    assert "interrupted while this job was running" in doc["error"]["message"]


def test_sigterm_drains_running_jobs_and_keeps_the_queued_ones(start_daemon: Start) -> None:
    d = short_tmpdir()
    notify = d / "notify.sock"
    sink = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
    sink.bind(str(notify))
    sink.settimeout(0.1)
    stages = {"work": py_stage("sleep", defaults={"seconds": 1.5})}
    pipelines = {"p": {"stages": ["work"]}}
    first = start_daemon(stages, pipelines, {"drain_timeout_s": 20}, dir=d, env={"NOTIFY_SOCKET": str(notify)})
    running = first.submit("p", {"text": "finish me"})
    queued = [first.submit("p", {"text": f"later{k}"}) for k in range(3)]
    wait_started(first, running, "work")
    t0 = time.monotonic()
    first.proc.send_signal(signal.SIGTERM)
    # While it drains: new jobs are refused with 503 draining (and Retry-After), the API still answers.
    refused = wait_for(lambda: _refusal(first), 10, "a 503 draining answer")
    assert refused.status == 503 and refused.code == "draining", refused
    assert first.proc.wait(30) == 0
    took = time.monotonic() - t0
    assert not first.socket.exists()                          # removed on the way out
    messages = []
    while True:
        try:
            messages.append(sink.recv(4096).decode())
        except (TimeoutError, BlockingIOError, socket.timeout):
            break
    sink.close()
    assert any("STOPPING=1" in m and "STATUS=draining" in m for m in messages), messages
    # The running job finished during the drain; the queued ones were kept, not failed.
    second = start_daemon(stages, pipelines, dir=d)
    assert second.client.job(running)["state"] == "succeeded"
    assert took < 1.5 + 10, took
    ends = [second.wait(j, timeout=60) for j in queued]
    assert [e["state"] for e in ends] == ["succeeded"] * 3, [(e["state"], e["error"]) for e in ends]
    for k, end in enumerate(ends):
        assert second.client.output(end["id"], "text")[0].decode() == f"later{k}|work"


def _refusal(d: RunningDaemon) -> ApiError | None:
    try:
        d.client.submit("p", {"text": "too late"})
    except ApiError as e:
        return e
    except OSError:
        return None
    return None


def test_a_drain_that_runs_out_of_time_leaves_the_job_for_the_next_start(start_daemon: Start) -> None:
    d = short_tmpdir()
    stages = {"slow": py_stage("sleep", defaults={"seconds": 30})}
    pipelines = {"p": {"stages": ["slow"], "retries": 1}}
    first = start_daemon(stages, pipelines, {"drain_timeout_s": 0.5}, dir=d)
    job = first.submit("p", {"text": "long"})
    wait_started(first, job, "slow")
    assert first.stop() == 0
    second = start_daemon({"slow": py_stage("sleep", defaults={"seconds": 0.1})}, pipelines, dir=d)
    end = second.wait(job, timeout=30)
    assert end["state"] == "succeeded" and end["error"] is None, end   # run again: retries = 1


def test_a_second_sigterm_cuts_the_drain_short(start_daemon: Start) -> None:
    stages = {"slow": py_stage("sleep", defaults={"seconds": 30})}
    d = start_daemon(stages, {"p": {"stages": ["slow"]}}, {"drain_timeout_s": 60})
    job = d.submit("p", {"text": "long"})
    wait_started(d, job, "slow")
    d.proc.send_signal(signal.SIGTERM)
    wait_for(lambda: _refusal(d) is not None, 10, "the drain to begin")
    t0 = time.monotonic()
    d.proc.send_signal(signal.SIGTERM)
    assert d.proc.wait(20) == 0
    assert time.monotonic() - t0 < 15
    assert os.path.exists(d.state_dir / "omnid.db")


def test_a_restart_without_an_unfinished_jobs_pipeline_and_stage_still_starts(start_daemon: Start) -> None:
    d = short_tmpdir()
    stages = {"keep": py_stage("echo"), "legacy": py_stage("sleep", defaults={"seconds": 30})}
    first = start_daemon(stages, {"p": {"stages": ["keep"]}, "old": {"stages": ["legacy"]}}, dir=d)
    job = first.submit("old", {"text": "x"})
    wait_started(first, job, "legacy")
    first.kill9()
    second = start_daemon({"keep": stages["keep"]}, {"p": {"stages": ["keep"]}}, dir=d)   # both gone
    doc = second.client.job(job)
    assert doc["state"] == "failed" and "without its pipeline 'old'" in doc["error"]["message"], doc
    assert second.wait(second.submit("p", {"text": "y"}))["state"] == "succeeded"
