"""A job's life: cancel (queued, running, twice, downstream), timeouts and their
defaults, a stage that ignores a cancel, the queue limit, the event history,
outputs and their content types, and deleting jobs.

Real daemons and real stage workers; waits are on events or polled conditions
with deadlines, durations are asserted with generous bounds.
"""

from __future__ import annotations

import json
import time
from collections.abc import Callable
from pathlib import Path

import pytest
from conftest import RunningDaemon, omnictl, py_stage, sleeper, wait_for, wait_started

from omnictl.client import ApiError, EventsIdleTimeout


def event_types(d: RunningDaemon, job: str) -> list[str]:
    return [ev["type"] for ev in d.events(job)]



# ------------------------------------------------------------------ cancel


def test_cancel_queued_job_is_removed_at_once(start_daemon: Callable[..., RunningDaemon]) -> None:
    d = start_daemon({"s": sleeper(0.5)}, {"p": {"stages": ["s"]}})
    first = d.submit("p", {"text": "first"})
    queued = d.submit("p", {"text": "queued"})
    wait_started(d, first, "s")
    assert d.client.job(queued)["state"] == "queued"

    doc = d.client.cancel(queued)
    assert doc["state"] == "cancelled"                      # at once, in the answer itself
    assert doc["error"]["code"] == "cancelled"
    assert d.client.job(queued)["state"] == "cancelled"

    assert d.wait(first)["state"] == "succeeded"
    # FIFO: a job behind the cancelled one runs and ends, so the stage has gone past it.
    after = d.submit("p", {"text": "after"})
    assert d.wait(after)["state"] == "succeeded"
    types = event_types(d, queued)
    assert "stage_started" not in types, types
    assert types[-1] == "state" and d.events(queued)[-1]["state"] == "cancelled"
    assert d.client.job(queued)["stages"]["s"]["started_at"] is None


def test_cancel_running_job_stops_it_and_the_next_starts(start_daemon: Callable[..., RunningDaemon]) -> None:
    d = start_daemon({"s": py_stage("sleep")}, {"p": {"stages": ["s"]}})
    long = d.submit("p", {"text": "long"}, params={"s": {"seconds": 5}})
    nxt = d.submit("p", {"text": "next"}, params={"s": {"seconds": 0.2}})
    wait_started(d, long, "s")

    t_cancel = time.monotonic()
    doc = d.client.cancel(long)
    assert doc["state"] == "cancelled"
    t_next = wait_started(d, nxt, "s")
    # The sleeping function polls ctx.cancelled(): the next job starts right away,
    # not after the 5 s the cancelled one would have taken.
    assert t_next - t_cancel < 1.5, f"next job started {t_next - t_cancel:.2f} s after the cancel"
    assert d.wait(nxt)["state"] == "succeeded"
    final = d.client.job(long)
    assert final["state"] == "cancelled"
    assert final["finished_at"] - final["started_at"] < 3
    assert final["outputs"] == []
    snap = d.stages()["s"]
    assert snap["restarts"] == 0                # cooperative: no kill was needed


def test_cancel_is_idempotent(start_daemon: Callable[..., RunningDaemon]) -> None:
    d = start_daemon({"s": sleeper(5)}, {"p": {"stages": ["s"]}})
    job = d.submit("p")
    wait_started(d, job, "s")
    first = d.client.cancel(job)
    second = d.client.cancel(job)                           # 200 again (ApiError otherwise)
    assert first["state"] == second["state"] == "cancelled"
    assert first["finished_at"] == second["finished_at"]
    assert first["error"] == second["error"]
    states = [ev["state"] for ev in d.events(job) if ev["type"] == "state"]
    assert states == ["queued", "running", "cancelled"]


def test_downstream_never_starts_a_cancelled_job(start_daemon: Callable[..., RunningDaemon]) -> None:
    d = start_daemon({"a": sleeper(0.5), "b": py_stage("echo")}, {"ab": {"stages": ["a", "b"]}})
    job = d.submit("ab", {"text": "x"})
    wait_started(d, job, "a")
    assert d.client.cancel(job)["state"] == "cancelled"
    # A later job through the same stages shows they have moved past the cancelled one.
    later = d.submit("ab", {"text": "y"})
    assert d.wait(later)["state"] == "succeeded"
    doc = d.client.job(job)
    assert doc["stages"]["b"]["state"] in ("pending", "cancelled"), doc["stages"]
    assert doc["stages"]["b"]["started_at"] is None
    started = [ev["stage"] for ev in d.events(job) if ev["type"] == "stage_started"]
    assert started == ["a"]


