"""Large values between stages through shared memory, end to end: real daemons, real workers, real
SIGKILLs (the in-process tests of the pool and codec are tests/unit/dataplane/test_shm_pool.py).

What is checked, and how:
- a value's contents arrive exactly (CRC-32 of its bytes, dtype, shape), built on the receiving
  stage's pool without a copy (its address lies inside the receiver's `memfd:omnid-<stage>` mapping),
  the sender maps that pool, and the slot is freed (GET /v1/stages `shm.slots` back to 0);
- a receiver may keep a value across jobs; the slot stays taken until it lets go;
- SIGKILL of the sender, of the receiver or of the supervisor while a large value is being copied
  (the moment is found by watching the sender's RssShmem grow as it writes into the pool): no slot
  stays taken, the old pool is mapped by no process, nothing is left in /dev/shm;
- 500 jobs leak neither slots nor memory; a full pool is backpressure; a value larger than the pool
  goes by socket; a 1 GB tensor costs its producer's copy plus the pool's, not more.

Stage names carry a random token per test, so that the memfds of other daemons on the machine
(other test runs) are never taken for ours.
"""

from __future__ import annotations

import json
import os
import re
import signal
import sys
import threading
import time
import uuid
from collections.abc import Callable
from typing import Any

import psutil
import pytest
from conftest import FIXTURES, RunningDaemon, wait_for, wait_gone

if str(FIXTURES) not in sys.path:
    sys.path.insert(0, str(FIXTURES))
import shmstages  # noqa: E402  (the test computes the expected digests with the stages' own code)

MB = 1 << 20
SLOTS_FREED_S = 10          # heartbeats come every 0.2 s in tests: a freed slot shows within this


# ------------------------------------------------------------------------------- helpers


def stage(function: str, **extra: Any) -> dict[str, Any]:
    """A python stage running a function of tests/fixtures/shmstages.py."""
    return {"engine": "python", "function": f"shmstages:{function}", "python_path": [str(FIXTURES)], **extra}


def names(*roles: str) -> list[str]:
    token = uuid.uuid4().hex[:6]
    return [f"{role}{token}" for role in roles]


def shm_of(d: RunningDaemon, name: str) -> dict[str, int]:
    return d.stages()[name]["shm"]


def wait_pool_empty(d: RunningDaemon, *stages: str, timeout: float = SLOTS_FREED_S) -> None:
    def empty() -> bool:
        snap = d.stages()
        return all(snap[s]["shm"]["slots"] == 0 and snap[s]["shm"]["used_bytes"] == 0 for s in stages)
    try:
        wait_for(empty, timeout, f"the pools of {stages} to be empty", every=0.05)
    except AssertionError as e:
        raise AssertionError(f"{e}; now: {[(s, shm_of(d, s)) for s in stages]}\n{d.diagnose()}") from None


def report(d: RunningDaemon, job: str) -> dict[str, Any]:
    return json.loads(d.client.output(job, "report")[0])


def succeed(d: RunningDaemon, job: str, timeout: float = 60) -> dict[str, Any]:
    doc = d.wait(job, timeout)
    assert doc["state"] == "succeeded", f"{doc['state']}: {doc['error']}\n{d.diagnose(job)}"
    return doc


def pool_maps(pid: int, stage_name: str) -> list[tuple[int, int, int]]:
    """(start, end, inode) of each mapping of stage `stage_name`'s pool in process `pid`."""
    try:
        return shmstages.pool_ranges(stage_name, pid)
    except (FileNotFoundError, ProcessLookupError, PermissionError):
        return []


def rss_shmem(pid: int) -> int:
    """Bytes of shared memory (memfd, /dev/shm) the process has touched: grows as a sender copies."""
    try:
        with open(f"/proc/{pid}/status") as f:
            for line in f:
                if line.startswith("RssShmem:"):
                    return int(line.split()[1]) * 1024
    except (FileNotFoundError, ProcessLookupError):
        pass
    return 0


