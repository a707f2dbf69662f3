"""GPU lock files: real `flock`s held by real processes, and two real daemons on one lock dir.

`DeviceLocks` is exercised across processes (flock is per open file, so the
holder runs in a subprocess), including a holder killed with SIGKILL and a
crowd of processes taking overlapping device sets in blocking mode. On this
machine there are no GPUs: devices are only lock and visibility indices, and
`CUDA_VISIBLE_DEVICES` is what a stage worker sees of them.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest
from conftest import ANY_EXIT, RunningDaemon, py_stage

from omnid.locks import DeviceBusy, DeviceLocks, lock_path, read_holder

# A process that takes the given devices and holds them until its stdin closes.
HOLDER = r"""
import sys
from omnid.locks import DeviceLocks
locks = DeviceLocks(sys.argv[1], owner="test-holder")
locks.acquire([int(d) for d in sys.argv[2].split(",")], blocking=len(sys.argv) > 3)
print("held", flush=True)
sys.stdin.read()
locks.release()
print("released", flush=True)
"""

# A process that takes device sets in turn, blocking, `rounds` times; inside each
# critical section it claims a marker file per device with O_EXCL, so two holders
# of one device at once would fail loudly instead of passing unnoticed.
CROWD = r"""
import os, sys, time
from omnid.locks import DeviceLocks

lock_dir, marks, rounds = sys.argv[1], sys.argv[2], int(sys.argv[3])
sets = [[int(d) for d in s.split(",")] for s in sys.argv[4:]]
locks = DeviceLocks(lock_dir, owner="crowd")
for i in range(rounds):
    devices = sets[i % len(sets)]
    locks.acquire(devices, blocking=True)
    assert locks.held == tuple(sorted(set(devices))), locks.held
    for d in devices:
        fd = os.open(os.path.join(marks, f"in{d}"), os.O_CREAT | os.O_EXCL | os.O_WRONLY)
        os.close(fd)
    time.sleep(0.001)
    for d in devices:
        os.unlink(os.path.join(marks, f"in{d}"))
    locks.release()