def test_cancel_job_held_at_a_full_downstream(start_daemon: Callable[..., RunningDaemon]) -> None:
    # `up` finished job 2 but cannot hand it over (down is busy and its queue of 1 is full):
    # a cancel frees `up` at once and `down` never runs the job.
    d = start_daemon({"up": sleeper(0.05), "down": sleeper(0.5, queue_capacity=1)},
                     {"p": {"stages": ["up", "down"]}})
    jobs = [d.submit("p", {"text": f"j{k}"}) for k in range(4)]
    wait_started(d, jobs[0], "down")
    wait_for(lambda: d.client.job(jobs[2])["stages"]["up"]["state"] == "succeeded", 10,
             "up to finish job 2 (and block delivering it)")
    assert d.client.cancel(jobs[2])["state"] == "cancelled"
    # up moves on to job 3 while down still works on job 0.
    wait_for(lambda: d.client.job(jobs[3])["stages"]["up"]["state"] == "succeeded", 5,
             "up to take job 3 after the cancel")
    docs = [d.wait(j) for j in jobs]
    assert [doc["state"] for doc in docs] == ["succeeded", "succeeded", "cancelled", "succeeded"]
    assert [ev["stage"] for ev in d.events(jobs[2]) if ev["type"] == "stage_started"] == ["up"]
    assert d.stages()["up"]["restarts"] == 0


# ------------------------------------------------------------------ timeouts


def test_job_timeout(start_daemon: Callable[..., RunningDaemon]) -> None:
    d = start_daemon({"slow": sleeper(5)}, {"p": {"stages": ["slow"]}})
    t0 = time.monotonic()
    job = d.submit("p", timeout_s=1)
    doc = d.wait(job)
    took = time.monotonic() - t0
    assert doc["state"] == "timed_out", doc
    assert 0.9 <= took <= 3, f"a 1 s timeout ended the job after {took:.2f} s"
    assert doc["timeout_s"] == 1
    assert doc["error"]["code"] == "timed_out"
    assert "slow" in doc["error"]["message"] and "1 s" in doc["error"]["message"], doc["error"]
    # The stage stopped the job (cooperatively) and serves the next one.
    assert d.wait(d.submit("p", params={"slow": {"seconds": 0.1}}))["state"] == "succeeded"


def test_timeout_defaults_pipeline_then_daemon(start_daemon: Callable[..., RunningDaemon]) -> None:
    d = start_daemon({"slow": sleeper(5)},
                     {"own": {"stages": ["slow"], "timeout_s": 1},
                      "plain": {"stages": ["slow"]}},
                     {"default_timeout_s": 1.5})
    own = d.submit("own")
    assert d.client.job(own)["timeout_s"] == 1
    t0 = time.monotonic()
    doc = d.wait(own)
    assert doc["state"] == "timed_out" and 0.9 <= time.monotonic() - t0 <= 3, doc

    plain = d.submit("plain")
    assert d.client.job(plain)["timeout_s"] == 1.5
    t0 = time.monotonic()
    doc = d.wait(plain)
    assert doc["state"] == "timed_out" and 1.4 <= time.monotonic() - t0 <= 3.5, doc
    assert "slow" in doc["error"]["message"]

    # A job's own timeout_s wins over both.
    mine = d.submit("own", params={"slow": {"seconds": 0.1}}, timeout_s=30)
    assert d.client.job(mine)["timeout_s"] == 30
    assert d.wait(mine)["state"] == "succeeded"


# ------------------------------------------------------------------ the worker itself stops


STOP_BOUND_S = 1.5      # from the cancel (or the job's end on a timeout) to the worker's stop marker


