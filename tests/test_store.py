"""Jobs and their outputs are kept in sqlite and on disk across daemon restarts."""

from __future__ import annotations

import sqlite3

from conftest import RunningDaemon, py_stage, short_tmpdir, wait_started

from omnid.store import JobStore
from omnid.vocabulary import JobRecord, JobState


def test_finished_jobs_outputs_and_events_survive_a_restart(start_daemon) -> None:
    d = short_tmpdir()
    stages = {"a": py_stage("sleep", defaults={"seconds": 0.1}), "b": py_stage("echo"),
              "slow": py_stage("sleep", defaults={"seconds": 30})}
    pipelines = {"ab": {"stages": ["a", "b"]}, "slow": {"stages": ["slow"]}}
    first: RunningDaemon = start_daemon(stages, pipelines, dir=d)
    done = first.wait(first.submit("ab", {"text": "keep me"}))
    assert done["state"] == "succeeded"
    events_before = first.events(done["id"])
    interrupted = first.submit("slow", {"text": "cut short"})
    wait_started(first, interrupted, "slow")
    queued = first.submit("slow", {"text": "never ran"})
    assert first.stop() == 0
    # the stop failed nothing it had accepted: both wait in the store for the next start
    db = JobStore(d / "state")
    records = {j: db.get(j) for j in (interrupted, queued)}
    assert {j: r.state for j, r in records.items() if r} == {interrupted: "running", queued: "queued"}
    assert {u.record.id: u.inputs for u in db.unfinished()} == {interrupted: {"text": "cut short"},
                                                                 queued: {"text": "never ran"}}
    db.close()

    second: RunningDaemon = start_daemon(stages, pipelines, dir=d)
    again = second.client.job(done["id"])
    assert again["state"] == "succeeded" and again["outputs"] == done["outputs"]
    data, ctype = second.client.output(done["id"], "text")
    assert data.decode() == "echo:keep me|a" and ctype.startswith("text/plain")
    assert second.events(done["id"]) == events_before
    listed = [j["id"] for j in second.client.jobs()["jobs"]]
    assert listed[:3] == [queued, interrupted, done["id"]]          # newest first
    cut = second.client.job(interrupted)               # it was running, and its pipeline has no retries
    assert cut["state"] == "failed" and cut["error"]["code"] == "daemon_restarted", cut
    assert "interrupted while this job was running" in cut["error"]["message"]
    wait_started(second, queued, "slow")               # the queued one runs on the next start


def test_unfinished_jobs_are_kept_with_their_inputs(tmp_path) -> None:
    store = JobStore(tmp_path)
    for i, state in enumerate(("queued", "running", "succeeded")):
        store.save(JobRecord(id=f"job{i}", pipeline="p", owner_uid=0, created_at=1.0 + i, timeout_s=60.0,
                             inputs={}, params={}, stages={}, state=JobState(state)))
        store.keep_inputs(f"job{i}", {"prompt": f"p{i}", "file": bytes([i, 255])}, attempts=i)
    store.append_event("job1", 1, {"type": "state"})
    store.drop_inputs("job2")
    store.close()
    # what was written is in the database file itself
    store = JobStore(tmp_path)
    left = store.unfinished()
    assert [(u.record.id, u.record.state, u.inputs, u.attempts, u.events) for u in left] == [
        ("job0", "queued", {"prompt": "p0", "file": b"\x00\xff"}, 0, 0),
        ("job1", "running", {"prompt": "p1", "file": b"\x01\xff"}, 1, 1)]
    store.close()
    rows = dict(sqlite3.connect(tmp_path / "omnid.db").execute("SELECT job, attempts FROM job_inputs"))
    assert rows == {"job0": 0, "job1": 1}


def test_one_daemon_per_state_dir(start_daemon) -> None:
    stages, pipelines = {"a": py_stage("echo")}, {"p": {"stages": ["a"]}}
    first: RunningDaemon = start_daemon(stages, pipelines)
    other = short_tmpdir()
    second: RunningDaemon = start_daemon(stages, pipelines, {"state_dir": str(first.state_dir),
                                                             "socket": str(other / "omnid.sock"),
                                                             "lock_dir": str(other / "lock")},
                                         wait=False, dir=other, expect_exit=1)
    assert second.proc.wait(30) == 1
    assert f"the state dir {first.state_dir} is in use by another omnid (pid {first.proc.pid})" in second.log()
    assert first.wait(first.submit("p", {"text": "still mine"}))["state"] == "succeeded"
