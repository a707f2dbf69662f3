"""A python stage that steps many jobs' sessions together (`sessions = "sessionstages:Counter"`),
through a real daemon: 8 concurrent jobs share steps, each gets its own output; a cancel frees its
slot at the next step and leaves the others' outputs as they would be; one session's exception
fails its job alone; kill -9 of the worker mid-batch fails exactly the jobs it held, naming the
stage, and the next batch runs on the restarted worker.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
from collections.abc import Iterator

import pytest
from conftest import FIXTURES, ROOT, RunningDaemon, module_daemon, short_tmpdir, wait_for


def expected(n: int) -> str:
    return "".join(f"{i} " for i in range(n))


@pytest.fixture(scope="module")
def d() -> Iterator[RunningDaemon]:
    stages = {"talk": {"engine": "python", "sessions": "sessionstages:Counter", "python_path": [str(FIXTURES)],
                       "max_inflight": 8, "queue_capacity": 16, "defaults": {"delay": 0.05}}}
    with module_daemon(short_tmpdir(), stages, {"talk": {"stages": ["talk"]}}, ready_timeout=120) as rd:
        yield rd


def text(d: RunningDaemon, job: str) -> str:
    value, _ = d.client.output(job, "text")
    return value.decode() if isinstance(value, bytes) else str(value)


def test_eight_concurrent_jobs_step_together_each_with_its_own_output(d: RunningDaemon) -> None:
    info = d.stages()["talk"]["info"]
    assert info["loaded"] == ["sessionstages:Counter()"] and info["sessions"]["live"] == 0, info
    jobs = [d.submit("talk", {}, {"talk": {"n": 10 + i}}) for i in range(8)]
    docs = [d.wait(job, timeout=60) for job in jobs]
    assert [doc["state"] for doc in docs] == ["succeeded"] * 8, docs
    assert [text(d, job) for job in jobs] == [expected(10 + i) for i in range(8)]
    widest = [int(d.client.output(job, "widest")[0]) for job in jobs]
    # submitted at once, 0.05 s a step: they share steps (all 8 together once the last joined)
    assert max(widest) == 8, widest


def test_a_cancel_frees_its_slot_and_the_others_output_is_unchanged(d: RunningDaemon) -> None:
    keep = d.submit("talk", {}, {"talk": {"n": 30}})
    drop = d.submit("talk", {}, {"talk": {"n": 1000}})
    wait_for(lambda: d.client.job(drop)["stages"]["talk"]["state"] == "running", 10, "the job to run")
    d.client.cancel(drop)
    assert d.wait(drop, timeout=30)["state"] == "cancelled"
    wait_for(lambda: d.stages()["talk"]["info"]["sessions"]["live"] <= 1, 10, "the slot to be freed")
    assert d.wait(keep, timeout=60)["state"] == "succeeded"
    assert text(d, keep) == expected(30)


def test_the_live_sessions_shown_follow_the_jobs(d: RunningDaemon) -> None:
    """`omnictl stages --json` (GET /v1/stages) shows info.sessions.live as it is, not as at start-up."""
    omnictl = [sys.executable, "-m", "omnictl", "--socket", str(d.socket), "--json", "stages"]
    env = {**os.environ, "PYTHONPATH": str(ROOT)}

    def live() -> int:
        shown = subprocess.run(omnictl, capture_output=True, text=True, timeout=30, env=env, check=True)
        [talk] = [s for s in json.loads(shown.stdout)["stages"] if s["name"] == "talk"]
        return int(talk["info"]["sessions"]["live"])

    held = [d.submit("talk", {}, {"talk": {"n": 1000}}) for _ in range(3)]
    wait_for(lambda: live() == 3, 20, "three live sessions shown")
    d.client.cancel(held[0])
    wait_for(lambda: live() == 2, 20, "two live sessions shown")
    for job in held[1:]:
        d.client.cancel(job)
    assert all(d.wait(job, timeout=30)["state"] == "cancelled" for job in held)
    wait_for(lambda: live() == 0, 20, "no live session shown")


def test_one_sessions_exception_fails_that_job_only(d: RunningDaemon) -> None:
    ok = d.submit("talk", {}, {"talk": {"n": 6}})
    bad = d.submit("talk", {}, {"talk": {"n": 6, "fail_at": 2}})
    doc = d.wait(bad, timeout=30)
    assert doc["state"] == "failed" and "failed at 2" in doc["error"]["message"], doc
    assert d.wait(ok, timeout=30)["state"] == "succeeded" and text(d, ok) == expected(6)


def test_kill_9_mid_batch_fails_the_jobs_it_held_and_the_next_batch_runs(d: RunningDaemon) -> None:
    pid = d.stage_pid("talk")
    held = [d.submit("talk", {}, {"talk": {"n": 1000}}) for _ in range(3)]
    wait_for(lambda: all(d.client.job(j)["stages"]["talk"]["state"] == "running" for j in held), 10,
             "three sessions to run")
    os.kill(pid, signal.SIGKILL)
    for job in held:
        doc = d.wait(job, timeout=30)
        assert doc["state"] == "failed" and doc["error"]["code"] == "worker_died", doc
        assert "stage 'talk'" in doc["error"]["message"], doc
    d.wait_stage_state("talk", ("ready",), timeout=60)
    assert d.stage_pid("talk") != pid
    after = [d.submit("talk", {}, {"talk": {"n": 4}}) for _ in range(2)]
    for job in after:
        assert d.wait(job, timeout=30)["state"] == "succeeded" and text(d, job) == expected(4)