def assert_worker_stopped(d: RunningDaemon, job: str, pid: int, ticks: Path, stopped: Path,
                          since: float) -> None:
    """The stage function saw the stop (its marker), stopped working (no more ticks), and the same,
    now idle, worker is still there (stopped cooperatively, not killed)."""
    wait_for(stopped.exists, STOP_BOUND_S, f"the worker to see the stop of job {job} ({stopped.name})")
    took = time.monotonic() - since
    assert ticks.exists() and ticks.stat().st_size > 0, "the stage never ticked: it never ran"
    size = ticks.stat().st_size
    time.sleep(0.2)                                 # ten ticks' worth
    assert ticks.stat().st_size == size, f"job {job}: the worker kept working after it wrote {stopped.name}"
    how, marker_pid = stopped.read_text().split()
    assert int(marker_pid) == pid, (how, marker_pid, pid)
    snap = wait_for(lambda: (s := d.stages()["t"])["running"] == [] and s, 2,
                    f"the worker to report itself idle after job {job}")
    assert snap["pid"] == pid and snap["restarts"] == 0, snap     # cooperative: no kill was needed
    assert took < STOP_BOUND_S, took


@pytest.mark.parametrize("kind", ["function", "generator"])
@pytest.mark.parametrize("ending", ["cancel", "timeout"])
def test_cancel_and_timeout_stop_the_work_in_the_worker(ending: str, kind: str, tmp_path: Path,
                                                        start_daemon: Callable[..., RunningDaemon]) -> None:
    # A large cancel grace: a worker that ignores the stop is not killed within the test's bounds.
    d = start_daemon({"t": py_stage("ticker" if kind == "function" else "ticker_gen")},
                     {"p": {"stages": ["t"]}}, {"cancel_grace_s": 30})
    pid = d.stage_pid("t")
    ticks, stopped = tmp_path / "ticks", tmp_path / "stopped"
    params = {"t": {"ticks": str(ticks), "stopped": str(stopped)}}
    if ending == "cancel":
        job = d.submit("p", params=params)
        wait_started(d, job, "t")
        wait_for(lambda: ticks.exists() and ticks.stat().st_size >= 4, 5, "the job to tick")
        since = time.monotonic()
        assert d.client.cancel(job)["state"] == "cancelled"
    else:
        job = d.submit("p", params=params, timeout_s=0.5)
        doc = d.wait(job, timeout=10)
        since = time.monotonic()
        assert doc["state"] == "timed_out", doc
        assert ticks.exists(), "the job timed out before the stage ran it"
    assert_worker_stopped(d, job, pid, ticks, stopped, since)
    # and the same worker serves the next job
    done = tmp_path / "done"
    nxt = d.submit("p", params={"t": {"ticks": str(tmp_path / "ticks2"), "stopped": str(done), "seconds": 0.05}})
    assert d.wait(nxt)["state"] == "succeeded"
    assert not done.exists() and d.stage_pid("t") == pid


# ------------------------------------------------------------------ a stage that ignores cancel


def test_stubborn_stage_is_killed_after_grace_and_comes_back(start_daemon: Callable[..., RunningDaemon]) -> None:
    d = start_daemon({"st": py_stage("stubborn", defaults={"seconds": 60})},
                     {"p": {"stages": ["st"]}}, {"cancel_grace_s": 1})
    old_pid = d.stage_pid("st")
    job = d.submit("p")
    wait_started(d, job, "st")
    behind = d.submit("p", params={"st": {"seconds": 0.1}})     # waits in the worker's queue

    t0 = time.monotonic()
    assert d.client.cancel(job)["state"] == "cancelled"
    snap = wait_for(lambda: (s := d.stages()["st"])["restarts"] == 1 and s["state"] in ("ready", "busy") and s,
                    30, "the stubborn worker to be killed and warm again")
    took = time.monotonic() - t0
    assert 0.9 <= took < 15, f"worker came back {took:.2f} s after the cancel (grace 1 s)"
    assert snap["pid"] and snap["pid"] != old_pid
    assert "cancel" in (snap["last_error"] or ""), snap["last_error"]
    # The job behind it was not lost with the worker.
    doc = d.wait(behind)
    assert doc["state"] == "succeeded", doc
    assert d.client.output(behind, "text")[0] == b"done anyway"
    assert d.client.job(job)["state"] == "cancelled"             # terminal states never change
    assert d.wait(d.submit("p", params={"st": {"seconds": 0}}))["state"] == "succeeded"
    assert d.stage_pid("st") == snap["pid"]


# ------------------------------------------------------------------ admission


