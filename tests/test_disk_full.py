"""A full disk under a real daemon: the state dir is a 24 MiB tmpfs mounted by the test.

Jobs that write 1 MiB outputs fill it. The daemon must say so (/v1/ready 503 `disk_full`,
`omnictl health`, a metric), refuse new jobs with 507 and Retry-After on every submit path (the
OpenAI one in OpenAI's shape), let running jobs finish or fail with the ENOSPC reason, lose no job
it answered 201 for (a kill -9 and a restart later, every one is there), free space through
`omnictl rm`, and serve again by itself. A daemon started on a disk with no byte left starts,
serves status, results and rm, and refuses submits until there is room. Its log never shows an
unhandled exception. Needs root (mount); skipped where the test cannot mount.
"""

from __future__ import annotations

import json
import os
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
from conftest import FIXTURES, RunningDaemon, omnictl, short_tmpdir, wait_for
from omnidtest import tmpfs

from omnictl.client import UnixHTTPConnection

DISK_MB = 24
FLOORS = {"min_free_mb": 4, "min_free_inodes": 64, "ballast_mb": 2, "log_level": "info",
          "keep_jobs": 0, "keep_jobs_days": 0}


def res_stage(function: str, **extra: Any) -> dict[str, Any]:
    return {"engine": "python", "function": f"resourcestages:{function}", "python_path": [str(FIXTURES)], **extra}


STAGES = {"blob": res_stage("blob", defaults={"mb": 1}), "drip": res_stage("drip", defaults={"n": 3})}
PIPELINES = {"blob": {"stages": ["blob"]}, "text": {"stages": ["drip"]}}


@pytest.fixture
def small_disk() -> Iterator[Path]:
    """A folder whose `state` is a fresh 24 MiB tmpfs (unmounted at the end)."""
    d = short_tmpdir()
    with tmpfs(d / "state", DISK_MB, mode="0700"):
        yield d


def raw(d: RunningDaemon, method: str, path: str, body: Any = None) -> tuple[int, dict[str, str], Any]:
    """One HTTP request: (status, headers, JSON body)."""
    conn = UnixHTTPConnection(str(d.socket), timeout=30)
    try:
        conn.request(method, path, body=None if body is None else json.dumps(body).encode(),
                     headers={"Content-Type": "application/json"})
        resp = conn.getresponse()
        data = resp.read()
        headers = {k.lower(): v for k, v in resp.getheaders()}
    finally:
        conn.close()
    try:
        return resp.status, headers, json.loads(data)
    except ValueError:
        return resp.status, headers, data.decode(errors="replace")


def fill(folder: Path) -> Path:
    """A file that takes every byte left on the filesystem (the daemon's space is gone)."""
    filler = folder / "filler"
    fd = os.open(filler, os.O_WRONLY | os.O_CREAT, 0o600)
    try:
        for size in (1 << 16, 4096, 512, 1):      # then the last bytes, a little at a time
            try:
                while True:
                    os.write(fd, b"\0" * size)
            except OSError:
                pass
    finally:
        os.close(fd)
    return filler


def ready(d: RunningDaemon) -> tuple[int, Any]:
    status, _, body = raw(d, "GET", "/v1/ready")
    return status, body


def metric(d: RunningDaemon, name: str) -> float:
    _, _, text = raw(d, "GET", "/metrics")
    for line in str(text).splitlines():
        if line.startswith(name + " "):
            return float(line.split()[1])
    raise AssertionError(f"no metric {name} in /metrics")


def assert_clean_log(d: RunningDaemon) -> None:
    text = d.log()
    for bad in ("Traceback", "Exception in callback", "Task exception was never retrieved", "internal_error"):
        assert bad not in text, f"{bad!r} in the daemon's log:\n{text[-6000:]}"


def assert_refused_507(d: RunningDaemon) -> dict[str, Any]:
    status, headers, body = raw(d, "POST", "/v1/jobs", {"pipeline": "blob", "inputs": {"text": "more"}})
    assert status == 507, (status, body)
    assert body["error"]["code"] == "insufficient_storage", body
    assert "min_free_mb" in body["error"]["message"] or "cannot write" in body["error"]["message"], body
    assert int(headers["retry-after"]) > 0, headers
    # the OpenAI path, in OpenAI's error shape
    status, headers, body = raw(d, "POST", "/v1/completions", {"model": "text", "prompt": "hi"})
    assert status == 507, (status, body)
    assert set(body["error"]) == {"message", "type", "param", "code"}, body
    assert body["error"]["code"] == "insufficient_storage" and body["error"]["type"] == "server_error", body
    assert int(headers["retry-after"]) > 0, headers
    return body