def wait_copying(pid: int, at_least: int, timeout: float = 60) -> int:
    """Wait until process `pid` has written `at_least` bytes into shared memory (it is copying a large
    value into a pool); poll every ms, so that the copy is caught in its middle. Returns the figure."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        n = rss_shmem(pid)
        if n >= at_least:
            return n
        time.sleep(0.001)
    raise AssertionError(f"process {pid} did not start copying into a pool within {timeout} s "
                         f"(RssShmem {rss_shmem(pid)})")


def memfd_holders(stage_names: list[str]) -> list[str]:
    """Every process on the machine that holds (an fd) or maps a pool of one of these stages."""
    pattern = re.compile(r"/memfd:omnid-(" + "|".join(map(re.escape, stage_names)) + r") ")
    found = []
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            for fd in os.listdir(f"/proc/{entry}/fd"):
                try:
                    link = os.readlink(f"/proc/{entry}/fd/{fd}")
                except OSError:
                    continue
                if pattern.match(link + " "):
                    found.append(f"pid {entry} fd {fd}: {link}")
            with open(f"/proc/{entry}/maps") as f:
                for line in f:
                    if pattern.search(line):
                        found.append(f"pid {entry} maps {line.strip()}")
        except OSError:                 # gone meanwhile, or another user's
            continue
    return found


def processes(d: RunningDaemon) -> list[psutil.Process]:
    procs = [psutil.Process(d.proc.pid)]
    return procs + procs[0].children(recursive=True)


def memory_sum(d: RunningDaemon, kind: str = "rss") -> int:
    total = 0
    for p in processes(d):
        try:
            total += getattr(p.memory_full_info() if kind == "pss" else p.memory_info(), kind)
        except (psutil.NoSuchProcess, psutil.AccessDenied):
            pass
    return total


def omnid_in_dev_shm() -> set[str]:
    return {n for n in os.listdir("/dev/shm") if "omnid" in n}


def metric(d: RunningDaemon, name: str, stage_name: str) -> float:
    for line in d.client.metrics().splitlines():      # a counter is exposed as NAME_total
        labels = f'{{replica="0",stage="{stage_name}"}} '
        if line.startswith((f'{name}{labels}', f'{name}_total{labels}')):
            return float(line.split()[-1])
    raise AssertionError(f"no {name} for stage {stage_name} in /metrics")


class Sampler:
    """Calls `probe()` every `every` s in a thread; `values` are its answers."""

    def __init__(self, probe: Callable[[], Any], every: float = 0.02) -> None:
        self.values: list[Any] = []
        self._probe, self._every = probe, every
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def _run(self) -> None:
        while not self._stop.is_set():
            try:
                self.values.append(self._probe())
            except Exception:       # a process gone between listing and reading it
                pass
            self._stop.wait(self._every)

    def __enter__(self) -> Sampler:
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join(10)


# ------------------------------------------------------------------------------- 1. the hand-off


def test_large_values_cross_through_the_receivers_pool(start_daemon: Callable[..., RunningDaemon]) -> None:
    up, down = names("u", "d")
    d = start_daemon({up: stage("produce"), down: stage("check")}, {"p": {"stages": [up, down]}})
    params = {up: {"f16_mb": 64, "bf16_mb": 16, "arr_mb": 8, "blob_mb": 4, "seed": 11}, down: {"hold_s": 1.5}}
    job = d.submit("p", {}, params)

    # While the receiver holds the values, they take a slot of its pool, and the sender maps that pool.
    with Sampler(lambda: shm_of(d, down), every=0.05) as seen:
        wait_for(lambda: d.client.job(job)["stages"][down]["state"] == "running" or
                 d.client.job(job)["state"] != "running", 60, f"{down} to start the job")
        wait_for(lambda: any(s["slots"] for s in seen.values), 5, f"{down}'s pool to show a slot")
        sender_maps = pool_maps(d.stage_pid(up), down)
        receiver_maps = pool_maps(d.stage_pid(down), down)
        succeed(d, job)
    held = [s for s in seen.values if s["slots"]]
    expected = (64 + 16 + 8 + 4) * MB
    assert held and all(s["used_bytes"] >= expected and s["slots"] == 1 for s in held), held
    assert max(s["used_bytes"] for s in held) < expected + 4096, held
    assert len(sender_maps) == 1 and len(receiver_maps) == 1, (sender_maps, receiver_maps)
    assert sender_maps[0][2] == receiver_maps[0][2], "the sender maps another memfd than the receiver's pool"

    rep = report(d, job)
    # What the producer's code makes from these seeds, computed here (with numpy: the same bytes).
    for name, nbytes, seed in (("f16", 64 * MB, 11), ("bf16", 16 * MB, 12), ("arr", 8 * MB, 13), ("blob", 4 * MB, 14)):
        got = rep["got"][name]
        assert got["digest"] == shmstages.pattern_digest(nbytes, seed) and got["nbytes"] == nbytes, (name, got)
    assert rep["got"]["f16"]["dtype"] == "float16" and rep["got"]["f16"]["shape"] == [65536, 512]
    assert rep["got"]["bf16"]["dtype"] == "bfloat16" and rep["got"]["bf16"]["shape"] == [16384, 512]
    assert rep["got"]["arr"]["dtype"] == "float32" and rep["got"]["arr"]["shape"] == [8192, 256]
    # Built on the pool, not copied out of it (bytes are copied by design: they cannot borrow memory).
    assert [rep["got"][n]["on_pool"] for n in ("f16", "bf16", "arr", "blob")] == [True, True, True, False], rep["got"]
    wait_pool_empty(d, down)

    # A second job (torch already imported): the hand-off itself, timed from the producer's return.
    job2 = d.submit("p", {}, {up: {"f16_mb": 64, "bf16_mb": 16, "arr_mb": 8, "blob_mb": 4, "seed": 11}})
    succeed(d, job2)
    rep2 = report(d, job2)
    assert rep2["got"] == rep["got"]
    print(f"\nhand-off of 92 MB (4 values) through the pool: {rep2['handoff_s'] * 1000:.0f} ms")
    wait_pool_empty(d, down)


# ------------------------------------------------------------------------------- 2. kept values


def test_a_receiver_may_keep_what_it_got(start_daemon: Callable[..., RunningDaemon]) -> None:
    up, down = names("u", "k")
    d = start_daemon({up: stage("produce"), down: stage("keep")}, {"p": {"stages": [up, down]}})

    def run(op: str, seed: int) -> dict[str, Any]:
        job = d.submit("p", {}, {up: {"f16_mb": 8, "seed": seed}, down: {"op": op}})
        succeed(d, job)
        return report(d, job)

    first = run("keep", 21)
    kept_digest = shmstages.pattern_digest(8 * MB, 21)
    assert first["kept"] == [kept_digest] and first["kept_on_pool"] == [True], first
    time.sleep(1)           # five heartbeats: the slot stays taken while the value lives
    assert shm_of(d, down)["slots"] == 1 and shm_of(d, down)["used_bytes"] == 8 * MB, shm_of(d, down)

    for seed in (22, 23, 24):   # later values go to other slots, and leave: the kept one is untouched
        later = run("check", seed)
        assert later["kept"] == [kept_digest], later
        assert later["received"]["digest"] == shmstages.pattern_digest(8 * MB, seed)
    wait_for(lambda: shm_of(d, down)["slots"] == 1, SLOTS_FREED_S, "only the kept slot to stay taken")
    time.sleep(0.5)
    assert shm_of(d, down) == {"capacity_bytes": 1024 * MB, "used_bytes": 8 * MB, "slots": 1}, shm_of(d, down)

    last = run("clear", 25)
    assert last["kept"] == [kept_digest], last
    wait_pool_empty(d, down)


# ------------------------------------------------------------------------------- 3-5. SIGKILLs mid-transfer

BIG = {"n_big": 2, "big_mb": 256, "seed": 31}       # 512 MB in two tensors: the copy takes a while
BIG_BYTES = 512 * MB


def test_sigkill_sender_mid_transfer_frees_its_slot(start_daemon: Callable[..., RunningDaemon]) -> None:
    up, down = names("u", "d")
    # A leaked 512 MB slot would still leave room for the rerun in the default 1 GB pool (the test
    # then fails on the slot count, not on a hang).
    d = start_daemon({up: stage("produce"), down: stage("check")},
                     {"p": {"stages": [up, down]}})
    old_up, old_down = d.stage_pid(up), d.stage_pid(down)
    job = d.submit("p", {}, {up: BIG})
    copied = wait_copying(old_up, 64 * MB)
    os.kill(old_up, signal.SIGKILL)
    assert copied < BIG_BYTES, f"the sender had copied everything ({copied} bytes) before the kill"
    print(f"\nsender killed after copying {copied / MB:.0f} MB of {BIG_BYTES // MB} MB into {down}'s pool")

    doc = d.wait(job, 90)
    # The sender's outputs died undelivered with it: the daemon computes them again (recovery.py),
    # so the job succeeds, with the sender run twice and the receiver once.
    assert doc["state"] == "succeeded", f"{doc['error']}\n{d.diagnose(job)}"
    started = [ev["stage"] for ev in d.events(job) if ev["type"] == "stage_started"]
    assert started.count(up) == 2 and started.count(down) == 1, started
    rep = report(d, job)
    for k in range(BIG['n_big']):
        assert rep["got"][f"big{k}"]["digest"] == rep["sent"][f"big{k}"]["digest"]
    wait_pool_empty(d, down)            # the dead sender's slot was freed when its connection closed

    snap = d.wait_stage_state(up, ("ready", "busy"))
    assert snap["pid"] not in (None, old_up) and snap["restarts"] == 1 and "SIGKILL" in snap["last_error"]
    assert d.stage_pid(down) == old_down and d.stages()[down]["restarts"] == 0
    job2 = d.submit("p", {}, {up: {"f16_mb": 16, "seed": 32}})
    succeed(d, job2)
    assert report(d, job2)["got"]["f16"]["on_pool"] is True
    wait_pool_empty(d, down)


def test_sigkill_receiver_mid_transfer_leaves_no_old_pool(start_daemon: Callable[..., RunningDaemon]) -> None:
    up, down = names("u", "d")
    d = start_daemon({up: stage("produce"), down: stage("check")}, {"p": {"stages": [up, down]}})
    up_pid, old_down = d.stage_pid(up), d.stage_pid(down)
    (old_pool,) = pool_maps(old_down, down)
    job = d.submit("p", {}, {up: BIG})
    copied = wait_copying(up_pid, 64 * MB)
    os.kill(old_down, signal.SIGKILL)
    assert copied < BIG_BYTES, f"the sender had copied everything ({copied} bytes) before the kill"
    print(f"\nreceiver killed after the sender copied {copied / MB:.0f} MB of {BIG_BYTES // MB} MB into its pool")

    doc = d.wait(job, 90)
    print(f"the job {doc['state']}" + (f": {doc['error']['message']}" if doc["error"] else
                                      f", {[e['stage'] for e in d.events(job) if e['type'] == 'stage_started']}"))
    # The receiver had not admitted the job yet: the sender keeps its copy and delivers it again to
    # the new receiver. (Had it been running there, the job would have failed, naming the stage.)
    if doc["state"] == "failed":
        assert doc["error"]["stage"] == down and "SIGKILL" in doc["error"]["message"], doc["error"]
    else:
        assert doc["state"] == "succeeded", doc
        rep = report(d, job)
        assert all(rep["got"][f"big{k}"]["digest"] == rep["sent"][f"big{k}"]["digest"] for k in range(BIG['n_big']))
        assert rep["pid"] != old_down
    snap = d.wait_stage_state(down, ("ready", "busy"))
    assert snap["pid"] not in (None, old_down) and snap["restarts"] == 1
    assert d.stage_pid(up) == up_pid
    wait_pool_empty(d, down)

    # The sender's next hand-off goes to the new receiver's pool, which it maps instead of the old one.
    job2 = d.submit("p", {}, {up: {"f16_mb": 16, "seed": 41}})
    succeed(d, job2)
    rep2 = report(d, job2)
    assert rep2["got"]["f16"]["on_pool"] is True and rep2["got"]["f16"]["digest"] == rep2["sent"]["f16"]["digest"]
    new_down = d.stage_pid(down)
    (new_pool,) = pool_maps(new_down, down)
    assert new_pool[2] != old_pool[2]
    assert pool_maps(up_pid, down) and {m[2] for m in pool_maps(up_pid, down)} == {new_pool[2]}, \
        pool_maps(up_pid, down)
    assert len(pool_maps(up_pid, down)) == 1, pool_maps(up_pid, down)
    # The dead incarnation's pool is gone: no process maps that memfd any more.
    stale = [f"pid {p.pid}" for p in processes(d) if any(m[2] == old_pool[2] for m in pool_maps(p.pid, down))]
    assert not stale, f"the killed receiver's pool (inode {old_pool[2]}) is still mapped by {stale}"
    wait_pool_empty(d, down)


def test_sigkill_supervisor_mid_transfer_leaves_nothing(start_daemon: Callable[..., RunningDaemon]) -> None:
    up, down = names("u", "d")
    dev_shm_before = omnid_in_dev_shm()
    d = start_daemon({up: stage("produce"), down: stage("check")}, {"p": {"stages": [up, down]}})
    workers = d.worker_pids()
    assert len(workers) >= 2
    assert memfd_holders([up, down]), "the pools should be there before the kill"
    d.submit("p", {}, {up: BIG})
    copied = wait_copying(d.stage_pid(up), 64 * MB)
    assert d.kill9() == -signal.SIGKILL
    print(f"\nsupervisor killed while the sender had copied {copied / MB:.0f} MB")

    assert not wait_gone(workers, timeout=10), "workers outlived their SIGKILLed supervisor"
    try:
        wait_for(lambda: not memfd_holders([up, down]), 5, "no process to hold our pools", every=0.1)
    except AssertionError:
        raise AssertionError(f"our pools outlived the daemon: {memfd_holders([up, down])}") from None
    assert omnid_in_dev_shm() <= dev_shm_before, omnid_in_dev_shm() - dev_shm_before


# ------------------------------------------------------------------------------- 6. many jobs


def test_many_small_handoffs_leak_nothing(start_daemon: Callable[..., RunningDaemon]) -> None:
    up, down = names("u", "d")
    dev_shm_before = omnid_in_dev_shm()
    d = start_daemon({up: stage("small"), down: stage("small_check")}, {"p": {"stages": [up, down]}},
                     {"shm_min_bytes": 65536})
    jobs: list[str] = []
    rss_at: dict[int, int] = {}
    t0 = time.monotonic()
    for wave in range(5):
        batch = [d.submit("p", {"text": f"job {len(jobs) + k}"}) for k in range(100)]
        jobs += batch
        d.wait(batch[-1], 120)
        states = {}
        for job in batch:
            doc = wait_for(lambda: (lambda doc: doc if doc["state"] in ("succeeded", "failed", "cancelled",
                                                                       "timed_out") else None)(d.client.job(job)),
                           60, f"job {job} to end")
            states[job] = doc["state"]
            assert doc["state"] == "succeeded", f"{job}: {doc['error']}"
        rss_at[len(jobs)] = memory_sum(d)
        if wave == 0:
            # the pool was used: the sender maps the receiver's pool
            assert pool_maps(d.stage_pid(up), down), "100 KB arrays did not go through the pool"
    elapsed = time.monotonic() - t0
    wait_pool_empty(d, up, down)
    growth = rss_at[500] - rss_at[100]
    print(f"\n500 jobs in {elapsed:.1f} s; RSS (daemon + workers) at job 100: {rss_at[100] / MB:.0f} MB, "
          f"at job 500: {rss_at[500] / MB:.0f} MB")
    assert growth < 100 * MB, f"RSS grew by {growth / MB:.0f} MB between job 100 and job 500: {rss_at}"
    assert omnid_in_dev_shm() <= dev_shm_before


# ------------------------------------------------------------------------------- 7. a full pool


def test_a_full_pool_is_backpressure(start_daemon: Callable[..., RunningDaemon]) -> None:
    # Room for one 40 MB value in the pool, for eight items in the queue: the sender is held back by
    # the pool alone, while the receiver holds each value 1 s.
    up, down = names("u", "d")
    d = start_daemon({up: stage("produce"), down: stage("check", shm_pool_mb=64, queue_capacity=8)},
                     {"p": {"stages": [up, down]}})
    blocked_before = metric(d, "omnid_stage_blocked_seconds", up)
    with Sampler(lambda: d.stages()[down], every=0.02) as seen:
        jobs = [d.submit("p", {}, {up: {"arr_mb": 40, "seed": 50 + k}, down: {"hold_s": 1.0}}) for k in range(4)]
        for job in jobs:
            succeed(d, job)
    for job in jobs:
        rep = report(d, job)
        assert rep["got"]["arr"]["on_pool"] is True and rep["got"]["arr"]["digest"] == rep["sent"]["arr"]["digest"]
    wait_for(lambda: metric(d, "omnid_stage_blocked_seconds", up) - blocked_before > 0.5, 5,
             f"{up}'s blocked seconds to grow")
    blocked = metric(d, "omnid_stage_blocked_seconds", up) - blocked_before
    used = [s["shm"]["used_bytes"] for s in seen.values]
    assert max(used) <= 64 * MB and max(s["shm"]["slots"] for s in seen.values) == 1, max(used)
    assert max(used) >= 40 * MB
    # The jobs waited in the sender, not in the receiver's queue (which had room for all of them).
    assert max(s["queue_depth"] for s in seen.values) <= 1, [s["queue_depth"] for s in seen.values]
    print(f"\nsender blocked {blocked:.2f} s on a 64 MB pool; peak use {max(used) / MB:.0f} MB")
    assert "error" not in [e["type"] for job in jobs for e in d.events(job)]
    wait_pool_empty(d, down)


# ------------------------------------------------------------------------------- 8. larger than the pool


def test_a_value_larger_than_the_pool_goes_by_socket(start_daemon: Callable[..., RunningDaemon]) -> None:
    up, down = names("u", "d")
    d = start_daemon({up: stage("produce"), down: stage("check", shm_pool_mb=8)}, {"p": {"stages": [up, down]}})
    with Sampler(lambda: shm_of(d, down), every=0.05) as seen:
        job = d.submit("p", {}, {up: {"arr_mb": 32, "seed": 61}, down: {"hold_s": 0.6}})
        succeed(d, job)
    rep = report(d, job)
    assert rep["got"]["arr"]["digest"] == shmstages.pattern_digest(32 * MB, 63)
    assert rep["got"]["arr"]["shape"] == [32 * 1024, 256] and rep["got"]["arr"]["on_pool"] is False
    assert seen.values and all(s["slots"] == 0 and s["used_bytes"] == 0 for s in seen.values), seen.values
    assert seen.values[0]["capacity_bytes"] == 8 * MB


# ------------------------------------------------------------------------------- 9. memory


def test_a_1gb_tensor_costs_two_copies_not_three(start_daemon: Callable[..., RunningDaemon]) -> None:
    available = psutil.virtual_memory().available
    if available < 6 << 30:
        pytest.skip(f"needs 6 GB of available memory, the machine has {available / (1 << 30):.1f} GB")
    up, down = names("u", "d")
    d = start_daemon({up: stage("produce"), down: stage("check", shm_pool_mb=1100)}, {"p": {"stages": [up, down]}})
    succeed(d, d.submit("p", {}, {up: {"f16_mb": 2}}))      # both workers import torch first
    wait_pool_empty(d, down)
    time.sleep(0.3)
    base_pss = memory_sum(d, "pss")

    def meminfo() -> dict[str, int]:
        with open("/proc/meminfo") as f:
            return {k: int(v.split()[0]) * 1024 for k, v in (line.split(":", 1) for line in f)}
    base_info = meminfo()
    t0 = time.monotonic()
    with Sampler(lambda: (memory_sum(d, "pss"), meminfo()), every=0.05) as seen:
        job = d.submit("p", {}, {up: {"f16_mb": 1024, "seed": 71}, down: {"hold_s": 0.5}})
        succeed(d, job, timeout=60)
    elapsed = time.monotonic() - t0
    rep = report(d, job)
    got = rep["got"]["f16"]
    peak_pss = max(v[0] for v in seen.values) - base_pss
    shmem = max(v[1]["Shmem"] for v in seen.values) - base_info["Shmem"]
    avail_drop = base_info["MemAvailable"] - min(v[1]["MemAvailable"] for v in seen.values)
    print(f"\n1 GB tensor: job {elapsed:.1f} s, hand-off {rep['handoff_s']:.2f} s; peak increase of the summed "
          f"PSS of daemon + workers {peak_pss / MB:.0f} MB; Shmem +{shmem / MB:.0f} MB; "
          f"MemAvailable -{avail_drop / MB:.0f} MB (machine-wide)")
    assert peak_pss < 2.3 * (1 << 30), f"peak PSS increase {peak_pss / MB:.0f} MB"
    assert peak_pss > 1.5 * (1 << 30), f"peak PSS increase {peak_pss / MB:.0f} MB: the sampler missed the peak?"
    assert got["digest"] == rep["sent"]["f16"]["digest"] and got["on_pool"] is True, got
    assert got["dtype"] == "float16" and got["shape"] == [1 << 20, 512] and got["nbytes"] == 1 << 30
    wait_pool_empty(d, down)



def test_a_dead_receivers_pool_is_unmapped_without_waiting_for_the_next_handoff(
        start_daemon: Callable[..., RunningDaemon]) -> None:
    up, down = names("u", "d")
    d = start_daemon({up: stage("produce"), down: stage("check")}, {"p": {"stages": [up, down]}})
    succeed(d, d.submit("p", {}, {up: {"arr_mb": 64, "seed": 81}}))
    up_pid, old_down = d.stage_pid(up), d.stage_pid(down)
    (old_pool,) = pool_maps(old_down, down)
    os.kill(old_down, signal.SIGKILL)
    d.wait_stage_state(down, ("ready",))
    # The sender looks once a second (handoff.prune); a preloaded worker is ready again sooner than
    # that, and a loaded machine delays the look: wait up to 5 s, never for a hand-off.
    deadline = time.monotonic() + 5.0
    while (stale := [m for m in pool_maps(up_pid, down) if m[2] == old_pool[2]]) and time.monotonic() < deadline:
        time.sleep(0.1)
    assert not stale, (f"{up} still maps the killed {down}'s pool (inode {old_pool[2]}), "
                       f"{rss_shmem(up_pid) / MB:.0f} MB of it resident")
