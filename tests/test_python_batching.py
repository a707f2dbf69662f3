"""A python stage's `batch_function`, through a real daemon (tests/fixtures/batchstages.py).

One daemon for the module, three stages:
- `b`: only `batch_function = "batchstages:upper"`, `max_inflight = 8`: every call appends the jobs it
  got to the file the jobs' `log` parameter names;
- `solo`: `function` and `batch_function`, `max_inflight = 1`: exactly the engine without batching;
- `raiser`: a batch function that raises.

To make "submitted at once" deterministic, a test first starts a `gate` job on `b` (its `hold`
parameter keeps the batch call going until the gate is cancelled) and waits until the gate's batch
call has begun (the call's own line in the gate's log: `Started` alone is not enough, as the worker
takes whatever else is in its queue into the same call until the call begins). Then it submits its
jobs, waits until each is in `b`'s input queue, and cancels the gate: the worker then takes every
queued job into one batch call.
"""

from __future__ import annotations

import json
import subprocess
import sys
import threading
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from conftest import FIXTURES, RunningDaemon, daemon_config, module_daemon, short_tmpdir, wait_for, wait_started


def _stage(**keys: Any) -> dict[str, Any]:
    return {"engine": "python", "python_path": [str(FIXTURES)], **keys}


@pytest.fixture(scope="module")
def daemon() -> Iterator[RunningDaemon]:
    d = short_tmpdir()
    stages = {
        "b": _stage(batch_function="batchstages:upper", max_inflight=8, queue_capacity=16),
        "solo": _stage(function="batchstages:single", batch_function="batchstages:upper", max_inflight=1,
                       queue_capacity=16),
        "raiser": _stage(batch_function="batchstages:raises", max_inflight=4),
    }
    pipelines = {name: {"stages": [name]} for name in stages}
    with module_daemon(d, stages, pipelines, ready_timeout=120) as rd:
        yield rd


def _calls(log: Path) -> list[dict[str, Any]]:
    """The batch calls the function recorded: `{"jobs": [...], "size": N}` each."""
    if not log.exists():
        return []
    return [json.loads(line) for line in log.read_text().splitlines()]


def _queued(daemon: RunningDaemon, job: str, stage: str) -> bool:
    return bool(daemon.client.job(job)["stages"][stage]["state"] == "queued")


def _gated(daemon: RunningDaemon, tmp_path: Path, jobs: list[tuple[dict[str, Any], dict[str, Any]]],
           cancel: tuple[int, ...] = ()) -> list[str]:
    """Submit `jobs` ((inputs, params) each) to `b` while a gate job holds it; cancel the jobs at the
    indices `cancel` while they wait in the queue; then open the gate."""
    gate_log = tmp_path / "gate.jsonl"
    gate = daemon.submit("b", {"text": "gate"}, {"b": {"hold": True, "log": str(gate_log)}})
    try:
        wait_started(daemon, gate, "b", timeout=60)
        wait_for(lambda: any(gate in c["jobs"] for c in _calls(gate_log)), 60, "the gate's batch call", every=0.05)
        ids = [daemon.submit("b", inputs, {"b": params}) for inputs, params in jobs]
        for job in ids:
            wait_for(lambda: _queued(daemon, job, "b"), 30, f"job {job} in b's queue", every=0.05)
        for i in cancel:
            assert daemon.client.cancel(ids[i])["state"] == "cancelled"
    except BaseException:
        daemon.client.cancel(gate)      # (the next test finds b free)
        raise
    assert daemon.client.cancel(gate)["state"] == "cancelled"
    return ids


def _text(daemon: RunningDaemon, job: str) -> str:
    return daemon.client.output(job, "text")[0].decode()


def test_eight_jobs_at_once_are_one_call_each_its_own_output(daemon: RunningDaemon, tmp_path: Path) -> None:
    log = tmp_path / "calls.jsonl"
    ids = _gated(daemon, tmp_path, [({"text": f"job {i}"}, {"log": str(log), "tag": f"t{i}"}) for i in range(8)])
    docs = [daemon.wait(job, timeout=60) for job in ids]
    assert [doc["state"] for doc in docs] == ["succeeded"] * 8, [doc["error"] for doc in docs]
    calls = _calls(log)
    assert [c["size"] for c in calls] == [8], calls
    assert sorted(calls[0]["jobs"]) == sorted(ids)
    for i, job in enumerate(ids):
        assert _text(daemon, job) == f"t{i}:JOB {i}"          # its own input, its own params
        index = json.loads(daemon.client.output(job, "index")[0])
        assert calls[0]["jobs"][index] == job                 # its slot of the call


