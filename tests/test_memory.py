"""Memory: a leaking worker is restarted between jobs (`max_rss_mb`), and a worker the kernel's OOM
killer takes is reported as such.

The leak guard: a python stage that keeps 400 MiB more with every job, under max_rss_mb = 700:
the first job leaves it under, the second over, and the worker is replaced before the third,
with no job failed, `rss_restarts` and its metric counting it. The OOM kill: the daemon runs in a
memory cgroup of its own (made by the test, v1 or v2) with a limit its stage's job runs into; the
job fails with the SIGKILL, the worker's last RSS and "likely out of memory". Skipped, with the
reason, where the test cannot make a cgroup.
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import pytest
from conftest import (
    FIXTURES,
    RunningDaemon,
    daemon_config,
    metric,
    short_tmpdir,
    sigint_default,
    stop_and_check,
    wait_for,
    wait_ready,
)


def res_stage(function: str, **extra: Any) -> dict[str, Any]:
    return {"engine": "python", "function": f"resourcestages:{function}", "python_path": [str(FIXTURES)], **extra}



def test_a_worker_over_max_rss_mb_is_restarted_between_jobs(start_daemon: Callable[..., RunningDaemon]) -> None:
    d = start_daemon({"leaky": res_stage("leak", defaults={"mb": 400}, max_rss_mb=700)},
                     {"p": {"stages": ["leaky"]}})
    first_pid = d.stage_pid("leaky")
    one = d.wait(d.submit("p", {"text": "1"}))
    assert one["state"] == "succeeded", one
    time.sleep(2.5)                                      # the guard looks once a second: it had its looks
    snap = d.stages()["leaky"]
    assert snap["pid"] == first_pid and snap["rss_restarts"] == 0, snap       # under the bound: kept
    two = d.wait(d.submit("p", {"text": "2"}))
    assert two["state"] == "succeeded", two               # the job that went over still finished
    snap = wait_for(lambda: (s := d.stages()["leaky"])["pid"] not in (None, first_pid) and s["state"] == "ready"
                    and s, 60, "the leaking worker to be replaced")
    assert snap["rss_restarts"] == 1 and snap["rss_bytes"] < 700 << 20, snap
    assert metric(d, 'omnid_stage_rss_restarts_total{replica="0",stage="leaky"}') == 1
    assert "over max_rss_mb" in d.log()
    three = d.wait(d.submit("p", {"text": "3"}))
    assert three["state"] == "succeeded" and three["error"] is None, three
    assert d.stage_pid("leaky") == snap["pid"]


# ------------------------------------------------------------------ the OOM killer


def _memory_cgroup() -> tuple[Path, str] | None:
    """Where a child memory cgroup of ours can go, and its version ("v1" or "v2")."""
    try:
        lines = Path("/proc/self/cgroup").read_text().splitlines()
    except OSError:
        return None
    for line in lines:
        hier, _, rest = line.partition(":")
        controllers, _, path = rest.partition(":")
        if "memory" in controllers.split(","):
            base = Path("/sys/fs/cgroup/memory") / path.lstrip("/")
            if (base / "memory.limit_in_bytes").exists():
                return base, "v1"
        if hier == "0" and not controllers:
            base = Path("/sys/fs/cgroup") / path.lstrip("/")
            if "memory" in (base / "cgroup.subtree_control").read_text() if (base / "cgroup.subtree_control").exists() \
                    else False:
                return base, "v2"
    return None


@contextmanager
def memory_limited_cgroup(limit_mb: int) -> Iterator[Path]:
    where = _memory_cgroup()
    if where is None or os.geteuid() != 0:
        pytest.skip("no memory cgroup this test may make (needs root and a memory controller)")
    base, version = where
    cg = base / f"omnid-test-{os.getpid()}"
    try:
        cg.mkdir()
        if version == "v1":
            (cg / "memory.limit_in_bytes").write_text(str(limit_mb << 20))
            if (cg / "memory.memsw.limit_in_bytes").exists():
                (cg / "memory.memsw.limit_in_bytes").write_text(str(limit_mb << 20))
        else:
            (cg / "memory.max").write_text(str(limit_mb << 20))
            (cg / "memory.swap.max").write_text("0")
    except OSError as e:
        pytest.skip(f"cannot make a memory cgroup under {base}: {e}")
    try:
        yield cg
    finally:
        deadline = time.monotonic() + 10
        while time.monotonic() < deadline:
            try:
                cg.rmdir()
                break
            except OSError:
                time.sleep(0.1)


def test_a_worker_the_oom_killer_takes_is_reported_as_out_of_memory() -> None:
    with memory_limited_cgroup(1024) as cg:
        d = short_tmpdir()
        cfg = daemon_config(d, {"hog": res_stage("hog")}, {"p": {"stages": ["hog"]}}, {"log_level": "info"})

        def into_cgroup() -> None:
            sigint_default()
            (cg / "cgroup.procs").write_text(str(os.getpid()))

        with open(d / "omnid.log", "ab") as log:
            proc = subprocess.Popen([sys.executable, "-m", "omnid", "-c", str(cfg)], stdout=log,
                                    stderr=subprocess.STDOUT, cwd=str(d), preexec_fn=into_cgroup)
        rd = RunningDaemon(proc, d, cfg, d / "omnid.sock", d / "state", d / "lock", d / "omnid.log")
        try:
            wait_ready(rd)
            pid = rd.stage_pid("hog")
            # 32 MiB every 0.3 s: some 10 s to the limit, so the supervisor's once-a-second look at the
            # worker's RSS (what the report gives) has had its looks even on a busy machine.
            doc = rd.wait(rd.submit("p", {"text": "eat"}, params={"hog": {"every_s": 0.3}}), timeout=120)
            assert doc["state"] == "failed", doc
            message = doc["error"]["message"]
            print(f"the job's error: {message}")
            assert f"pid {pid}" in message and "SIGKILL" in message, message
            assert re.search(r"last RSS \d+ MiB", message), message
            assert "likely out of memory" in message, message
            # the stage comes back, and says why it went in its last error
            snap = rd.wait_stage_state("hog", ("ready",), timeout=60)
            assert snap["pid"] != pid and "likely out of memory" in snap["last_error"], snap
        finally:
            problems = stop_and_check(rd)
        assert not problems, "\n".join(problems)