def test_a_filling_disk_refuses_new_work_loses_nothing_and_recovers(
        small_disk: Path, start_daemon: Callable[..., RunningDaemon]) -> None:
    d = start_daemon(STAGES, PIPELINES, FLOORS, dir=small_disk)
    state = d.state_dir
    assert (state / "ballast").stat().st_size == 2 << 20
    status, body = ready(d)
    assert status == 200 and body["disk"]["full"] is False, body

    # 1. Jobs of 1 MiB each, submitted at once: the disk fills under the running ones (ENOSPC),
    #    then the floor refuses new ones.
    accepted: list[str] = []
    refused: list[int] = []

    def submit(i: int) -> None:
        status, _, body = raw(d, "POST", "/v1/jobs", {"pipeline": "blob", "inputs": {"text": str(i)},
                                                      "params": {"blob": {"delay": 0.1}}})
        if status == 201:
            accepted.append(body["id"])
            # a 201 means the job is in the database: there it is, right now
            assert raw(d, "GET", f"/v1/jobs/{body['id']}")[0] == 200
        else:
            assert status == 507, (status, body)
            refused.append(i)

    for i in range(30):
        submit(i)
    for j in accepted:
        d.wait(j, timeout=60)
    for i in range(30, 35):
        submit(i)
    assert refused, "the disk never filled: no submit was refused"
    docs = {j: d.wait(j, timeout=60) for j in accepted}
    states = {j: doc["state"] for j, doc in docs.items()}
    for j, doc in docs.items():       # each one finished, or failed with the reason
        assert doc["state"] in ("succeeded", "failed"), doc
        if doc["state"] == "failed":
            assert doc["error"]["code"] == "output_failed" and "No space left" in doc["error"]["message"], doc
    succeeded = [j for j, s in states.items() if s == "succeeded"]
    assert succeeded, states
    print(f"{len(accepted)} accepted ({len(succeeded)} succeeded, {len(accepted) - len(succeeded)} failed for "
          f"want of space), {len(refused)} refused with 507")

    # 2. The daemon says so: ready 503 disk_full, omnictl health, the metric, 507 on every submit path.
    status, body = wait_for(lambda: (r := ready(d))[0] == 503 and r, 10, "ready to turn 503")
    assert "disk_full" in body["reasons"] and body["disk"]["full"] is True, body
    health = omnictl(d, "health")
    assert health.returncode != 0 and "disk" in health.stdout, health
    assert metric(d, "omnid_disk_full") == 1
    assert_refused_507(d)

    # 3. Space comes back through the daemon: rm (files first, then rows) and serving resumes by itself.
    removed = succeeded[: max(1, len(succeeded) - 3)]
    done = omnictl(d, "rm", *removed)
    assert done.returncode == 0, (done.stdout, done.stderr)
    t0 = time.monotonic()
    wait_for(lambda: ready(d)[0] == 200, 10, "ready to turn 200 again after rm")
    print(f"ready again {time.monotonic() - t0:.2f} s after rm of {len(removed)} jobs")
    assert metric(d, "omnid_disk_full") == 0
    again = d.submit("blob", {"text": "after"})
    assert d.wait(again, timeout=60)["state"] == "succeeded"

    # 4. Every job answered 201 is on disk: after a kill -9 and a restart, each one is there, as it ended.
    listed = {j["id"] for j in d.client.jobs(limit=1000)["jobs"]}
    kept = [j for j in accepted if j not in removed] + [again]
    assert set(kept) <= listed and not set(removed) & listed, (kept, listed)
    assert_clean_log(d)
    d.kill9()
    d2 = start_daemon(STAGES, PIPELINES, FLOORS, dir=small_disk)
    for j in kept:
        doc = d2.client.job(j)
        assert doc["state"] == (states.get(j) or "succeeded"), doc
    assert_clean_log(d2)


def test_a_daemon_starts_on_a_full_disk_and_frees_space(
        small_disk: Path, start_daemon: Callable[..., RunningDaemon]) -> None:
    d = start_daemon(STAGES, PIPELINES, FLOORS, dir=small_disk)
    jobs = [d.submit("blob", {"text": str(i)}) for i in range(3)]
    for j in jobs:
        assert d.wait(j, timeout=60)["state"] == "succeeded"
    assert d.stop() == 0
    filler = fill(d.state_dir)
    assert os.statvfs(d.state_dir).f_bavail < 4, "the filler left room"

    d2 = start_daemon(STAGES, PIPELINES, FLOORS, dir=small_disk, wait=False)
    # it starts: every stage warm, not ready only for the disk
    def warm_but_full() -> Any:
        try:
            status, body = ready(d2)
        except OSError:
            return None
        return status == 503 and not body["not_ready"] and body["reasons"] == ["disk_full"] and body
    wait_for(warm_but_full, 120, "the daemon to start on a full disk", every=0.2)
    # status, results, rm work; submits are refused with the reason
    assert d2.client.job(jobs[0])["state"] == "succeeded"
    status, headers, _ = raw(d2, "GET", f"/v1/jobs/{jobs[0]}/outputs/data")
    assert status == 200 and int(headers["content-length"]) == 1 << 20
    assert_refused_507(d2)
    done = omnictl(d2, "rm", jobs[1])
    assert done.returncode == 0, (done.stdout, done.stderr)
    assert raw(d2, "GET", f"/v1/jobs/{jobs[1]}")[0] == 404
    # still full (1 MiB is under the floor): refused; the filler goes: serving by itself
    assert ready(d2)[0] == 503
    filler.unlink()
    wait_for(lambda: ready(d2)[0] == 200, 10, "ready once the filler is gone")
    wait_for(lambda: (d2.state_dir / "ballast").exists(), 5, "the ballast to be made again")
    assert d2.wait(d2.submit("blob", {"text": "room"}), timeout=60)["state"] == "succeeded"
    assert_clean_log(d2)