def test_jobs_submitted_together_without_a_gate_share_calls(daemon: RunningDaemon, tmp_path: Path) -> None:
    """No gate: whatever arrives while a call runs (0.3 s each) joins the next call."""
    log = tmp_path / "calls.jsonl"
    ids: list[str | None] = [None] * 8

    def submit(i: int) -> None:
        ids[i] = daemon.submit("b", {"text": f"n{i}"}, {"b": {"log": str(log), "delay": 0.3}})
    threads = [threading.Thread(target=submit, args=(i,)) for i in range(8)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(30)
    jobs = [job for job in ids if job is not None]
    assert len(jobs) == 8
    docs = [daemon.wait(job, timeout=60) for job in jobs]
    assert [doc["state"] for doc in docs] == ["succeeded"] * 8
    calls = _calls(log)
    assert sum(c["size"] for c in calls) == 8
    assert len(calls) < 8 and max(c["size"] for c in calls) > 1, calls
    for i, job in enumerate(ids):
        assert job is not None and _text(daemon, job) == f"up:N{i}"


def test_an_exception_in_its_slot_fails_one_job_alone(daemon: RunningDaemon, tmp_path: Path) -> None:
    log = tmp_path / "calls.jsonl"
    ids = _gated(daemon, tmp_path, [({"text": t}, {"log": str(log)}) for t in ("a", "boom", "c")])
    docs = [daemon.wait(job, timeout=60) for job in ids]
    assert [doc["state"] for doc in docs] == ["succeeded", "failed", "succeeded"]
    assert docs[1]["error"]["message"] == "stage 'b': ValueError: cannot shout 'boom'", docs[1]["error"]
    assert [c["size"] for c in _calls(log)] == [3]
    assert _text(daemon, ids[0]) == "up:A" and _text(daemon, ids[2]) == "up:C"


def test_a_queued_job_cancelled_before_the_call_is_not_in_it(daemon: RunningDaemon, tmp_path: Path) -> None:
    log = tmp_path / "calls.jsonl"
    ids = _gated(daemon, tmp_path, [({"text": t}, {"log": str(log)}) for t in ("a", "b", "c")], cancel=(1,))
    docs = [daemon.wait(job, timeout=60) for job in ids]
    assert [doc["state"] for doc in docs] == ["succeeded", "cancelled", "succeeded"]
    calls = _calls(log)
    assert [c["jobs"] for c in calls] == [[ids[0], ids[2]]]


def test_a_raising_batch_function_fails_its_jobs(daemon: RunningDaemon, tmp_path: Path) -> None:
    doc = daemon.wait(daemon.submit("raiser", {"text": "x"}), timeout=60)
    assert doc["state"] == "failed"
    assert "RuntimeError: the whole batch of 1 failed" in doc["error"]["message"], doc["error"]


def test_max_inflight_1_with_a_function_never_calls_the_batch_function(daemon: RunningDaemon,
                                                                        tmp_path: Path) -> None:
    log = tmp_path / "calls.jsonl"
    ids = [daemon.submit("solo", {"text": f"s{i}"}, {"solo": {"log": str(log)}}) for i in range(4)]
    docs = [daemon.wait(job, timeout=60) for job in ids]
    assert [doc["state"] for doc in docs] == ["succeeded"] * 4
    assert [_text(daemon, job) for job in ids] == [f"single:S{i}" for i in range(4)]
    assert _calls(log) == []
    assert daemon.stages()["solo"]["info"]["batching"] is False
    assert daemon.stages()["b"]["info"]["batching"] is True


def test_check_reports_a_batch_function_it_cannot_find(tmp_path: Path) -> None:
    cfg = daemon_config(tmp_path, {"b": _stage(batch_function="nosuchmodule_xyz:fn", max_inflight=4)},
                        {"p": {"stages": ["b"]}})
    result = subprocess.run([sys.executable, "-m", "omnid", "-c", str(cfg), "--check"], capture_output=True,
                            text=True, timeout=60, stdin=subprocess.DEVNULL)
    assert result.returncode != 0
    assert "stages.b.batch_function" in result.stderr and "nosuchmodule_xyz" in result.stderr, result.stderr