def test_queue_limit_refuses_without_half_accepting(start_daemon: Callable[..., RunningDaemon]) -> None:
    d = start_daemon({"s": sleeper(5), "e": py_stage("echo")},
                     {"p": {"stages": ["s"]}, "other": {"stages": ["e"]}}, {"max_queued_jobs": 2})
    running = d.submit("p")
    wait_started(d, running, "s")
    queued = [d.submit("p"), d.submit("p")]
    before = d.client.jobs()["jobs"]
    with pytest.raises(ApiError) as err:
        d.submit("p")
    assert err.value.status == 429 and err.value.code == "queue_full", err.value
    assert "max_queued_jobs" in err.value.message and err.value.retry_after == 2, err.value   # (its Retry-After)
    refused = omnictl(d, "submit", "p")
    assert refused.returncode != 0 and "(queue_full) (try again in 2 s)" in refused.stderr, refused.stderr
    after = d.client.jobs()["jobs"]
    assert [j["id"] for j in after] == [j["id"] for j in before]       # nothing half-accepted
    # The limit is per pipeline.
    assert d.wait(d.submit("other", {"text": "x"}))["state"] == "succeeded"
    # A submission wrong in two places is told both, a line each (the error's problems)
    wrong = omnictl(d, "submit", "other", "--input", "text=x", "--param", "zz.a=1", "--param", "yy.b=2")
    assert wrong.returncode == 4 and "the request has 2 problems:\n  - pipeline 'other' has no stage 'zz'" \
        in wrong.stderr and "\n  - pipeline 'other' has no stage 'yy'" in wrong.stderr, wrong.stderr
    # Once a queued job is gone, there is room again.
    d.client.cancel(queued[0])
    extra = d.submit("p")
    for job in (running, queued[1], extra):
        d.client.cancel(job)
    assert {d.client.job(j)["state"] for j in (running, *queued, extra)} == {"cancelled"}


# ------------------------------------------------------------------ events, outputs, delete


def test_events_after_the_end_replay_everything(start_daemon: Callable[..., RunningDaemon]) -> None:
    d = start_daemon({"a": sleeper(0.1), "b": py_stage("echo")}, {"ab": {"stages": ["a", "b"]}})
    job = d.submit("ab", {"text": "x"})
    assert d.wait(job)["state"] == "succeeded"
    events = d.events(job)                      # connects after the end
    assert all(ev["job"] == job and isinstance(ev["ts"], float) for ev in events)
    assert [ev["ts"] for ev in events] == sorted(ev["ts"] for ev in events)
    assert events[0] == {**events[0], "type": "state", "state": "queued"}
    assert events[-1]["type"] == "state" and events[-1]["state"] == "succeeded"
    types = [ev["type"] for ev in events]
    for kind in ("stage_started", "progress", "stage_finished", "output"):
        assert kind in types, types
    assert [ev["stage"] for ev in events if ev["type"] == "stage_started"] == ["a", "b"]
    assert [ev["stage"] for ev in events if ev["type"] == "stage_finished"] == ["a", "b"]
    # Same history on a second replay.
    assert d.events(job) == events


def test_quiet_event_streams_time_out_with_a_diagnosis(start_daemon: Callable[..., RunningDaemon],
                                                      tmp_path: Path) -> None:
    # The harness's own waits: a job that sends no event for a while must not hang a test.
    d = start_daemon({"s": py_stage("ticker")}, {"p": {"stages": ["s"]}})
    files = {"ticks": str(tmp_path / "ticks"), "stopped": str(tmp_path / "stopped")}
    job = d.submit("p", params={"s": {**files, "seconds": 0.05}})
    assert [ev["type"] for ev in d.client.events(job, idle_timeout=30)][-1] == "state"    # ends as before
    quiet = d.submit("p", params={"s": files})              # no event between its start and its end
    wait_started(d, quiet, "s")
    t0 = time.monotonic()
    with pytest.raises(EventsIdleTimeout) as err:
        for _ in d.client.events(quiet, idle_timeout=0.5):
            pass
    assert time.monotonic() - t0 < 3
    assert isinstance(err.value, TimeoutError) and err.value.job_id == quiet
    assert quiet in str(err.value) and "0.5 s" in str(err.value)
    t0 = time.monotonic()
    with pytest.raises(AssertionError) as failed:
        d.wait(quiet, timeout=1)
    assert time.monotonic() - t0 < 4
    report = str(failed.value)
    assert f"job {quiet} to end" in report and "running" in report and "stage s: busy" in report, report
    assert "--- tail of" in report, report
    d.client.cancel(quiet)