print("done", flush=True)
"""


@pytest.fixture
def spawn() -> Iterator[Callable[..., subprocess.Popen[str]]]:
    procs: list[subprocess.Popen[str]] = []

    def start(script: str, *args: str) -> subprocess.Popen[str]:
        p = subprocess.Popen([sys.executable, "-c", script, *args], stdin=subprocess.PIPE,
                             stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
        procs.append(p)
        return p

    yield start
    for p in procs:
        if p.poll() is None:
            p.kill()
        p.wait()
        for f in (p.stdin, p.stdout, p.stderr):
            if f:
                f.close()


def wait_line(p: subprocess.Popen[str], expected: str) -> None:
    line = p.stdout.readline().strip() if p.stdout else ""
    assert line == expected, f"holder said {line!r}; stderr: {p.stderr.read() if p.stderr else ''}"


def test_held_lock_refuses_another_process_naming_device_and_holder(tmp_path: Path, spawn) -> None:
    holder = spawn(HOLDER, str(tmp_path), "0,2")
    wait_line(holder, "held")
    mine = DeviceLocks(tmp_path, owner="me")
    with pytest.raises(DeviceBusy) as err:
        mine.acquire([2])
    e = err.value
    assert e.device == 2 and e.path == lock_path(tmp_path, 2)
    assert e.holder == f"pid {holder.pid} (test-holder)"
    assert str(e).startswith(f"GPU 2 is in use by pid {holder.pid}")
    assert read_holder(lock_path(tmp_path, 0)) == f"pid {holder.pid} (test-holder)"
    assert mine.held == ()
    # a device the holder does not have is free
    mine.acquire([1])
    assert mine.held == (1,)
    mine.release()


def test_failed_acquire_releases_what_it_took(tmp_path: Path, spawn) -> None:
    holder = spawn(HOLDER, str(tmp_path), "2")
    wait_line(holder, "held")
    mine = DeviceLocks(tmp_path)
    with pytest.raises(DeviceBusy) as err:
        mine.acquire([1, 2, 3])        # 1 is taken first (sorted order), then 2 is busy
    assert err.value.device == 2
    assert mine.held == ()
    other = DeviceLocks(tmp_path)      # another open file: flock would refuse it if 1 were still held
    other.acquire([1])
    other.release()
    assert not lock_path(tmp_path, 3).exists(), "devices after the busy one must not be touched"


def test_holder_death_releases_the_lock(tmp_path: Path, spawn) -> None:
    holder = spawn(HOLDER, str(tmp_path), "0,1")
    wait_line(holder, "held")
    with pytest.raises(DeviceBusy):
        DeviceLocks(tmp_path).acquire([0])
    inodes = {d: lock_path(tmp_path, d).stat().st_ino for d in (0, 1)}
    os.kill(holder.pid, signal.SIGKILL)
    assert holder.wait(10) == -signal.SIGKILL
    mine = DeviceLocks(tmp_path, owner="next")
    mine.acquire([0, 1])               # non-blocking: the kernel dropped the dead holder's locks
    assert mine.held == (0, 1)
    assert {d: lock_path(tmp_path, d).stat().st_ino for d in (0, 1)} == inodes, "lock files were replaced"
    assert read_holder(lock_path(tmp_path, 0)) == f"pid {os.getpid()} (next)"
    mine.release()


def test_lock_files_are_never_unlinked(tmp_path: Path, spawn) -> None:
    mine = DeviceLocks(tmp_path)
    mine.acquire([0, 5])
    inodes = {d: lock_path(tmp_path, d).stat().st_ino for d in (0, 5)}
    mine.release()
    assert sorted(p.name for p in tmp_path.iterdir()) == ["gpu0.lock", "gpu5.lock"]
    holder = spawn(HOLDER, str(tmp_path), "0,5")
    wait_line(holder, "held")
    holder.stdin.close()               # let it release normally
    wait_line(holder, "released")
    assert holder.wait(10) == 0
    with DeviceLocks(tmp_path) as again:
        again.acquire([5, 0])
    assert {d: lock_path(tmp_path, d).stat().st_ino for d in (0, 5)} == inodes
    assert sorted(p.name for p in tmp_path.iterdir()) == ["gpu0.lock", "gpu5.lock"]


def test_blocking_acquire_waits_for_the_holder(tmp_path: Path, spawn) -> None:
    mine = DeviceLocks(tmp_path)
    mine.acquire([3])
    waiter = spawn(HOLDER, str(tmp_path), "3", "blocking")
    # it cannot print "held" while we hold device 3; releasing lets it through
    deadline = time.monotonic() + 0.3
    while time.monotonic() < deadline:
        assert waiter.poll() is None
        time.sleep(0.05)
    mine.release()
    wait_line(waiter, "held")
    with pytest.raises(DeviceBusy) as err:
        mine.acquire([3])
    assert err.value.holder == f"pid {waiter.pid} (test-holder)"


@pytest.mark.timeout(120)
def test_overlapping_device_sets_never_deadlock(tmp_path: Path, spawn) -> None:
    lock_dir, marks = tmp_path / "lock", tmp_path / "marks"
    marks.mkdir()
    rounds = 150
    # the same three sets, each process starting at a different one and listing devices unsorted
    orders = [["0,1,2", "2,1", "1,3"], ["2,1", "1,3", "0,1,2"], ["1,3", "0,1,2", "2,1"], ["3,1", "2,0,1", "1,2"]]
    crowd = [spawn(CROWD, str(lock_dir), str(marks), str(rounds), *sets) for sets in orders]
    deadline = time.monotonic() + 90
    for p in crowd:
        try:
            out, err = p.communicate(timeout=max(1.0, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            pytest.fail(f"a process taking overlapping device sets is stuck (deadlock?): pid {p.pid}")
        assert p.returncode == 0 and out.strip() == "done", err
    assert sorted(p.name for p in lock_dir.iterdir()) == [f"gpu{d}.lock" for d in range(4)]
    assert list(marks.iterdir()) == []


# ------------------------------------------------------------------------- with real daemons


PROBE = '''
import os

def cvd(inputs, params, ctx):
    return {"cvd": "[" + os.environ.get("CUDA_VISIBLE_DEVICES", "<unset>") + "]"}
'''


def probe_stage(tmp: Path, **extra: object) -> dict[str, object]:
    (tmp / "probe_cvd.py").write_text(PROBE)
    return {"engine": "python", "function": "probe_cvd:cvd", "python_path": [str(tmp)], **extra}


def test_second_daemon_on_a_held_gpu_refuses_and_the_first_keeps_serving(start_daemon, tmp_path: Path) -> None:
    shared = tmp_path / "gpulocks"
    stages = {"s": py_stage("echo", devices=[0])}
    pipelines = {"p": {"stages": ["s"]}}
    first: RunningDaemon = start_daemon(stages, pipelines, {"lock_dir": str(shared)})
    inode = lock_path(shared, 0).stat().st_ino
    t0 = time.monotonic()
    second: RunningDaemon = start_daemon(stages, pipelines, {"lock_dir": str(shared)}, wait=False,
                                         expect_exit=ANY_EXIT)      # checked below: not 0
    code = second.proc.wait(30)
    elapsed = time.monotonic() - t0
    out = second.log()
    assert code != 0, out
    assert elapsed < 15, f"the second daemon took {elapsed:.1f} s to give up"
    assert "GPU 0" in out and f"pid {first.proc.pid}" in out, out
    assert "stage worker spawned" not in out, "it must refuse before starting any worker"
    assert not second.socket.exists()
    # the first one is untouched: still holding device 0, still serving
    assert lock_path(shared, 0).stat().st_ino == inode
    with pytest.raises(DeviceBusy) as err:
        DeviceLocks(shared).acquire([0])
    assert err.value.holder.startswith(f"pid {first.proc.pid} ")
    doc = first.wait(first.submit("p", {"text": "still here"}), timeout=60)
    assert doc["state"] == "succeeded", doc


def test_lock_is_released_when_the_daemon_stops(start_daemon) -> None:
    d: RunningDaemon = start_daemon({"s": py_stage("echo", devices=[1, 0])}, {"p": {"stages": ["s"]}})
    with pytest.raises(DeviceBusy):
        DeviceLocks(d.lock_dir).acquire([1])
    assert d.stop() == 0
    with DeviceLocks(d.lock_dir) as locks:
        locks.acquire([0, 1])
        assert locks.held == (0, 1)
    assert sorted(p.name for p in d.lock_dir.iterdir()) == ["gpu0.lock", "gpu1.lock"]


def test_worker_sees_its_stages_devices_as_cuda_visible_devices(start_daemon, tmp_path: Path) -> None:
    stages = {"two": probe_stage(tmp_path, devices=[2, 0]), "one": probe_stage(tmp_path, devices=[1]),
              "cpu": probe_stage(tmp_path, devices=[])}
    d: RunningDaemon = start_daemon(stages, {n: {"stages": [n]} for n in stages})
    seen = {}
    for name in stages:
        doc = d.wait(d.submit(name, {}), timeout=60)
        assert doc["state"] == "succeeded", doc
        seen[name] = d.client.output(doc["id"], "cvd")[0].decode()
    # in the order the config gives them (what the stage's own index 0, 1 ... map to)
    assert seen == {"two": "[2,0]", "one": "[1]", "cpu": "[]"}
    snap = d.stages()
    assert snap["two"]["devices"] == [2, 0] and snap["cpu"]["devices"] == []
