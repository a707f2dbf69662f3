"""Per-job state is cleaned everywhere once a job is over, whatever way it ended.

The lesson of the design's predecessor: per-request state that is never cleaned
up. Workers report in their heartbeat how many jobs they still keep state for
(outbox copies, fan-in parts, admitted parts, running work); the supervisor
reports its live jobs and pending cancel timers in /v1/health.
"""

from __future__ import annotations

import time

from conftest import RunningDaemon, py_stage, wait_started


def test_no_job_state_survives_the_job(start_daemon) -> None:
    d: RunningDaemon = start_daemon(
        {"a": py_stage("sleep", defaults={"seconds": 0.2}), "b": py_stage("sleep", defaults={"seconds": 0.2}),
         "c": py_stage("echo"), "bad": py_stage("fail")},
        {"abc": {"stages": ["a", "b", "c"]}, "fails": {"stages": ["a", "bad"]}},
        {"cancel_grace_s": 2.0})
    ok = [d.submit("abc", {"text": f"ok{i}"}) for i in range(3)]
    slow = d.submit("abc", {"text": "slow"}, params={"b": {"seconds": 5}})
    queued = d.submit("abc", {"text": "queued"})
    failing = d.submit("fails", {"text": "boom"})
    timing_out = d.submit("abc", {"text": "late"}, params={"a": {"seconds": 5}}, timeout_s=1.0)
    wait_started(d, slow, "b")
    # while it runs, the state is there: b runs it, a keeps its copy until the job ends
    deadline = time.monotonic() + 5
    while time.monotonic() < deadline:
        busy = d.stages()
        if busy["a"]["tracked_jobs"] >= 1 and busy["b"]["tracked_jobs"] >= 1:
            break
        time.sleep(0.05)
    assert busy["a"]["tracked_jobs"] >= 1 and busy["b"]["tracked_jobs"] >= 1, busy
    assert d.client.health()["live_jobs"] >= 2
    d.client.cancel(queued)
    d.client.cancel(slow)
    ends = {j: d.wait(j)["state"] for j in ok + [slow, queued, failing, timing_out]}
    assert [ends[j] for j in ok] == ["succeeded"] * 3
    assert ends[slow] == ends[queued] == "cancelled"
    assert ends[failing] == "failed" and ends[timing_out] == "timed_out"
    # every worker forgets every job; the supervisor keeps nothing live
    deadline = time.monotonic() + 10
    while time.monotonic() < deadline:
        stages = d.stages()
        health = d.client.health()
        if all(s["tracked_jobs"] == 0 and not s["running"] for s in stages.values()) \
                and health["live_jobs"] == 0 and health["stopping_jobs"] == 0:
            break
        time.sleep(0.1)
    assert all(s["tracked_jobs"] == 0 for s in stages.values()), stages
    assert health["live_jobs"] == 0 and health["stopping_jobs"] == 0, health
    # nothing had to be killed to get there
    assert all(s["restarts"] == 0 for s in stages.values())