def test_outputs_have_their_content_types(start_daemon: Callable[..., RunningDaemon]) -> None:
    d = start_daemon({"f": py_stage("files")}, {"p": {"stages": ["f"]}})
    job = d.submit("p")
    doc = d.wait(job)
    assert doc["state"] == "succeeded", doc
    by_name = {o["name"]: o for o in doc["outputs"]}
    assert set(by_name) == {"text", "picture", "sound", "meta"}
    expected = {"text": ("text/plain", "text"), "picture": ("image/png", "image"),
                "sound": ("audio/wav", "audio"), "meta": ("application/json", "json")}
    for name, (ctype, kind) in expected.items():
        body, got = d.client.output(job, name)
        assert got.split(";")[0] == ctype, (name, got)
        assert by_name[name]["kind"] == kind
        assert by_name[name]["size"] == len(body)
    assert d.client.output(job, "text")[0] == b"hello"
    assert d.client.output(job, "picture")[0].startswith(b"\x89PNG\r\n\x1a\n")
    assert d.client.output(job, "sound")[0][8:12] == b"WAVE"
    assert json.loads(d.client.output(job, "meta")[0]) == {"n": 3, "ok": True}
    # By file name too, and a clear 404 for an unknown one.
    assert d.client.output(job, by_name["picture"]["file"])[1] == "image/png"
    with pytest.raises(ApiError) as err:
        d.client.output(job, "nope")
    assert err.value.status == 404 and err.value.code == "unknown_output"


def test_output_names_from_inputs_stay_in_the_job_folder(start_daemon: Callable[..., RunningDaemon]) -> None:
    # A stage that passes its inputs on makes the job's input names output names:
    # they must never become paths outside the job's folder.
    d = start_daemon({"pt": py_stage("passthrough")}, {"p": {"stages": ["pt"]}})
    outside = d.dir / "escaped"
    names = {f"../../../{outside.name}": "a", "/tmp/../" + outside.name: "b", ".hidden": "c",
             "manifest": "d", "ok-name_1": "e"}
    job = d.submit("p", names)
    doc = d.wait(job)
    assert doc["state"] == "succeeded", doc
    assert not list(d.dir.glob("escaped*")) and not list(d.state_dir.glob("escaped*"))
    folder = d.state_dir / "jobs" / job
    files = {o["file"] for o in doc["outputs"]}
    assert len(files) == len(names)
    for o in doc["outputs"]:
        assert "/" not in o["file"] and not o["file"].startswith(".")
        assert (folder / o["file"]).resolve().parent == folder.resolve()
        # Served under the name the stage gave it, with the right bytes.
        assert d.client.output(job, o["name"])[0].decode() == names[o["name"]]
    manifest = json.loads((folder / "manifest.json").read_text())
    assert manifest["id"] == job                                   # not overwritten by an output


def test_delete_finished_job_and_refuse_running(start_daemon: Callable[..., RunningDaemon]) -> None:
    d = start_daemon({"s": py_stage("sleep")}, {"p": {"stages": ["s"]}})
    done = d.submit("p", {"text": "x"}, params={"s": {"seconds": 0.05}})
    assert d.wait(done)["state"] == "succeeded"
    folder = d.state_dir / "jobs" / done
    assert (folder / "text.txt").is_file()

    running = d.submit("p", params={"s": {"seconds": 5}})
    wait_started(d, running, "s")
    with pytest.raises(ApiError) as err:
        d.client.delete(running)
    assert err.value.status == 409 and err.value.code == "job_not_finished"
    assert d.client.job(running)["state"] == "running"          # refused: untouched

    assert d.client.delete(done) == {"deleted": done}
    assert not folder.exists()
    with pytest.raises(ApiError) as err:
        d.client.job(done)
    assert err.value.status == 404
    assert done not in [j["id"] for j in d.client.jobs()["jobs"]]
    with pytest.raises(ApiError) as err:
        d.client.delete(done)
    assert err.value.status == 404

    d.client.cancel(running)
    assert d.client.delete(running) == {"deleted": running}     # terminal now: deletable


def test_a_stage_that_stops_a_job_on_its_own_fails_it_at_once(start_daemon) -> None:
    d = start_daemon({"s": py_stage("stops_itself")}, {"p": {"stages": ["s"]}})
    t0 = time.monotonic()
    doc = d.wait(d.submit("p", {"text": "x"}, timeout_s=60), timeout=30)
    assert doc["state"] == "failed" and "stopped the job without a cancel" in doc["error"]["message"], doc
    assert time.monotonic() - t0 < 20                  # not left to its 60 s timeout
